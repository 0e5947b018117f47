"""Workflows that call gpulane's activities by name, as a user's Python code would."""

import asyncio
from datetime import timedelta
from typing import Any, Optional

from temporalio import workflow
from temporalio.common import Priority, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, RetryState


@workflow.defn
class EmbedOn:
    """One `embed` on a given queue."""

    @workflow.run
    async def run(self, queue: str, payload: dict) -> dict:
        return await workflow.execute_activity(
            "embed", payload, task_queue=queue, start_to_close_timeout=timedelta(seconds=120)
        )


@workflow.defn
class PinnedPair:
    """The worker-specific task queue pattern: the first call on the shared GPU lane tells
    which card served it; the second call goes to that card's own queue."""

    @workflow.run
    async def run(self, texts: list) -> dict:
        first = await workflow.execute_activity(
            "embed", {"texts": texts}, task_queue="gpu-tools",
            start_to_close_timeout=timedelta(seconds=120),
        )
        second = await workflow.execute_activity(
            "embed", {"texts": texts}, task_queue=first["host_task_queue"],
            schedule_to_start_timeout=timedelta(seconds=30),
            start_to_close_timeout=timedelta(seconds=120),
        )
        return {"first": first, "second": second}


@workflow.defn
class BadThenGood:
    """A bad input must fail at once, non-retryably, with a typed failure; the same
    worker must then serve a good call. The retry policy retries forever, so a failure
    marked retryable would hang this workflow instead of returning."""

    @workflow.run
    async def run(self, queue: str, bad: Any, good: dict) -> dict:
        error = None
        try:
            await workflow.execute_activity(
                "embed", bad, task_queue=queue, start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_attempts=0),
            )
        except ActivityError as e:
            cause = e.cause
            assert isinstance(cause, ApplicationError), repr(cause)
            error = {
                "type": cause.type,
                "message": cause.message,
                "non_retryable": cause.non_retryable,
                "retry_state": RetryState(e.retry_state).name if e.retry_state is not None else None,
            }
        result = await workflow.execute_activity(
            "embed", good, task_queue=queue, start_to_close_timeout=timedelta(seconds=60)
        )
        return {"error": error, "good": result}


@workflow.defn
class Try:
    """Runs any activity once (retrying only what is retryable) and reports its result or
    its typed failure instead of failing the workflow."""

    @workflow.run
    async def run(self, activity: str, queue: str, payload: Any) -> dict:
        try:
            out = await workflow.execute_activity(
                activity, payload, task_queue=queue, start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_attempts=0),
            )
            return {"ok": out}
        except ActivityError as e:
            cause = e.cause
            assert isinstance(cause, ApplicationError), repr(cause)
            return {"error": {"type": cause.type, "message": cause.message,
                              "non_retryable": cause.non_retryable}}


