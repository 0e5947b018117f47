"""Embeds texts through Temporal with gpulane: pins to a GPU card when one polls
`gpu-tools`, falls back to `cpu-tools` when none does. Copy this into your own code.

    TEMPORAL_ADDRESS=localhost:7233 python examples/embed_once.py "some text" "more text"
"""

import asyncio
import json
import os
import sys
import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.client import Client
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType
from temporalio.worker import Worker


@workflow.defn
class EmbedWithPinning:
    @workflow.run
    async def run(self, texts: list) -> dict:
        try:
            # No GPU poller within 10 s? Then gpu-tools has no card for us right now.
            first = await workflow.execute_activity(
                "embed", {"texts": texts}, task_queue="gpu-tools",
                schedule_to_start_timeout=timedelta(seconds=10),
                start_to_close_timeout=timedelta(minutes=2),
            )
        except ActivityError as e:
            if not (isinstance(e.cause, TimeoutError) and e.cause.type == TimeoutType.SCHEDULE_TO_START):
                raise
            first = await workflow.execute_activity(
                "embed", {"texts": texts}, task_queue="cpu-tools",
                start_to_close_timeout=timedelta(minutes=2),
            )
        # Every later call for this job goes to the same card (or host CPU).
        second = await workflow.execute_activity(
            "embed", {"texts": texts, "normalize": False}, task_queue=first["host_task_queue"],
            schedule_to_start_timeout=timedelta(seconds=30),
            start_to_close_timeout=timedelta(minutes=2),
        )
        return {"first": first, "pinned_second_call_device": second["device"]}


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
