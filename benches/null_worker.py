"""A no-op `embed` worker: the ceiling of the load harness itself.

It answers every `embed` at once with zero vectors of MiniLM's width (384), so the same
load against it measures only the dev server, the driver's workflows and the payloads on
this machine. No worker, however fast, can beat this number on the same load: a ratio
between gpulane and the Python worker means little when both are near it.

Usage: null_worker.py --task-queue Q [--address 127.0.0.1:7233]
Prints "null_worker ready" when it polls.
"""

import argparse
import asyncio
import os
import signal

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

DIMENSIONS = 384


@activity.defn(name="embed")
async def embed(payload: dict) -> dict:
    zeros = [0.0] * DIMENSIONS
    return {"embeddings": [zeros for _ in payload["texts"]], "model": "null",
            "dimensions": DIMENSIONS}


async def serve(args):
    client = await Client.connect(args.address, namespace=args.namespace)
    worker = Worker(client, task_queue=args.task_queue, activities=[embed],
                    max_concurrent_activities=args.max_concurrent)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        print(f"null_worker ready: queue {args.task_queue}", flush=True)
        await stop.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task-queue", required=True)
    ap.add_argument("--address", default=os.environ.get("TEMPORAL_ADDRESS", "127.0.0.1:7233"))
    ap.add_argument("--namespace", default=os.environ.get("TEMPORAL_NAMESPACE", "default"))
    ap.add_argument("--max-concurrent", type=int, default=256)
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
