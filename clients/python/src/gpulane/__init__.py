"""gpulane's workflow-side client: the activity contract (queue names, typed payloads,
failure types) and helpers for the patterns every gpulane user needs: pin follow-ups to
the card that served the first call, fall back to the CPU lane, and start the whole
sequence again when a pinned card vanishes.

Workflow helpers live in `gpulane.workflow`; the sharded dataset job in `gpulane.dataset`.
"""

from .errors import (BY_TYPE, CardLost, GpulaneError, GpuOutOfMemory, InternalError,
                     InvalidInput, ModelFailure, ModelNotServed, NonFiniteOutput, ResultTooLarge,
                     StorageUnavailable, TextTooLong, UnknownActivity, UnknownModel,
                     WorkerShutdown, typed_error)
from .names import (CPU_TOOLS, GPU_TOOLS, MODEL_NAME_MAX, MODEL_QUEUE_SEPARATOR,
                    QUEUE_PREFIX_SEPARATOR, Activity, Failure, cpu_host_queue,
                    gpu_card_queue, model_queue, sanitize_host, valid_model_name)
from .types import (DeviceInfo, EmbedDatasetRequest, EmbedRequest, EmbedResponse, Manifest,
                    PartRef, RerankRequest, RerankResponse, RerankResult, RowRange, Shard,
                    Usage)

__version__ = "0.1.0"
"""The gpulane binary version this package matches."""
