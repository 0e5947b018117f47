/**
 * gpulane's contract for workflow authors: queue names, activity names, failure types and
 * the JSON payload shapes, mirroring `proto/src/names.rs`, `embed.rs`, `rerank.rs` and
 * `dataset.rs`.
 *
 * This entry point imports nothing and calls no workflow API, so it is safe anywhere:
 * workflow code, activities, clients, scripts. The workflow helpers (`embed`, `rerank`,
 * `CardSession`, `runInSession`, typed errors) are in `gpulane/workflow`.
 */

/** This package's version; it follows the gpulane binary it speaks to (`gpulane --version`). */
export const VERSION = '0.1.0';

/** The shared GPU lane: every GPU worker on every host polls it. */
export const GPU_TOOLS = 'gpu-tools';
/** The shared CPU lane, the fallback when no GPU poller is there. */
export const CPU_TOOLS = 'cpu-tools';
/** Separates the parts of a private (host- or card-specific) queue name. */
export const QUEUE_PREFIX_SEPARATOR = '.';
/** Separates a shared lane from a model in a model queue: `gpu-tools@e5-small`. */
export const MODEL_QUEUE_SEPARATOR = '@';
/** The longest model name, in characters. */
export const MODEL_NAME_MAX = 64;

/** Activity type names, as registered with Temporal. */
export const Activity = {
  /** Text embedding: {@link EmbedRequest} in, {@link EmbedResponse} out. */
  EMBED: 'embed',
  /** Cross-encoder reranking: {@link RerankRequest} in, {@link RerankResponse} out. */
  RERANK: 'rerank',
  /** A whole dataset from storage to Parquet parts: {@link EmbedDatasetRequest} in, {@link Manifest} out. */
  EMBED_DATASET: 'embed_dataset',
} as const;
export type Activity = (typeof Activity)[keyof typeof Activity];

/**
 * Application failure type names (`ApplicationFailure.type`). All but `CardLost` come from
 * the worker; `CardLost` is this package's own (see `gpulane/workflow`'s `CardSession`).
 */
export const Failure = {
  /** The input is malformed or over a limit. Never retried. */
  INVALID_INPUT: 'InvalidInput',
  /** The requested model is not served by this worker (private queue). Never retried. */
  UNKNOWN_MODEL: 'UnknownModel',
  /** A text is longer than the model allows and `truncate` is false. Never retried. */
  TEXT_TOO_LONG: 'TextTooLong',
  /** The result would exceed Temporal's payload limit. Never retried. */
  RESULT_TOO_LARGE: 'ResultTooLarge',
  /** The model's output for an input holds NaN or infinity (half precision overflowed, or the weights hold such values). Never retried. */
  NON_FINITE_OUTPUT: 'NonFiniteOutput',
  /** An activity type this worker does not serve. Never retried. */
  UNKNOWN_ACTIVITY: 'UnknownActivity',
  /** The card ran out of memory during the task. Retried. */
  GPU_OUT_OF_MEMORY: 'GpuOutOfMemory',
  /** The model failed on the device. Retried. */
  MODEL_FAILURE: 'ModelFailure',
  /** A shared queue's task names a model this worker does not serve. Retried (handed back). */
  MODEL_NOT_SERVED: 'ModelNotServed',
  /** The worker stopped before the activity finished. Retried. */
  WORKER_SHUTDOWN: 'WorkerShutdown',
  /** A bug in gpulane (a panic) ended the activity. Retried. */
  INTERNAL_ERROR: 'InternalError',
  /** Storage was unreachable, throttled or failed a request. Retried. */
  STORAGE_UNAVAILABLE: 'StorageUnavailable',
  /**
   * Ours, not the worker's: a call pinned to a card's private queue was not started within
   * its schedule-to-start budget, so the card (or its worker) is gone or full. Retryable:
   * `runInSession` starts the whole sequence again on a new card.
   */
  CARD_LOST: 'CardLost',
} as const;
export type Failure = (typeof Failure)[keyof typeof Failure];

