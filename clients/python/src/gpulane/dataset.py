"""A large dataset over every card: a workflow that runs `embed_dataset` once per shard in
parallel and returns the shards' manifests, and client helpers to start it and gather
them. Register `EmbedDatasetJob` on one of your workflow workers."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta
from typing import Any, Dict, List, Union

from temporalio import workflow

from .names import GPU_TOOLS
from .types import EmbedDatasetRequest, Manifest

from . import workflow as _wf


@workflow.defn(name="gpulane.EmbedDatasetJob")
class EmbedDatasetJob:
    """Input: {"request": <EmbedDatasetRequest without shard/rows>, "shards": N,
    "task_queue": "gpu-tools", "heartbeat_timeout_s": 120, "start_to_close_s": 21600}.
    Result: the N manifests (dicts), in shard order."""

    @workflow.run
    async def run(self, job: Dict[str, Any]) -> List[Dict[str, Any]]:
        shards = int(job["shards"])
        request = dict(job["request"])

        async def one(index: int) -> Dict[str, Any]:
            manifest = await _wf.embed_dataset(
                {**request, "shard": {"index": index, "count": shards}},
                task_queue=job.get("task_queue", GPU_TOOLS),
                heartbeat_timeout=timedelta(seconds=job.get("heartbeat_timeout_s", 120)),
                start_to_close=timedelta(seconds=job.get("start_to_close_s", 6 * 3600)))
            return dataclasses.asdict(manifest)

        return list(await asyncio.gather(*(one(i) for i in range(shards))))


async def start_embed_dataset(client, request: Union[EmbedDatasetRequest, Dict[str, Any]], *,
                              shards: int, id: str, task_queue: str,
                              activity_task_queue: str = GPU_TOOLS, **start_options: Any):
    """Starts `EmbedDatasetJob` (on `task_queue`, where your workflow worker runs it) over
    `shards` slices of the dataset; returns its handle. `start_options` go to
    `Client.start_workflow`."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    payload = request if isinstance(request, dict) else request.to_payload()
    if "shard" in payload or "rows" in payload:
        raise ValueError("the job picks the shards; leave shard and rows out of the request")
    return await client.start_workflow(
        "gpulane.EmbedDatasetJob",
        {"request": payload, "shards": shards, "task_queue": activity_task_queue},
        id=id, task_queue=task_queue, **start_options)


async def gather_manifests(handle) -> List[Manifest]:
    """Waits for a job started by `start_embed_dataset` and returns its manifests."""
    return [Manifest.from_payload(m) for m in await handle.result()]
