"""A large dataset over every card: a workflow that runs `embed_dataset` once per shard in
parallel and returns the shards' manifests, and client helpers to start it and gather
them. Register `EmbedDatasetJob` on one of your workflow workers."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta
from typing import Any, Dict, List, Union

from temporalio import workflow

from .errors import InvalidInput
from .names import GPU_TOOLS
from .types import EmbedDatasetRequest, Manifest

from . import workflow as _wf


@workflow.defn(name="gpulane.EmbedDatasetJob")
class EmbedDatasetJob:
    """Input: {"request": <EmbedDatasetRequest without shard/rows>, "shards": N, and
    optionally "task_queue", "heartbeat_timeout_s", "start_to_close_s" (default: those of
    `gpulane.workflow.embed_dataset`)}. Result: the N manifests (dicts), in shard order. A
    bad job (no request object, no shards, shard or rows in the request, a timeout that is
    not a number of seconds) fails the workflow with `InvalidInput`."""

    @workflow.run
    async def run(self, job: Dict[str, Any]) -> List[Dict[str, Any]]:
        # A bad job fails the workflow with InvalidInput: an exception of another type
        # would fail the workflow task, which Temporal retries forever.
        request = job.get("request")
        if not isinstance(request, dict):
            raise InvalidInput(f"request is {type(request).__name__}; give the embed_dataset "
                               "request as an object")
        request = dict(request)
        shards = job.get("shards")
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise InvalidInput(f"shards is {shards!r}; give a whole number of at least 1")
        for key in ("heartbeat_timeout_s", "start_to_close_s"):
            value = job.get(key)
            if key in job and (not isinstance(value, (int, float)) or isinstance(value, bool)
                               or not 0 < value < float("inf")):
                raise InvalidInput(f"{key} is {value!r}; give a number of seconds above 0")
        if "shard" in request or "rows" in request:
            raise InvalidInput("the job picks the shards; leave shard and rows out of the request")
        options: Dict[str, Any] = {}
        if "task_queue" in job:
            options["task_queue"] = job["task_queue"]
        if "heartbeat_timeout_s" in job:
            options["heartbeat_timeout"] = timedelta(seconds=job["heartbeat_timeout_s"])
        if "start_to_close_s" in job:
            options["start_to_close"] = timedelta(seconds=job["start_to_close_s"])

        async def one(index: int) -> Dict[str, Any]:
            manifest = await _wf.embed_dataset(
                {**request, "shard": {"index": index, "count": shards}}, **options)
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
    payload = _wf.payload_of(request)
    if "shard" in payload or "rows" in payload:
        raise ValueError("the job picks the shards; leave shard and rows out of the request")
    return await client.start_workflow(
        "gpulane.EmbedDatasetJob",
        {"request": payload, "shards": shards, "task_queue": activity_task_queue},
        id=id, task_queue=task_queue, **start_options)


async def gather_manifests(handle) -> List[Manifest]:
    """Waits for a job started by `start_embed_dataset` and returns its manifests."""
    return [Manifest.from_payload(m) for m in await handle.result()]