/** `Failure.CARD_LOST`. */
export const CARD_LOST = Failure.CARD_LOST;

/** The failure types the worker never retries (the same call fails the same way). */
export const NON_RETRYABLE_FAILURES: readonly Failure[] = Object.freeze([
  Failure.INVALID_INPUT,
  Failure.UNKNOWN_MODEL,
  Failure.TEXT_TOO_LONG,
  Failure.RESULT_TOO_LARGE,
  Failure.NON_FINITE_OUTPUT,
  Failure.UNKNOWN_ACTIVITY,
]);

/** The worker's failure types Temporal retries (by the call's retry policy); the others are final. */
export const RETRIED_FAILURES: readonly Failure[] = Object.freeze([
  Failure.GPU_OUT_OF_MEMORY,
  Failure.MODEL_FAILURE,
  Failure.MODEL_NOT_SERVED,
  Failure.WORKER_SHUTDOWN,
  Failure.INTERNAL_ERROR,
  Failure.STORAGE_UNAVAILABLE,
]);

/** Every failure type the worker raises (`CARD_LOST` aside). */
export const WORKER_FAILURES: readonly Failure[] = Object.freeze([
  Failure.INVALID_INPUT,
  Failure.UNKNOWN_MODEL,
  Failure.TEXT_TOO_LONG,
  Failure.RESULT_TOO_LARGE,
  Failure.NON_FINITE_OUTPUT,
  Failure.UNKNOWN_ACTIVITY,
  Failure.GPU_OUT_OF_MEMORY,
  Failure.MODEL_FAILURE,
  Failure.MODEL_NOT_SERVED,
  Failure.WORKER_SHUTDOWN,
  Failure.INTERNAL_ERROR,
  Failure.STORAGE_UNAVAILABLE,
]);

/** Whether `type` is one of gpulane's failure types (the worker's, or `CardLost`). */
export function isFailureType(type: unknown): type is Failure {
  return typeof type === 'string' && ((WORKER_FAILURES as readonly string[]).includes(type) || type === CARD_LOST);
}

// Rust's `char::is_whitespace` (Unicode White_Space), which `str::trim` strips. It differs
// from JavaScript's `String.prototype.trim` (U+0085 is whitespace here, U+FEFF is not).
const RUST_WHITESPACE = new Set<number>([
  0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004,
  0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000,
]);

/** Rust's `str::trim`, as code points. */
function rustTrim(s: string): string[] {
  const chars = Array.from(s); // code points, as Rust's chars()
  let start = 0;
  let end = chars.length;
  while (start < end && RUST_WHITESPACE.has(chars[start].codePointAt(0)!)) start++;
  while (end > start && RUST_WHITESPACE.has(chars[end - 1].codePointAt(0)!)) end--;
  return chars.slice(start, end);
}

/** Rust's `to_ascii_lowercase`: A-Z only, anything else untouched. */
function asciiLower(c: string): string {
  return c.length === 1 && c >= 'A' && c <= 'Z' ? String.fromCharCode(c.charCodeAt(0) + 32) : c;
}

function isAsciiAlphanumeric(c: string): boolean {
  return c.length === 1 && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'));
}

/**
 * Makes a host name safe and stable inside a queue name, as the worker does: trimmed,
 * ASCII-lower-cased, and anything but `[a-z0-9-]` becomes `-` (one per character), so that
 * dots in FQDNs do not look like separators; empty becomes `unknown-host`.
 */
export function sanitizeHost(host: string): string {
  const s = rustTrim(host)
    .map(asciiLower)
    .map((c) => (isAsciiAlphanumeric(c) || c === '-' ? c : '-'))
    .join('');
  return s === '' ? 'unknown-host' : s;
}

/** The private queue of one card: `gpu-tools.<host>.<gpu-uuid>` (host sanitized, UUID trimmed and lower-cased). */
export function gpuCardQueue(host: string, gpuUuid: string): string {
  return `${GPU_TOOLS}${QUEUE_PREFIX_SEPARATOR}${sanitizeHost(host)}${QUEUE_PREFIX_SEPARATOR}${rustTrim(gpuUuid)
    .map(asciiLower)
    .join('')}`;
}

