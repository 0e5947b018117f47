"""Embeds texts through Temporal with gpulane, using the `gpulane` client package
(`pip install ./clients/python`): the first call goes to a GPU card when one has room on
`gpu-tools` (else to `cpu-tools`), the second is pinned to whatever served the first, and
if that card vanishes the whole sequence starts again elsewhere. Copy this into your code.

    TEMPORAL_ADDRESS=localhost:7233 python examples/embed_once.py "some text" "more text"
"""

import asyncio
import dataclasses
import json
import os
import sys
import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    import gpulane
    from gpulane import workflow as gw


@workflow.defn
class EmbedWithPinning:
    @workflow.run
    async def run(self, texts: list) -> dict:
        async def job(session: gw.CardSession) -> dict:
            first = await session.embed(gpulane.EmbedRequest(texts=texts))
            # Pinned: the same card (or host CPU) as the first call.
            second = await session.embed(gpulane.EmbedRequest(texts=texts, normalize=False))
            return {"first": dataclasses.asdict(first),
                    "pinned_second_call_device": dataclasses.asdict(second.device)}

        # No card starts the first call within 10 s? It runs on the CPU lane instead.
        return await gw.run_in_session(job, schedule_to_start=timedelta(seconds=10))


async def main(texts):
    client = await Client.connect(os.environ.get("TEMPORAL_ADDRESS", "localhost:7233"))
    queue = f"embed-example-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[EmbedWithPinning]):
        out = await client.execute_workflow(
            EmbedWithPinning.run, texts, id=f"embed-{uuid.uuid4()}", task_queue=queue
        )
    first = out["first"]
    summary = {k: v for k, v in first.items() if k != "embeddings"}
    summary["embeddings"] = [
        "[" + ", ".join(f"{x:.4f}" for x in v[:4]) + f", ... {len(v)} values]" for v in first["embeddings"]
    ]
    summary["pinned_second_call_device"] = out["pinned_second_call_device"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:] or ["Hello from gpulane"]))
    # A short-lived client process can abort while the interpreter finalizes, after its
    # work is done: the SDK's Rust runtime threads outlive it ("Fatal Python error:
    # PyGILState_Release", temporalio/sdk-python#300, open). Seen here once in the demo,
    # exit status 134 after the result printed. Skip the teardown once output is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
