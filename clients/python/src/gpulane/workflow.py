"""Helpers for workflow code (deterministic: safe in the workflow sandbox).

- `embed` / `rerank`: one call on the shared GPU lane, falling back to the CPU lane when no
  card starts it within its schedule-to-start budget.
- `CardSession`: the first call goes to the shared lane; follow-ups are pinned to the
  card (or CPU host) that served it, through its private queue.
- `run_in_session`: runs a sequence of calls in a session and, when a pinned call cannot
  start (the card or its worker is gone: `CardLost`), runs the whole sequence again in a
  new session on whatever card is up.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Awaitable, Callable, Dict, Optional, TypeVar, Union

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutType
from temporalio.exceptions import TimeoutError as TemporalTimeoutError

from .errors import CardLost, typed_error
from .names import CPU_TOOLS, GPU_TOOLS, Activity
from .types import (EmbedDatasetRequest, EmbedRequest, EmbedResponse, Manifest,
                    RerankRequest, RerankResponse)

T = TypeVar("T")

DEFAULT_SCHEDULE_TO_START = timedelta(seconds=30)
"""How long a call may wait on the shared GPU lane before it falls back to the CPU lane."""
DEFAULT_PINNED_SCHEDULE_TO_START = timedelta(seconds=30)
"""How long a pinned call may wait for its card: a private queue has exactly one poller,
so without this a call to a vanished card would wait for ever."""
DEFAULT_START_TO_CLOSE = timedelta(minutes=5)
DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=60)
"""Long calls heartbeat their progress; a worker killed mid-call is noticed this soon."""


def _is_schedule_to_start_timeout(error: ActivityError) -> bool:
    return (isinstance(error.cause, TemporalTimeoutError)
            and error.cause.type == TimeoutType.SCHEDULE_TO_START)


async def _execute(activity: str, payload: Dict[str, Any], task_queue: str, *,
                   schedule_to_start: Optional[timedelta], start_to_close: timedelta,
                   heartbeat_timeout: Optional[timedelta],
                   retry_policy: Optional[RetryPolicy]) -> Dict[str, Any]:
    return await workflow.execute_activity(
        activity, payload, task_queue=task_queue,
        schedule_to_start_timeout=schedule_to_start, start_to_close_timeout=start_to_close,
        heartbeat_timeout=heartbeat_timeout, retry_policy=retry_policy, result_type=dict)


def _raise_typed(error: ActivityError):
    typed = typed_error(error)
    if typed is None:
        raise error
    raise typed from error


async def _shared_call(activity: str, payload: Dict[str, Any], *, task_queue: str,
                       fallback: Optional[str], schedule_to_start: timedelta,
                       start_to_close: timedelta, heartbeat_timeout: Optional[timedelta],
                       retry_policy: Optional[RetryPolicy]) -> Dict[str, Any]:
    common = dict(start_to_close=start_to_close, heartbeat_timeout=heartbeat_timeout,
                  retry_policy=retry_policy)
    try:
        return await _execute(activity, payload, task_queue,
                              schedule_to_start=schedule_to_start if fallback else None,
                              **common)
    except ActivityError as e:
        if not (fallback and _is_schedule_to_start_timeout(e)):
            _raise_typed(e)
        workflow.logger.info("no card started %s within %s; falling back to %s",
                             activity, schedule_to_start, fallback)
    try:
        return await _execute(activity, payload, fallback, schedule_to_start=None, **common)
    except ActivityError as e:
        _raise_typed(e)


def payload_of(request: Any) -> Dict[str, Any]:
    """A request dataclass (or an already-built dict) as the JSON object the worker reads."""
    return request if isinstance(request, dict) else request.to_payload()


async def embed(request: Union[EmbedRequest, Dict[str, Any]], *, task_queue: str = GPU_TOOLS,
                fallback: Optional[str] = CPU_TOOLS,
                schedule_to_start: timedelta = DEFAULT_SCHEDULE_TO_START,
                start_to_close: timedelta = DEFAULT_START_TO_CLOSE,
                heartbeat_timeout: Optional[timedelta] = DEFAULT_HEARTBEAT_TIMEOUT,
                retry_policy: Optional[RetryPolicy] = None) -> EmbedResponse:
    """One `embed` on `task_queue`; on `fallback` when no worker starts it within
    `schedule_to_start`. With `fallback=None` the call waits on `task_queue` with no
    schedule-to-start limit (`schedule_to_start` is then not used). The fallback is the
    shared `cpu-tools`: for a model queue (`gpu-tools@<model>`) pass
    `fallback=model_queue(CPU_TOOLS, model)`."""
    result = await _shared_call(
        Activity.EMBED, payload_of(request), task_queue=task_queue, fallback=fallback,
        schedule_to_start=schedule_to_start, start_to_close=start_to_close,
        heartbeat_timeout=heartbeat_timeout, retry_policy=retry_policy)
    return EmbedResponse.from_payload(result)


async def rerank(request: Union[RerankRequest, Dict[str, Any]], *, task_queue: str = GPU_TOOLS,
                 fallback: Optional[str] = CPU_TOOLS,
                 schedule_to_start: timedelta = DEFAULT_SCHEDULE_TO_START,
                 start_to_close: timedelta = DEFAULT_START_TO_CLOSE,
                 heartbeat_timeout: Optional[timedelta] = DEFAULT_HEARTBEAT_TIMEOUT,
                 retry_policy: Optional[RetryPolicy] = None) -> RerankResponse:
    """One `rerank`, like `embed`."""
    result = await _shared_call(
        Activity.RERANK, payload_of(request), task_queue=task_queue, fallback=fallback,
        schedule_to_start=schedule_to_start, start_to_close=start_to_close,
        heartbeat_timeout=heartbeat_timeout, retry_policy=retry_policy)
    return RerankResponse.from_payload(result)


async def embed_dataset(request: Union[EmbedDatasetRequest, Dict[str, Any]], *,
                        task_queue: str = GPU_TOOLS,
                        start_to_close: timedelta = timedelta(hours=6),
                        heartbeat_timeout: timedelta = timedelta(minutes=2),
                        retry_policy: Optional[RetryPolicy] = None) -> Manifest:
    """One `embed_dataset` (a whole dataset or one shard); a retried attempt resumes from
    its last written part. No CPU fallback: a bulk job waits for a card."""
    try:
        result = await _execute(Activity.EMBED_DATASET, payload_of(request), task_queue,
                                schedule_to_start=None, start_to_close=start_to_close,
                                heartbeat_timeout=heartbeat_timeout, retry_policy=retry_policy)
    except ActivityError as e:
        _raise_typed(e)
    return Manifest.from_payload(result)


class CardSession:
    """Keeps a sequence of calls on one card. The first call runs on the shared lane (with
    the CPU fallback); every later call goes to the private queue of whatever served it.
    A pinned call that does not start within `pinned_schedule_to_start` raises `CardLost`.
    """

    def __init__(self, *, task_queue: str = GPU_TOOLS, fallback: Optional[str] = CPU_TOOLS,
                 schedule_to_start: timedelta = DEFAULT_SCHEDULE_TO_START,
                 pinned_schedule_to_start: timedelta = DEFAULT_PINNED_SCHEDULE_TO_START,
                 start_to_close: timedelta = DEFAULT_START_TO_CLOSE,
                 heartbeat_timeout: Optional[timedelta] = DEFAULT_HEARTBEAT_TIMEOUT,
                 retry_policy: Optional[RetryPolicy] = None):
        self.task_queue = task_queue
        self.fallback = fallback
        self.schedule_to_start = schedule_to_start
        self.pinned_schedule_to_start = pinned_schedule_to_start
        self.start_to_close = start_to_close
        self.heartbeat_timeout = heartbeat_timeout
        self.retry_policy = retry_policy
        self.pinned_queue: Optional[str] = None
        """The private queue follow-ups go to; None until the first call returns."""
        # Calls made at once before the first returns must not each pick a card: the
        # first goes to the shared lane, the others wait for it and follow it.
        self._first = asyncio.Lock()

    async def _call(self, activity: str, payload: Dict[str, Any]) -> Dict[str, Any]:
        common = dict(start_to_close=self.start_to_close,
                      heartbeat_timeout=self.heartbeat_timeout, retry_policy=self.retry_policy)
        if self.pinned_queue is None:
            async with self._first:
                if self.pinned_queue is None:
                    result = await _shared_call(activity, payload, task_queue=self.task_queue,
                                                fallback=self.fallback,
                                                schedule_to_start=self.schedule_to_start,
                                                **common)
                    self.pinned_queue = result["host_task_queue"]
                    return result
        try:
            return await _execute(activity, payload, self.pinned_queue,
                                  schedule_to_start=self.pinned_schedule_to_start, **common)
        except ActivityError as e:
            if _is_schedule_to_start_timeout(e):
                raise CardLost(
                    f"{activity} pinned to {self.pinned_queue} did not start within "
                    f"{self.pinned_schedule_to_start}: the card or its worker is gone; start "
                    f"the sequence again on {self.task_queue} (run_in_session does)"
                ) from e
            _raise_typed(e)

    async def embed(self, request: Union[EmbedRequest, Dict[str, Any]]) -> EmbedResponse:
        return EmbedResponse.from_payload(await self._call(Activity.EMBED, payload_of(request)))

    async def rerank(self, request: Union[RerankRequest, Dict[str, Any]]) -> RerankResponse:
        return RerankResponse.from_payload(await self._call(Activity.RERANK, payload_of(request)))


async def run_in_session(body: Callable[[CardSession], Awaitable[T]], *, attempts: int = 3,
                         **session_options: Any) -> T:
    """Runs `body(session)`; when a pinned call raises `CardLost`, runs the whole body
    again in a fresh session (so on whatever card is up), at most `attempts` times in all.
    `session_options` go to `CardSession`. The last `CardLost` propagates.

    `attempts < 1` raises ValueError, which (not being a Temporal failure) fails the
    workflow *task*, retried until the code is fixed."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    attempt = 1
    while True:
        session = CardSession(**session_options)
        try:
            return await body(session)
        except CardLost:
            if attempt == attempts:
                raise
            workflow.logger.warning("card lost (attempt %d of %d); starting the sequence again",
                                    attempt, attempts)
            attempt += 1