/** The private CPU queue of one host: `cpu-tools.<host>`. */
export function cpuHostQueue(host: string): string {
  return `${CPU_TOOLS}${QUEUE_PREFIX_SEPARATOR}${sanitizeHost(host)}`;
}

/** The queue only workers serving `model` poll, on a shared lane: `gpu-tools@<model>` or `cpu-tools@<model>`. */
export function modelQueue(shared: string, model: string): string {
  return `${shared}${MODEL_QUEUE_SEPARATOR}${model}`;
}

/** Whether `name` may name a model: 1 to {@link MODEL_NAME_MAX} ASCII letters, digits, `-`, `_` and `.`. */
export function validModelName(name: string): boolean {
  return typeof name === 'string' && name.length >= 1 && name.length <= MODEL_NAME_MAX && /^[A-Za-z0-9._-]+$/.test(name);
}

// ---------------------------------------------------------------------------------------
// Payloads. Field names are the JSON contract (snake_case, as the worker's serde names);
// optional fields are left out when absent.

/** Input of the `embed` activity. */
export interface EmbedRequest {
  /** The texts to embed, in order. Required, at least one. */
  texts: string[];
  /** A model name served by the worker; absent means the worker's default embedder. */
  model?: string;
  /** L2-normalize the vectors; absent follows the model's own pipeline. */
  normalize?: boolean;
  /** Truncate texts longer than the model's limit (default true); false fails such a call with `TextTooLong`. */
  truncate?: boolean;
  /** Keep only the first `dimensions` values of each vector (Matryoshka models). */
  dimensions?: number;
  /** Text put before every input, e.g. e5's `"query: "`. */
  prompt?: string;
  /** A prompt by name from the model's config_sentence_transformers.json `prompts`. */
  prompt_name?: string;
  /** `float` (default): arrays of numbers; `base64`: each vector as base64 of little-endian float32 bytes. */
  encoding?: 'float' | 'base64';
}

/** Whether the device that served a call is a GPU or the CPU. */
export type DeviceKind = 'gpu' | 'cpu';

/** The device that served a call. */
export interface DeviceInfo {
  /** GPU or CPU. */
  kind: DeviceKind;
  /** The card's UUID as NVML reports it (GPU only). */
  uuid?: string;
  /** The card's NVML index (GPU only). */
  index?: number;
  /** The card's or CPU's name. */
  name: string;
  /** True when the card is declared by `--simulate-gpus` and computes on the CPU. */
  simulated: boolean;
}

/** Token accounting for one call. */
export interface Usage {
  /** Tokens processed, after truncation, special tokens included. */
  tokens: number;
}

/** The vectors of an `embed` result: arrays of numbers, or base64 strings with `encoding: "base64"`. */
export type Embeddings = number[][] | string[];

/**
 * Output of the `embed` activity. `E` is the form of `embeddings`: `number[][]` for the
 * default `float` encoding, `string[]` for `base64` (`embed` infers it from the request).
 */
export interface EmbedResponse<E extends Embeddings = Embeddings> {
  /** One vector per input text, in input order: arrays of numbers, or base64 strings with `encoding: "base64"`. */
  embeddings: E;
  /** The model name that served the call. */
  model: string;
  /** Exactly which weights: the Hugging Face commit, else `sha256:` and the hash of the weight files. */
  revision: string;
  /** The dtype the model computed in (`f32`, `f16`, `bf16`, or `int8`: a CPU lane run with `--cpu-dtype int8`, dense layers quantized dynamically). */
  dtype: string;
  /** The model family (`bert`, `xlm-roberta`, `distilbert`, `mpnet`, `modernbert`, `qwen3`). */
  family: string;
  /** Width of each vector. */
  dimensions: number;
  /** The device that served the call. */
  device: DeviceInfo;
  /** The private queue of the card (or host CPU) that served the call: schedule follow-ups there to stay on it. */
  host_task_queue: string;
  /** Tokens processed. */
  usage: Usage;
}

