"""Workflows the chaos experiments run: gpulane's activities called by name, with the
timeouts and retry policies a user would give them."""

from datetime import timedelta
from typing import Any, Optional

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, RetryState

with workflow.unsafe.imports_passed_through():
    from temporalio.api.common.v1 import Payload


def _retry(options: dict) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=timedelta(seconds=options.get("retry_initial_s", 1)),
        backoff_coefficient=options.get("retry_backoff", 2.0),
        maximum_interval=timedelta(seconds=options.get("retry_max_s", 5)),
        maximum_attempts=options.get("maximum_attempts", 0),
    )


@workflow.defn
class ChaosEmbed:
    """One `embed` on `queue` with the given timeouts and retry policy; returns its result.

    options: start_to_close_s (default 120), heartbeat_s (none by default),
    schedule_to_start_s (none), retry_initial_s, retry_backoff, retry_max_s, maximum_attempts
    (0 = forever)."""

    @workflow.run
    async def run(self, queue: str, payload: dict, options: Optional[dict] = None) -> dict:
        options = options or {}
        hb = options.get("heartbeat_s")
        sts = options.get("schedule_to_start_s")
        return await workflow.execute_activity(
            "embed", payload, task_queue=queue,
            start_to_close_timeout=timedelta(seconds=options.get("start_to_close_s", 120)),
            heartbeat_timeout=timedelta(seconds=hb) if hb else None,
            schedule_to_start_timeout=timedelta(seconds=sts) if sts else None,
            retry_policy=_retry(options),
        )


@workflow.defn
class ChaosCall:
    """Calls `activity` on `queue` with a case's arguments and reports how it ended,
    instead of failing the workflow.

    case: {"payload": <any JSON value>} or {"raw": "<JSON text sent byte for byte>"} (for
    what Python's JSON encoder cannot write, like duplicate keys); "extra_args": [values]
    appended as further activity arguments. A retryable failure is retried (up to
    `maximum_attempts`, 3 by default, 0.5 s apart), so a failure that should have been final
    shows up as attempt > 1 in the history instead of hanging the experiment."""

    @workflow.run
    async def run(self, activity: str, queue: str, case: dict) -> dict:
        if "raw" in case:
            first: Any = RawValue(Payload(metadata={"encoding": b"json/plain"}, data=case["raw"].encode()))
        else:
            first = case.get("payload")
        args = [first, *case.get("extra_args", [])]
        try:
            out = await workflow.execute_activity(
                activity, args=args, task_queue=queue,
                start_to_close_timeout=timedelta(seconds=case.get("start_to_close_s", 30)),
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(seconds=0.5), backoff_coefficient=1.0,
                    maximum_attempts=case.get("maximum_attempts", 3),
                ),
            )
            summary = {k: v for k, v in out.items() if k not in ("embeddings", "results")} if isinstance(out, dict) else out
            if isinstance(out, dict):
                summary["rows"] = len(out.get("embeddings", out.get("results", [])))
            return {"ok": summary}
        except ActivityError as e:
            cause = e.cause
            return {"error": {
                "class": type(cause).__name__,
                "type": getattr(cause, "type", None),
                "message": str(getattr(cause, "message", cause))[:300],
                "non_retryable": getattr(cause, "non_retryable", None),
                "retry_state": RetryState(e.retry_state).name if e.retry_state is not None else None,
            }}


ALL = [ChaosEmbed, ChaosCall]
