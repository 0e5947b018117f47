"""Workflow load driver: W concurrent workflows, each running one `embed` activity of K
texts on a given task queue, through a real Temporal server.

The driver is also the workflow worker (on its own fresh queue), as a user's application
would be. A round starts all W workflows at once, waits for all results and checks that
each returned K vectors; its wall time runs from the first start to the last result.
One untimed warm-up round of min(W, 4) workflows comes first (connections, the worker's
first-call costs). The report is the median round:

{"task_queue", "workflows", "texts_per_activity", "rounds", "seconds": [...],
 "seconds_median", "activities_per_s", "sentences_per_s", "latency_p50_s", "latency_p95_s"}

With --fanout, one workflow runs the round's W activities at once instead: the server
then does much less per activity (no workflow starts, no result polls), which raises the
harness's own ceiling on a small machine; workers see the same activities.

Texts come from the corpus file in order, wrapping around, so every worker sees the same
requests. Bounded: each round must finish within --timeout seconds, or the driver fails.

Usage: load.py --address 127.0.0.1:PORT --task-queue cpu-tools --corpus FILE
               --workflows 64 --texts 1 [--rounds 3] [--json OUT]
"""

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import time
import uuid
from datetime import timedelta

from temporalio import workflow


@workflow.defn
class BenchEmbed:
    """One `embed` activity on the given queue; returns how many vectors came back (the
    vectors themselves stay in history, not in the driver's memory)."""

    @workflow.run
    async def run(self, queue: str, payload: dict) -> int:
        out = await workflow.execute_activity(
            "embed", payload, task_queue=queue,
            schedule_to_close_timeout=timedelta(seconds=600),
            start_to_close_timeout=timedelta(seconds=300),
        )
        return len(out["embeddings"])


@workflow.defn
class BenchFanout:
    """All the `embed` activities of a round from one workflow, at once (--fanout)."""

    @workflow.run
    async def run(self, queue: str, batches: list) -> list:
        outs = await asyncio.gather(*(
            workflow.execute_activity(
                "embed", {"texts": texts}, task_queue=queue,
                schedule_to_close_timeout=timedelta(seconds=600),
                start_to_close_timeout=timedelta(seconds=300),
            )
            for texts in batches
        ))
        return [len(out["embeddings"]) for out in outs]


async def fanout_round(client, wf_queue, queue, batches, timeout):
    """One workflow runs every batch's activity at once; per-activity latency is not seen
    from outside, so each one counts as the round's wall time."""
    start = time.perf_counter()
    counts = await asyncio.wait_for(client.execute_workflow(
        BenchFanout.run, args=[queue, batches],
        id=f"bench-{uuid.uuid4().hex}", task_queue=wf_queue,
    ), timeout)
    wall = time.perf_counter() - start
    assert counts == [len(b) for b in batches], "a vector per text; this is a bug"
    return wall, [wall] * len(batches)


async def one_round(client, wf_queue, queue, batches, timeout):
    """Starts one workflow per batch at once; returns (wall seconds, per-workflow seconds)."""

    async def one(texts):
        t0 = time.perf_counter()
        n = await client.execute_workflow(
            BenchEmbed.run, args=[queue, {"texts": texts}],
            id=f"bench-{uuid.uuid4().hex}", task_queue=wf_queue,
        )
        assert n == len(texts), f"{n} vectors for {len(texts)} texts"
        return time.perf_counter() - t0

    start = time.perf_counter()
    latencies = await asyncio.wait_for(asyncio.gather(*(one(b) for b in batches)), timeout)
    return time.perf_counter() - start, latencies


async def drive(args):
    from temporalio.client import Client
    from temporalio.worker import Worker
    from temporalio.worker import UnsandboxedWorkflowRunner

    texts = [line for line in pathlib.Path(args.corpus).read_text().split("\n") if line]

    def batches(round_no, count):
        base = round_no * count * args.texts
        return [[texts[(base + i * args.texts + j) % len(texts)] for j in range(args.texts)]
                for i in range(count)]

    client = await Client.connect(args.address, namespace=args.namespace)
    wf_queue = f"bench-wf-{uuid.uuid4().hex[:8]}"
    # Unsandboxed: the driver's own workflow overhead should not be what is measured, and
    # it is the same for every worker under test.
    round_ = fanout_round if args.fanout else one_round
    async with Worker(client, task_queue=wf_queue, workflows=[BenchEmbed, BenchFanout],
                      workflow_runner=UnsandboxedWorkflowRunner(),
                      max_concurrent_workflow_tasks=max(args.workflows, 100)):
        await round_(client, wf_queue, args.task_queue, batches(0, min(args.workflows, 4)),
                     args.timeout)
        rounds = []
        for r in range(args.rounds):
            rounds.append(await round_(client, wf_queue, args.task_queue,
                                       batches(r + 1, args.workflows), args.timeout))

    walls = [w for w, _ in rounds]
    median = statistics.median(walls)
    mid = sorted(rounds, key=lambda x: x[0])[len(rounds) // 2][1]
    lat = sorted(mid)
    return {
        "task_queue": args.task_queue,
        "label": args.label,
        "workflows": args.workflows,
        "mode": "fanout" if args.fanout else "workflows",
        "texts_per_activity": args.texts,
        "rounds": args.rounds,
        "seconds": [round(w, 4) for w in walls],
        "seconds_median": round(median, 4),
        "activities_per_s": round(args.workflows / median, 2),
        "sentences_per_s": round(args.workflows * args.texts / median, 2),
        "latency_p50_s": round(lat[len(lat) // 2], 4),
        "latency_p95_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.95))], 4),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True, help="Temporal frontend host:port")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--task-queue", required=True, help="the queue the embed worker polls")
    ap.add_argument("--corpus", required=True, help="a text file, one text per line")
    ap.add_argument("--workflows", type=int, required=True, help="concurrent workflows (W)")
    ap.add_argument("--texts", type=int, required=True, help="texts per activity (K)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300, help="seconds one round may take")
    ap.add_argument("--label", default="", help="a name for the report, e.g. the worker")
    ap.add_argument("--fanout", action="store_true",
                    help="one workflow runs the W activities at once, instead of W workflows "
                         "of one activity: less work for the server per activity")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args()
    report = asyncio.run(drive(args))
    text = json.dumps(report)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
    # Skip interpreter teardown: the Temporal client's Rust threads can outlive the event
    # loop and abort the process while Python finalizes (temporalio/sdk-python#300), which
    # run.sh would read as a failed load after the report was already written.
    sys.stdout.flush()
    os._exit(0)