/** Input of the `rerank` activity. */
export interface RerankRequest {
  /** The query every document is scored against. Required. */
  query: string;
  /** The documents to score, in order. Required, at least one. */
  documents: string[];
  /** A cross-encoder served by the worker; absent means its first cross-encoder. */
  model?: string;
  /** Return only the best `top_n` results; absent returns all. */
  top_n?: number;
  /** Include each document's text in its result (default false). */
  return_documents?: boolean;
  /** Return the raw logit instead of its sigmoid (default false). */
  raw_scores?: boolean;
}

/** One scored document. */
export interface RerankResult {
  /** The document's position in the request. */
  index: number;
  /** Relevance: sigmoid of the logit in [0, 1], or the logit with `raw_scores`. */
  score: number;
  /** The document's text, with `return_documents`. */
  document?: string;
}

/** Output of the `rerank` activity. */
export interface RerankResponse {
  /** Results sorted by score, highest first. */
  results: RerankResult[];
  /** The model name that served the call. */
  model: string;
  /** Exactly which weights (see {@link EmbedResponse.revision}). */
  revision: string;
  /** The dtype the model computed in. */
  dtype: string;
  /** The model family. */
  family: string;
  /** The device that served the call. */
  device: DeviceInfo;
  /** The private queue of the card (or host CPU) that served the call. */
  host_task_queue: string;
  /** Tokens processed (all pairs, after truncation). */
  usage: Usage;
}

/** One of `count` equal slices of a dataset. */
export interface Shard {
  /** From 0. */
  index: number;
  /** At least 1. */
  count: number;
}

/** Rows `[start, end)`. */
export interface RowRange {
  /** First row, from 0. */
  start: number;
  /** One past the last row. */
  end: number;
}

/** Input of the `embed_dataset` activity (unknown fields are refused). */
export interface EmbedDatasetRequest {
  /** The dataset's URI (`file:///…` or `s3://bucket/…`), inside a `--data-root`. */
  source: string;
  /** `parquet`, `jsonl` or `csv`; inferred from the extension when absent. */
  format?: 'parquet' | 'jsonl' | 'csv';
  /** The column of unique row ids (integers or strings). */
  id_column: string;
  /** The column of texts. */
  text_column: string;
  /** A URI prefix the parts and the manifest are written under, inside a `--data-root`. */
  output: string;
  /** Shard `index` of `count`. */
  shard?: Shard;
  /** Rows `[start, end)` of the dataset. */
  rows?: RowRange;
  /** Rows per part file (default 1,000). */
  part_rows?: number;
  /** As in `embed`. */
  model?: string;
  /** As in `embed`. */
  normalize?: boolean;
  /** As in `embed`. */
  truncate?: boolean;
  /** As in `embed`. */
  dimensions?: number;
  /** As in `embed`. */
  prompt?: string;
  /** As in `embed`. */
  prompt_name?: string;
}

/** One written part file. */
export interface PartRef {
  /** Its URI. */
  uri: string;
  /** Rows in it. */
  rows: number;
}

/** Output of `embed_dataset`, also written as the job's manifest file. */
export interface Manifest {
  /** The output prefix, ending in `/`. */
  output: string;
  /** The manifest file's URI. */
  manifest: string;
  /** The dataset read. */
  source: string;
  /** First row embedded. */
  start: number;
  /** One past the last row embedded. */
  end: number;
  /** Rows embedded (`end - start`). */
  rows: number;
  /** Width of each vector. */
  dimensions: number;
  /** The model's name. */
  model: string;
  /** The model's revision. */
  revision: string;
  /** The dtype it computed in. */
  dtype: string;
  /** Its family. */
  family: string;
  /** Tokens of the parts this attempt wrote. */
  tokens: number;
  /** The part files, in row order. */
  parts: PartRef[];
  /** Parts an earlier attempt had written, found and kept. */
  skipped_parts: number;
}
