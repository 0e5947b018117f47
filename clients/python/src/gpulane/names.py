"""Task queue, activity and failure type names, with the same rules as the worker's
`proto/src/names.rs` (the tests check them against `gpulane schema`'s examples)."""

from __future__ import annotations

import re

GPU_TOOLS = "gpu-tools"
"""The shared GPU lane: every GPU worker on every host polls it."""
CPU_TOOLS = "cpu-tools"
"""The shared CPU lane, the fallback when no card has room."""
QUEUE_PREFIX_SEPARATOR = "."
MODEL_QUEUE_SEPARATOR = "@"
MODEL_NAME_MAX = 64

_NOT_HOST_CHAR = re.compile(r"[^a-z0-9-]")
# What Rust's str::trim() strips: Unicode White_Space. Python's str.strip() also strips
# U+001C..U+001F, which Rust keeps (and then turns into '-').
_RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def _ascii_lower(text: str) -> str:
    """Rust's to_ascii_lowercase: only A-Z change (Python's lower() would also fold,
    say, the Kelvin sign into 'k')."""
    return "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in text)
_MODEL_NAME = re.compile(r"[A-Za-z0-9._-]+")


class Activity:
    """Activity type names, as registered with Temporal."""

    EMBED = "embed"
    RERANK = "rerank"
    EMBED_DATASET = "embed_dataset"


class Failure:
    """Application failure types (`ApplicationError.type`) the worker raises."""

    INVALID_INPUT = "InvalidInput"
    UNKNOWN_MODEL = "UnknownModel"
    TEXT_TOO_LONG = "TextTooLong"
    RESULT_TOO_LARGE = "ResultTooLarge"
    NON_FINITE_OUTPUT = "NonFiniteOutput"
    UNKNOWN_ACTIVITY = "UnknownActivity"
    GPU_OUT_OF_MEMORY = "GpuOutOfMemory"
    MODEL_FAILURE = "ModelFailure"
    MODEL_NOT_SERVED = "ModelNotServed"
    WORKER_SHUTDOWN = "WorkerShutdown"
    INTERNAL_ERROR = "InternalError"
    STORAGE_UNAVAILABLE = "StorageUnavailable"
    CARD_LOST = "CardLost"
    """Raised by this package, not the worker: a call pinned to a card did not start in
    time (the card or its worker is gone). `run_in_session` starts the sequence again."""

    RETRIED = frozenset(
        {GPU_OUT_OF_MEMORY, MODEL_FAILURE, MODEL_NOT_SERVED, WORKER_SHUTDOWN, INTERNAL_ERROR,
         STORAGE_UNAVAILABLE}
    )
    """The worker's failure types Temporal retries; the others are final."""
    ALL = frozenset(
        {INVALID_INPUT, UNKNOWN_MODEL, TEXT_TOO_LONG, RESULT_TOO_LARGE, NON_FINITE_OUTPUT,
         UNKNOWN_ACTIVITY}
    ) | RETRIED
    """Every failure type the worker raises."""


def sanitize_host(host: str) -> str:
    """A host name as it appears in queue names: ASCII lower case, every other character
    but [a-z0-9-] becomes '-' (one per character), so dots in FQDNs do not look like
    separators; 'unknown-host' when the name is blank."""
    return _NOT_HOST_CHAR.sub("-", _ascii_lower(host.strip(_RUST_WHITESPACE))) or "unknown-host"


def gpu_card_queue(host: str, gpu_uuid: str) -> str:
    """One card's private queue: `gpu-tools.<host>.<gpu-uuid>` (UUID in lower case)."""
    return (f"{GPU_TOOLS}{QUEUE_PREFIX_SEPARATOR}{sanitize_host(host)}"
            f"{QUEUE_PREFIX_SEPARATOR}{_ascii_lower(gpu_uuid.strip(_RUST_WHITESPACE))}")


def cpu_host_queue(host: str) -> str:
    """One host's private CPU queue: `cpu-tools.<host>`."""
    return f"{CPU_TOOLS}{QUEUE_PREFIX_SEPARATOR}{sanitize_host(host)}"


def model_queue(shared: str, model: str) -> str:
    """The queue only workers serving `model` poll: `gpu-tools@<model>`."""
    return f"{shared}{MODEL_QUEUE_SEPARATOR}{model}"


def valid_model_name(name: str) -> bool:
    """1 to 64 characters of ASCII letters, digits, '-', '_' and '.'."""
    return 0 < len(name) <= MODEL_NAME_MAX and _MODEL_NAME.fullmatch(name) is not None