@workflow.defn
class CancelAfter:
    """Starts a long `embed` with a heartbeat timeout, cancels it after `seconds`, and
    reports how it ended. Heartbeats are how the cancellation reaches the worker."""

    @workflow.run
    async def run(self, queue: str, payload: dict, seconds: float) -> str:
        handle = workflow.start_activity(
            "embed", payload, task_queue=queue, start_to_close_timeout=timedelta(seconds=600),
            heartbeat_timeout=timedelta(seconds=2),
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        await workflow.sleep(seconds)
        handle.cancel()
        try:
            await handle
            return "completed"
        except ActivityError as e:
            return type(e.cause).__name__


@workflow.defn
class TryOnce:
    """Runs any activity exactly once, with optional timeouts, and reports its result or
    how it failed (retryable or not), instead of failing the workflow."""

    @workflow.run
    async def run(self, activity: str, queue: str, payload: Any, options: dict) -> dict:
        heartbeat = options.get("heartbeat_timeout_us")
        start = options.get("schedule_to_start_s")
        try:
            out = await workflow.execute_activity(
                activity, payload, task_queue=queue,
                start_to_close_timeout=timedelta(seconds=options.get("start_to_close_s", 60)),
                heartbeat_timeout=timedelta(microseconds=heartbeat) if heartbeat else None,
                schedule_to_start_timeout=timedelta(seconds=start) if start else None,
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
            return {"ok": out}
        except ActivityError as e:
            cause = e.cause
            return {"error": {
                "kind": type(cause).__name__,
                "type": getattr(cause, "type", None),
                "message": getattr(cause, "message", str(cause)),
                "non_retryable": getattr(cause, "non_retryable", None),
            }}


def _priority(key: Optional[int]) -> Priority:
    return Priority(priority_key=key) if key else Priority.default


def _dataset_activity_options(options: Optional[dict]) -> dict:
    """How the dataset workflows run `embed_dataset`: a heartbeat timeout (how soon a dead
    worker's attempt is noticed and retried elsewhere, resuming from the last heartbeat), a
    generous start-to-close, and retries (forever unless `maximum_attempts` says otherwise;
    a non-retryable failure still ends it at once)."""
    options = options or {}
    return dict(
        start_to_close_timeout=timedelta(seconds=options.get("start_to_close_s", 1800)),
        heartbeat_timeout=timedelta(seconds=options.get("heartbeat_s", 10)),
        retry_policy=RetryPolicy(
            initial_interval=timedelta(seconds=1),
            maximum_interval=timedelta(seconds=options.get("max_retry_interval_s", 5)),
            maximum_attempts=options.get("maximum_attempts", 0),
        ),
    )


@workflow.defn
class EmbedDatasetShards:
    """A dataset fanned out: `shards` `embed_dataset` activities at once on `queue`, shard
    i of n each, all writing under one output prefix (part files are named by the rows
    they hold, so shards never collide). Returns the manifests in shard order."""

    @workflow.run
    async def run(self, request: dict, shards: int, queue: str, options: Optional[dict] = None) -> list:
        return list(await asyncio.gather(*(
            workflow.execute_activity(
                "embed_dataset", {**request, "shard": {"index": i, "count": shards}},
                task_queue=queue, **_dataset_activity_options(options),
            )
            for i in range(shards)
        )))


@workflow.defn
class EmbedDatasetOn:
    """One `embed_dataset` on a given queue (a card's private queue pins it there), with an
    optional priority key (lower is more urgent; none is the default)."""

    @workflow.run
    async def run(self, request: dict, queue: str, priority_key: Optional[int] = None,
                  options: Optional[dict] = None) -> dict:
        return await workflow.execute_activity(
            "embed_dataset", request, task_queue=queue, priority=_priority(priority_key),
            **_dataset_activity_options(options),
        )


@workflow.defn
class PinnedDataset:
    """The pin pattern for a bulk job: a first small `embed` on the shared GPU queue says
    which card served it; the dataset then goes to that card's own queue."""

    @workflow.run
    async def run(self, request: dict, options: Optional[dict] = None) -> dict:
        first = await workflow.execute_activity(
            "embed", {"texts": ["which card?"]}, task_queue="gpu-tools",
            start_to_close_timeout=timedelta(seconds=120),
        )
        manifest = await workflow.execute_activity(
            "embed_dataset", request, task_queue=first["host_task_queue"],
            schedule_to_start_timeout=timedelta(seconds=60), **_dataset_activity_options(options),
        )
        return {"first": first, "manifest": manifest}


@workflow.defn
class SmallCallsDuringJob:
    """Interactive calls beside a bulk job on the same queue. Starts `job` (an
    `embed_dataset` request, or None for no job; with `job_shards` n, n shard activities of
    it at once), waits `delay_s`, then runs each phase in
    turn: `calls` one-text `embed`s with the phase's `priority_key` (None: the default),
    one after another, or, with `interval_s`, started that far apart and overlapping (the
    dev server fires sub-second timers late, so such starts bunch up). Times are seconds
    since the workflow started, as the workflow sees them (workflow.now() of the task that
    saw each event), so a latency includes the workflow task round trip, as a user's would.

    Returns {"job": {"manifests", "done_at"} | None,
             "phases": [{"priority_key", "calls": [{"start", "end", "latency_s"}]}]}."""

    @workflow.run
    async def run(self, queue: str, job: Optional[dict], phases: list,
                  options: Optional[dict] = None) -> dict:
        options = options or {}
        t0 = workflow.now()

        def now() -> float:
            return (workflow.now() - t0).total_seconds()

        async def run_job():
            shards = options.get("job_shards", 1)
            requests = [job] if shards == 1 else [
                {**job, "shard": {"index": i, "count": shards}} for i in range(shards)
            ]
            manifests = await asyncio.gather(*(
                workflow.execute_activity(
                    "embed_dataset", r, task_queue=queue,
                    priority=_priority(options.get("job_priority_key")),
                    **_dataset_activity_options(options),
                )
                for r in requests
            ))
            return {"manifests": list(manifests), "done_at": now()}

        job_task = None
        if job is not None:
            job_task = asyncio.create_task(run_job())
            await workflow.sleep(options.get("delay_s", 3))

        async def small(phase_no: int, i: int, phase: dict):
            if i and phase.get("interval_s"):
                await workflow.sleep(i * phase["interval_s"])
            start = now()
            out = await workflow.execute_activity(
                "embed", {"texts": [f"interactive query {phase_no}.{i}: how do task queues route work?"]},
                task_queue=queue, start_to_close_timeout=timedelta(seconds=120),
                priority=_priority(phase.get("priority_key")),
            )
            end = now()
            assert len(out["embeddings"]) == 1
            return {"start": start, "end": end, "latency_s": end - start}

        result = {"job": None, "phases": []}
        for n, phase in enumerate(phases):
            if phase.get("interval_s"):
                calls = await asyncio.gather(*(small(n, i, phase) for i in range(phase["calls"])))
            else:
                calls = [await small(n, i, phase) for i in range(phase["calls"])]
            result["phases"].append({"priority_key": phase.get("priority_key"), "calls": list(calls)})
        if job_task is not None:
            result["job"] = await job_task
        return result


ALL = [EmbedOn, PinnedPair, BadThenGood, Try, CancelAfter, TryOnce,
       EmbedDatasetShards, EmbedDatasetOn, PinnedDataset, SmallCallsDuringJob]
