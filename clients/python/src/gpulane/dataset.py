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


# Timeouts past this (10 years) overflow `timedelta` long before Temporal would refuse them.
_MAX_SECONDS = 10 * 365 * 24 * 3600


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    """A job field's value as a failure message shows it: numbers whole, else the type."""
    return repr(v) if _is_number(v) else type(v).__name__


@workflow.defn(name="gpulane.EmbedDatasetJob")
class EmbedDatasetJob:
    """Input: {"request": <EmbedDatasetRequest without shard/rows>, "shards": N, and
    optionally "task_queue", "heartbeat_timeout_s", "start_to_close_s" (default: those of
    `gpulane.workflow.embed_dataset`)}. Result: the N manifests (dicts), in shard order. A
    bad job (no request object, no shards, shard or rows in the request, a timeout that is
    not a number of seconds) fails the workflow with `InvalidInput`."""

    @workflow.run
    async def run(self, job: Any) -> List[Dict[str, Any]]:
        # `Any`, not a dict: with a dict hint the SDK's converter fails the workflow task on
        # a job that is not an object, before the checks below can fail the workflow.
        # A bad job fails the workflow with InvalidInput: an exception of another type
        # would fail the workflow task, which Temporal retries forever. Messages show a
        # value's type, or the number itself, never a caller's string whole.
        if not isinstance(job, dict):
            raise InvalidInput(f"the job is {type(job).__name__}; give an object with "
                               "\"request\" and \"shards\"")
        request = job.get("request")
        if not isinstance(request, dict):
            raise InvalidInput(f"request is {type(request).__name__}; give the embed_dataset "
                               "request as an object")
        request = dict(request)
        shards = job.get("shards")
        if not _is_number(shards) or not isinstance(shards, int) or shards < 1:
            raise InvalidInput(f"shards is {_shown(shards)}; give a whole number of at least 1")
        for key in ("heartbeat_timeout_s", "start_to_close_s"):
            value = job.get(key)
            if key in job and not (_is_number(value) and 0 < value <= _MAX_SECONDS):
                raise InvalidInput(f"{key} is {_shown(value)}; give a number of seconds above 0 "
                                   f"and at most {_MAX_SECONDS:,} (10 years)")
        if "task_queue" in job and not (isinstance(job["task_queue"], str) and job["task_queue"]):
            raise InvalidInput(f"task_queue is {_shown(job['task_queue'])}; give a task queue "
                               "name, or leave it out for gpu-tools")
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
