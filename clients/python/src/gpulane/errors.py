"""Typed failures. Each is a Temporal `ApplicationError` (raised in a workflow it fails
the workflow, not its task) with the worker's failure type, message and retry flag, so a
workflow can `except gpulane.InvalidInput` instead of comparing strings."""

from __future__ import annotations

from typing import Dict, Optional, Type

from temporalio.exceptions import ActivityError, ApplicationError

from .names import Failure


class GpulaneError(ApplicationError):
    """A failure gpulane reported; `type` is one of `Failure`'s names."""

    TYPE: str = ""

    def __init__(self, message: str, *details, non_retryable: Optional[bool] = None,
                 type: Optional[str] = None):
        super().__init__(
            message, *details, type=type or self.TYPE,
            non_retryable=(self.TYPE not in Failure.RETRIED and self.TYPE != Failure.CARD_LOST)
            if non_retryable is None else non_retryable,
        )


def _failure(name: str, type_name: str, doc: str) -> Type[GpulaneError]:
    return type(name, (GpulaneError,), {"TYPE": type_name, "__doc__": doc})


InvalidInput = _failure("InvalidInput", Failure.INVALID_INPUT,
                        "Malformed input or over a limit; the message names the field, the limit and the fix.")
UnknownModel = _failure("UnknownModel", Failure.UNKNOWN_MODEL,
                        "The model is not served on that queue; the message lists the served ones.")
TextTooLong = _failure("TextTooLong", Failure.TEXT_TOO_LONG,
                       "A text is over the model's limit and truncate is false.")
ResultTooLarge = _failure("ResultTooLarge", Failure.RESULT_TOO_LARGE,
                          "The result would exceed the payload limit; ask for base64 or fewer dimensions, or use embed_dataset.")
NonFiniteOutput = _failure("NonFiniteOutput", Failure.NON_FINITE_OUTPUT,
                           "The model's output for an input holds NaN or infinity (half precision "
                           "overflowed, or the weights hold such values); the message names the "
                           "input and the fix.")
UnknownActivity = _failure("UnknownActivity", Failure.UNKNOWN_ACTIVITY,
                           "An activity type gpulane does not serve.")
GpuOutOfMemory = _failure("GpuOutOfMemory", Failure.GPU_OUT_OF_MEMORY,
                          "The card ran out of memory (retried by the retry policy).")
ModelFailure = _failure("ModelFailure", Failure.MODEL_FAILURE,
                        "The model failed on the device (retried by the retry policy).")
ModelNotServed = _failure("ModelNotServed", Failure.MODEL_NOT_SERVED,
                          "No worker reached serves the model on a shared queue (retried).")
WorkerShutdown = _failure("WorkerShutdown", Failure.WORKER_SHUTDOWN,
                          "The worker stopped before the activity finished (retried).")
InternalError = _failure("InternalError", Failure.INTERNAL_ERROR,
                         "A bug in gpulane ended the activity (retried).")
StorageUnavailable = _failure("StorageUnavailable", Failure.STORAGE_UNAVAILABLE,
                              "Storage was unreachable or failed (retried; embed_dataset resumes).")
CardLost = _failure("CardLost", Failure.CARD_LOST,
                    "A call pinned to a card did not start within its schedule-to-start "
                    "timeout: the card or its worker is gone. Retryable: start the "
                    "sequence again on the shared queue (run_in_session does).")

BY_TYPE: Dict[str, Type[GpulaneError]] = {
    cls.TYPE: cls
    for cls in (InvalidInput, UnknownModel, TextTooLong, ResultTooLarge, NonFiniteOutput,
                UnknownActivity,
                GpuOutOfMemory, ModelFailure, ModelNotServed, WorkerShutdown, InternalError,
                StorageUnavailable, CardLost)
}


def typed_error(error: BaseException) -> Optional[GpulaneError]:
    """The typed failure behind an `ActivityError` from a gpulane activity (its cause is
    the worker's `ApplicationError`), or None for anything else (timeouts, cancellation)."""
    cause = error.cause if isinstance(error, ActivityError) else error
    if isinstance(cause, GpulaneError):
        return cause
    if isinstance(cause, ApplicationError) and cause.type in BY_TYPE:
        return BY_TYPE[cause.type](cause.message, *cause.details,
                                   non_retryable=cause.non_retryable)
    return None
