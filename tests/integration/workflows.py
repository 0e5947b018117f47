"""Workflows that call gpulane's activities by name, as a user's Python code would."""

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
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


ALL = [EmbedOn, PinnedPair, BadThenGood, Try, CancelAfter, TryOnce]
