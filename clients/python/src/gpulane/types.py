"""The activities' JSON payloads as dataclasses. Field names are the JSON names; a field
left at None is omitted from the payload, so the worker applies its default.
`gpulane schema` (the worker binary) prints the same contract as JSON Schema."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union


def _payload(obj: Any) -> Dict[str, Any]:
    """A request as the JSON object the worker reads: None fields left out, at any depth."""

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(dataclasses.asdict(obj))


@dataclass
class EmbedRequest:
    """Input of `embed`."""

    texts: List[str]
    model: Optional[str] = None
    normalize: Optional[bool] = None
    truncate: Optional[bool] = None
    dimensions: Optional[int] = None
    prompt: Optional[str] = None
    prompt_name: Optional[str] = None
    encoding: Optional[str] = None
    """'float' (default) or 'base64' (little-endian float32 per vector)."""

    def to_payload(self) -> Dict[str, Any]:
        return _payload(self)


@dataclass
class DeviceInfo:
    """The device that served a call."""

    kind: str
    """'gpu' or 'cpu'."""
    name: str
    simulated: bool
    uuid: Optional[str] = None
    index: Optional[int] = None

    @classmethod
    def from_payload(cls, d: Dict[str, Any]) -> "DeviceInfo":
        return cls(kind=d["kind"], name=d["name"], simulated=d["simulated"],
                   uuid=d.get("uuid"), index=d.get("index"))


@dataclass
class Usage:
    tokens: int

    @classmethod
    def from_payload(cls, d: Dict[str, Any]) -> "Usage":
        return cls(tokens=d["tokens"])


@dataclass
class EmbedResponse:
    """Result of `embed`."""

    embeddings: Union[List[List[float]], List[str]]
    """One vector per text, in order: numbers, or base64 strings with encoding='base64'."""
    model: str
    revision: str
    dtype: str
    family: str
    dimensions: int
    device: DeviceInfo
    host_task_queue: str
    """The serving card's (or host CPU's) private queue: pin follow-ups here."""
    usage: Usage

    @classmethod
    def from_payload(cls, d: Dict[str, Any]) -> "EmbedResponse":
        return cls(embeddings=d["embeddings"], model=d["model"], revision=d["revision"],
                   dtype=d["dtype"], family=d["family"], dimensions=d["dimensions"],
                   device=DeviceInfo.from_payload(d["device"]),
                   host_task_queue=d["host_task_queue"], usage=Usage.from_payload(d["usage"]))


@dataclass
class RerankRequest:
    """Input of `rerank`."""

    query: str
    documents: List[str]
    model: Optional[str] = None
    top_n: Optional[int] = None
    return_documents: Optional[bool] = None
    raw_scores: Optional[bool] = None

    def to_payload(self) -> Dict[str, Any]:
        return _payload(self)


@dataclass
class RerankResult:
    index: int
    """The document's position in the request."""
    score: float
    document: Optional[str] = None

    @classmethod
    def from_payload(cls, d: Dict[str, Any]) -> "RerankResult":
        return cls(index=d["index"], score=d["score"], document=d.get("document"))


@dataclass
class RerankResponse:
    """Result of `rerank`: results sorted by score, highest first."""

    results: List[RerankResult]
    model: str
    revision: str
    dtype: str
    family: str
    device: DeviceInfo
    host_task_queue: str
    usage: Usage

    @classmethod
    def from_payload(cls, d: Dict[str, Any]) -> "RerankResponse":
        return cls(results=[RerankResult.from_payload(r) for r in d["results"]],
                   model=d["model"], revision=d["revision"], dtype=d["dtype"],
                   family=d["family"], device=DeviceInfo.from_payload(d["device"]),
                   host_task_queue=d["host_task_queue"], usage=Usage.from_payload(d["usage"]))


@dataclass
class Shard:
    index: int
    count: int


@dataclass
class RowRange:
    start: int
    end: int


@dataclass
class EmbedDatasetRequest:
    """Input of `embed_dataset`: a dataset in storage to Parquet parts under `output`."""

    source: str
    id_column: str
    text_column: str
    output: str
    format: Optional[str] = None
    shard: Optional[Shard] = None
    rows: Optional[RowRange] = None
    part_rows: Optional[int] = None
    model: Optional[str] = None
    normalize: Optional[bool] = None
    truncate: Optional[bool] = None
    dimensions: Optional[int] = None
    prompt: Optional[str] = None
    prompt_name: Optional[str] = None

    def to_payload(self) -> Dict[str, Any]:
        return _payload(self)


@dataclass
class PartRef:
    uri: str
    rows: int


@dataclass
class Manifest:
    """Result of `embed_dataset` (also written as the job's manifest file)."""

    output: str
    manifest: str
    source: str
    start: int
    end: int
    rows: int
    dimensions: int
    model: str
    revision: str
    dtype: str
    family: str
    tokens: int
    parts: List[PartRef]
    skipped_parts: int

    @classmethod
    def from_payload(cls, d: Dict[str, Any]) -> "Manifest":
        fields = {f.name for f in dataclasses.fields(cls)} - {"parts"}
        return cls(parts=[PartRef(uri=p["uri"], rows=p["rows"]) for p in d["parts"]],
                   **{k: d[k] for k in fields})
