/**
 * Workflow-side helpers for gpulane: typed `embed` / `rerank` calls that fall back from the
 * GPU lane to the CPU lane, card sessions that pin follow-up calls to the card that served
 * the first one, `runInSession` to start a sequence again when its card is lost, and typed
 * failures.
 *
 * Import this module from workflow code only: it uses `@temporalio/workflow`.
 */

import { ActivityFailure, ApplicationFailure, TimeoutFailure, proxyActivities } from '@temporalio/workflow';
import { TimeoutType } from '@temporalio/common';
import type { Duration, RetryPolicy } from '@temporalio/common';
import {
  Activity,
  CPU_TOOLS,
  Failure,
  GPU_TOOLS,
  isFailureType,
  type EmbedDatasetRequest,
  type EmbedRequest,
  type EmbedResponse,
  type Manifest,
  type RerankRequest,
  type RerankResponse,
} from './index';

export * from './index';

// ---------------------------------------------------------------------------------------
// Options

/** Options of one call (`embed`, `rerank`) and of a {@link CardSession}'s first call. */
export interface CallOptions {
  /** Where the call goes first. Default `gpu-tools`. */
  taskQueue?: string;
  /**
   * Where the call goes when nothing on `taskQueue` started it within `scheduleToStart`.
   * Default `cpu-tools`; `null` for no fallback (the schedule-to-start timeout is then
   * thrown as Temporal's `ActivityFailure`).
   */
  fallback?: string | null;
  /**
   * The budget on `taskQueue` before falling back (Temporal's schedule-to-start timeout).
   * Default 30 s, or none when `fallback` is `null` (the call then waits on `taskQueue`);
   * `null` for none. Given with `fallback: null`, its timeout is thrown as Temporal's
   * `ActivityFailure`. The fallback call has no schedule-to-start timeout.
   */
  scheduleToStart?: Duration | null;
  /** Each attempt's limit once started (start-to-close). Default 5 min. */
  startToClose?: Duration;
  /** How long an attempt may go without a heartbeat (the worker heartbeats). Default 60 s. */
  heartbeatTimeout?: Duration;
  /** Temporal's retry policy for each call; default: Temporal's (unlimited attempts, backoff). */
  retry?: RetryPolicy;
}

/** Options of a {@link CardSession}. */
export interface SessionOptions extends CallOptions {
  /**
   * The schedule-to-start budget of a call pinned to the session's card; past it the card
   * counts as lost ({@link CardLost}). Default 30 s.
   */
  pinnedScheduleToStart?: Duration;
}

/** Options of {@link runInSession}. */
export interface RunInSessionOptions extends SessionOptions {
  /** How many sessions (each a run of the whole body) before the last `CardLost` is thrown. Default 3. */
  attempts?: number;
}

export const DEFAULT_SCHEDULE_TO_START: Duration = '30s';
export const DEFAULT_START_TO_CLOSE: Duration = '5m';
export const DEFAULT_HEARTBEAT_TIMEOUT: Duration = '60s';
export const DEFAULT_PINNED_SCHEDULE_TO_START: Duration = '30s';
export const DEFAULT_SESSION_ATTEMPTS = 3;
export const DEFAULT_DATASET_START_TO_CLOSE: Duration = '6h';
export const DEFAULT_DATASET_HEARTBEAT_TIMEOUT: Duration = '2m';

// ---------------------------------------------------------------------------------------
// Typed failures

/**
 * A gpulane failure, rethrown in the workflow as an `ApplicationFailure` of the same type,
 * message and retryability, so that throwing it (or letting it through) fails the workflow
 * rather than its task. `cause` is the activity's `ActivityFailure`, when there was one;
 * `details` are the worker's. Match with `instanceof` (the subclass per type, e.g.
 * {@link InvalidInput}) or with {@link isGpulaneFailure}.
 */
export class GpulaneError extends ApplicationFailure {
  constructor(
    message: string | undefined | null,
    type: Failure,
    nonRetryable?: boolean | null,
    cause?: Error,
    details?: unknown[] | null
  ) {
    super(message, type, nonRetryable ?? false, details ?? undefined, cause);
  }
}
Object.defineProperty(GpulaneError.prototype, 'name', { value: 'GpulaneError', enumerable: true });

type GpulaneErrorClass = new (message?: string | null, nonRetryable?: boolean | null, cause?: Error, details?: unknown[] | null) => GpulaneError;

function failureClass(type: Failure, retryable: boolean): GpulaneErrorClass {
  const cls = class extends GpulaneError {
    constructor(message?: string | null, nonRetryable?: boolean | null, cause?: Error, details?: unknown[] | null) {
      super(message, type, nonRetryable ?? !retryable, cause, details);
    }
  };
  Object.defineProperty(cls, 'name', { value: type });
  Object.defineProperty(cls.prototype, 'name', { value: type, enumerable: true });
  return cls;
}

/** `InvalidInput`: the input is malformed or over a limit. Never retried. */
export const InvalidInput = failureClass(Failure.INVALID_INPUT, false);
export type InvalidInput = InstanceType<typeof InvalidInput>;
/** `UnknownModel`: the model is not served (private queue). Never retried. */
export const UnknownModel = failureClass(Failure.UNKNOWN_MODEL, false);
export type UnknownModel = InstanceType<typeof UnknownModel>;
/** `TextTooLong`: a text is over the model's limit and `truncate` is false. Never retried. */
export const TextTooLong = failureClass(Failure.TEXT_TOO_LONG, false);
export type TextTooLong = InstanceType<typeof TextTooLong>;
/** `ResultTooLarge`: the result would exceed the payload limit. Never retried. */
export const ResultTooLarge = failureClass(Failure.RESULT_TOO_LARGE, false);
export type ResultTooLarge = InstanceType<typeof ResultTooLarge>;
/** `NonFiniteOutput`: the model's output for an input holds NaN or infinity; the message names the input and the fix. Never retried. */
export const NonFiniteOutput = failureClass(Failure.NON_FINITE_OUTPUT, false);
export type NonFiniteOutput = InstanceType<typeof NonFiniteOutput>;
/** `UnknownActivity`: an activity type the worker does not serve. Never retried. */
export const UnknownActivity = failureClass(Failure.UNKNOWN_ACTIVITY, false);
export type UnknownActivity = InstanceType<typeof UnknownActivity>;
/** `GpuOutOfMemory`: the card ran out of memory (retried until the retry policy gave up). */
export const GpuOutOfMemory = failureClass(Failure.GPU_OUT_OF_MEMORY, true);
export type GpuOutOfMemory = InstanceType<typeof GpuOutOfMemory>;
/** `ModelFailure`: the model failed on the device (retried until the retry policy gave up). */
export const ModelFailure = failureClass(Failure.MODEL_FAILURE, true);
export type ModelFailure = InstanceType<typeof ModelFailure>;
/** `ModelNotServed`: no worker on the shared queue served the model before the retry policy gave up. */
export const ModelNotServed = failureClass(Failure.MODEL_NOT_SERVED, true);
export type ModelNotServed = InstanceType<typeof ModelNotServed>;
/** `WorkerShutdown`: the worker stopped during the activity (retried until the retry policy gave up). */
export const WorkerShutdown = failureClass(Failure.WORKER_SHUTDOWN, true);
export type WorkerShutdown = InstanceType<typeof WorkerShutdown>;
/** `InternalError`: a bug in gpulane ended the activity (retried until the retry policy gave up). */
export const InternalError = failureClass(Failure.INTERNAL_ERROR, true);
export type InternalError = InstanceType<typeof InternalError>;
/** `StorageUnavailable`: storage failed (retried until the retry policy gave up). */
export const StorageUnavailable = failureClass(Failure.STORAGE_UNAVAILABLE, true);
export type StorageUnavailable = InstanceType<typeof StorageUnavailable>;
/**
 * `CardLost` (this package's own type): a call pinned to a session's card was not started
 * within `pinnedScheduleToStart`. Retryable; {@link runInSession} runs its body again on a
 * new session.
 */
export const CardLost = failureClass(Failure.CARD_LOST, true);
export type CardLost = InstanceType<typeof CardLost>;

/** The typed error class of each failure type (Python's `BY_TYPE`). */
export const FAILURE_CLASSES: Readonly<Record<Failure, GpulaneErrorClass>> = Object.freeze({
  [Failure.INVALID_INPUT]: InvalidInput,
  [Failure.UNKNOWN_MODEL]: UnknownModel,
  [Failure.TEXT_TOO_LONG]: TextTooLong,
  [Failure.RESULT_TOO_LARGE]: ResultTooLarge,
  [Failure.NON_FINITE_OUTPUT]: NonFiniteOutput,
  [Failure.UNKNOWN_ACTIVITY]: UnknownActivity,
  [Failure.GPU_OUT_OF_MEMORY]: GpuOutOfMemory,
  [Failure.MODEL_FAILURE]: ModelFailure,
  [Failure.MODEL_NOT_SERVED]: ModelNotServed,
  [Failure.WORKER_SHUTDOWN]: WorkerShutdown,
  [Failure.INTERNAL_ERROR]: InternalError,
  [Failure.STORAGE_UNAVAILABLE]: StorageUnavailable,
  [Failure.CARD_LOST]: CardLost,
});

/** {@link FAILURE_CLASSES}, by the Python package's name. */
export const BY_TYPE = FAILURE_CLASSES;

/**
 * The gpulane `ApplicationFailure` in `err`: `err` itself, or the cause of an
 * `ActivityFailure` (as Temporal delivers a worker's failure). Undefined when there is none.
 */
function gpulaneFailureIn(err: unknown): ApplicationFailure | undefined {
  if (err instanceof ApplicationFailure && isFailureType(err.type)) return err;
  if (err instanceof ActivityFailure && err.cause instanceof ApplicationFailure && isFailureType(err.cause.type)) {
    return err.cause;
  }
  return undefined;
}

/**
 * Whether `err` is a gpulane failure (of `type`, when given): a typed {@link GpulaneError},
 * any `ApplicationFailure` with a gpulane type, or an `ActivityFailure` caused by one (an
 * activity called without this package).
 */
export function isGpulaneFailure(err: unknown, type?: Failure | string): boolean {
  const f = gpulaneFailureIn(err);
  return f !== undefined && (type === undefined || f.type === type);
}

/**
 * `err` as a typed error: an `ActivityFailure` caused by a gpulane failure becomes the
 * failure type's {@link GpulaneError} subclass (same message, type, `nonRetryable` and
 * details; `cause` the `ActivityFailure`). Anything else is returned unchanged.
 */
export function asGpulaneError(err: unknown): unknown {
  if (err instanceof GpulaneError || !(err instanceof ActivityFailure)) return err;
  const cause = gpulaneFailureIn(err);
  if (cause === undefined) return err;
  const cls = FAILURE_CLASSES[cause.type as Failure];
  return new cls(cause.message, Boolean(cause.nonRetryable), err, cause.details);
}

/**
 * The typed error behind `err` (an `ActivityFailure` caused by a gpulane failure, or a
 * typed error itself), or undefined for anything else (timeouts, cancellation, other
 * types). Python's `typed_error`.
 */
export function typedError(err: unknown): GpulaneError | undefined {
  const typed = asGpulaneError(err);
  return typed instanceof GpulaneError ? typed : undefined;
}

/** Whether `err` is an activity that timed out before any worker started it. */
export function isScheduleToStartTimeout(err: unknown): boolean {
  if (!(err instanceof ActivityFailure) || !(err.cause instanceof TimeoutFailure)) return false;
  const t: unknown = err.cause.timeoutType;
  return t === TimeoutType.SCHEDULE_TO_START || t === TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START;
}

// ---------------------------------------------------------------------------------------
// Calls

interface Resolved {
  taskQueue: string;
  fallback: string | null;
  scheduleToStart: Duration | null;
  startToClose: Duration;
  heartbeatTimeout: Duration;
  retry?: RetryPolicy;
}

function resolve(options: CallOptions = {}): Resolved {
  const fallback = options.fallback === undefined ? CPU_TOOLS : options.fallback;
  const scheduleToStart =
    options.scheduleToStart !== undefined ? options.scheduleToStart : fallback === null ? null : DEFAULT_SCHEDULE_TO_START;
  return {
    taskQueue: options.taskQueue ?? GPU_TOOLS,
    fallback,
    scheduleToStart,
    startToClose: options.startToClose ?? DEFAULT_START_TO_CLOSE,
    heartbeatTimeout: options.heartbeatTimeout ?? DEFAULT_HEARTBEAT_TIMEOUT,
    retry: options.retry,
  };
}

type Untyped = Record<string, (request: unknown) => Promise<unknown>>;

/** One activity call on one queue; failures as they come (untyped). */
function schedule<R>(activity: string, request: unknown, o: Resolved, taskQueue: string, scheduleToStart: Duration | null): Promise<R> {
  const acts = proxyActivities<Untyped>({
    taskQueue,
    startToCloseTimeout: o.startToClose,
    heartbeatTimeout: o.heartbeatTimeout,
    ...(scheduleToStart === null ? {} : { scheduleToStartTimeout: scheduleToStart }),
    ...(o.retry === undefined ? {} : { retry: o.retry }),
  });
  return acts[activity](request) as Promise<R>;
}

/** A call on `taskQueue`, then on `fallback` when nothing started it in time; failures typed. */
async function callWithFallback<R>(activity: string, request: unknown, o: Resolved): Promise<R> {
  try {
    return await schedule<R>(activity, request, o, o.taskQueue, o.scheduleToStart);
  } catch (err) {
    if (o.fallback !== null && isScheduleToStartTimeout(err)) {
      try {
        return await schedule<R>(activity, request, o, o.fallback, null);
      } catch (err2) {
        throw asGpulaneError(err2);
      }
    }
    throw asGpulaneError(err);
  }
}

/**
 * Runs `activity` (any gpulane activity by name, with `request` as its JSON argument) with
 * the routing and fallback of {@link embed}; gpulane failures are thrown typed. For
 * `embed_dataset`, use {@link embedDataset} (no fallback, longer timeouts).
 */
export function call<R = unknown>(activity: Activity | string, request: unknown, options?: CallOptions): Promise<R> {
  return callWithFallback<R>(activity, request, resolve(options));
}

/**
 * The `embed` activity on `options.taskQueue` (default `gpu-tools`); when no worker there
 * started it within `scheduleToStart` (default 30 s), the same call on `options.fallback`
 * (default `cpu-tools`). gpulane failures are thrown as typed errors ({@link GpulaneError}).
 */
export function embed(request: EmbedRequest & { encoding: 'base64' }, options?: CallOptions): Promise<EmbedResponse<string[]>>;
export function embed(request: EmbedRequest & { encoding?: 'float' }, options?: CallOptions): Promise<EmbedResponse<number[][]>>;
export function embed(request: EmbedRequest, options?: CallOptions): Promise<EmbedResponse>;
export function embed(request: EmbedRequest, options?: CallOptions): Promise<EmbedResponse> {
  return call<EmbedResponse>(Activity.EMBED, request, options);
}

/** The `rerank` activity, with {@link embed}'s routing, fallback and typed failures. */
export function rerank(request: RerankRequest, options?: CallOptions): Promise<RerankResponse> {
  return call<RerankResponse>(Activity.RERANK, request, options);
}

/** Options of {@link embedDataset}. */
export interface DatasetOptions {
  /** Where the job goes. Default `gpu-tools`; there is no fallback: a bulk job waits for a card. */
  taskQueue?: string;
  /** Each attempt's limit once started. Default 6 h. */
  startToClose?: Duration;
  /** How long an attempt may go without a heartbeat (the worker heartbeats each part). Default 2 min. */
  heartbeatTimeout?: Duration;
  /** Temporal's retry policy; a retried attempt resumes from its last written part. */
  retry?: RetryPolicy;
}

/**
 * One `embed_dataset` (a whole dataset, one `shard` or a `rows` range) from storage to
 * Parquet parts; its {@link Manifest}. No CPU fallback and no schedule-to-start timeout.
 * gpulane failures are thrown typed.
 */
export async function embedDataset(request: EmbedDatasetRequest, options: DatasetOptions = {}): Promise<Manifest> {
  const o: Resolved = {
    taskQueue: options.taskQueue ?? GPU_TOOLS,
    fallback: null,
    scheduleToStart: null,
    startToClose: options.startToClose ?? DEFAULT_DATASET_START_TO_CLOSE,
    heartbeatTimeout: options.heartbeatTimeout ?? DEFAULT_DATASET_HEARTBEAT_TIMEOUT,
    retry: options.retry,
  };
  try {
    return await schedule<Manifest>(Activity.EMBED_DATASET, request, o, o.taskQueue, null);
  } catch (err) {
    throw asGpulaneError(err);
  }
}

/**
 * Input of {@link embedDatasetJob}; the same JSON as the Python package's
 * `gpulane.EmbedDatasetJob`.
 */
export interface EmbedDatasetJobInput {
  /** The request every shard runs, without `shard` or `rows` (the job sets `shard`). */
  request: EmbedDatasetRequest;
  /** How many slices, run in parallel. At least 1. */
  shards: number;
  /** Where the shards' activities go. Default `gpu-tools`. */
  task_queue?: string;
  /** Heartbeat timeout in seconds. Default 120. */
  heartbeat_timeout_s?: number;
  /** Start-to-close timeout in seconds. Default 21,600 (6 h). */
  start_to_close_s?: number;
}

/** The longest timeout a job may ask for, in seconds (10 years). */
const MAX_SECONDS = 10 * 365 * 24 * 3600;

/** A job field's value as a failure message shows it: numbers whole, else the type. */
function shown(value: unknown): string {
  return typeof value === 'number' ? String(value) : value === null ? 'null' : typeof value;
}

/**
 * A workflow: a large dataset over every card, as `embed_dataset` once per shard in
 * parallel; the shards' manifests, in shard order. Register it by exporting it from your
 * workflows module: `export { embedDatasetJob } from 'gpulane/workflow';`. A bad job (no
 * request object, no shards, `shard` / `rows` in the request, a timeout that is not a
 * number of seconds) fails the workflow with `InvalidInput`.
 */
export async function embedDatasetJob(job: EmbedDatasetJobInput): Promise<Manifest[]> {
  // A bad job fails the workflow with InvalidInput: a TypeError would fail the workflow
  // task, which Temporal retries forever. Messages show a value's type, or the number
  // itself, never a caller's string whole.
  if (typeof job !== 'object' || job === null || Array.isArray(job)) {
    throw new InvalidInput('embedDatasetJob: the job must be an object with request and shards');
  }
  if (typeof job.request !== 'object' || job.request === null || Array.isArray(job.request)) {
    throw new InvalidInput('embedDatasetJob: request must be the embed_dataset request, an object');
  }
  const shards: unknown = job.shards;
  if (typeof shards !== 'number' || !Number.isInteger(shards) || shards < 1) {
    throw new InvalidInput(`embedDatasetJob: shards must be an integer of at least 1, not ${shown(shards)}`);
  }
  for (const key of ['heartbeat_timeout_s', 'start_to_close_s'] as const) {
    const value: unknown = job[key];
    if (value !== undefined && !(typeof value === 'number' && value > 0 && value <= MAX_SECONDS)) {
      throw new InvalidInput(
        `embedDatasetJob: ${key} must be a number of seconds above 0 and at most ${MAX_SECONDS} (10 years), not ${shown(value)}`
      );
    }
  }
  const queue: unknown = job.task_queue;
  if (queue !== undefined && !(typeof queue === 'string' && queue !== '')) {
    throw new InvalidInput(`embedDatasetJob: task_queue must be a task queue name, not ${shown(queue)}`);
  }
  if (job.request.shard !== undefined || job.request.rows !== undefined) {
    throw new InvalidInput('embedDatasetJob: the job picks the shards; leave shard and rows out of the request');
  }
  // Only what the job sets: embedDataset's own defaults apply to the rest.
  const options: DatasetOptions = {
    taskQueue: job.task_queue,
    heartbeatTimeout: job.heartbeat_timeout_s === undefined ? undefined : job.heartbeat_timeout_s * 1000,
    startToClose: job.start_to_close_s === undefined ? undefined : job.start_to_close_s * 1000,
  };
  return await Promise.all(
    Array.from({ length: shards }, (_, index) => embedDataset({ ...job.request, shard: { index, count: shards } }, options))
  );
}

// ---------------------------------------------------------------------------------------
// Sessions

/**
 * Keeps a sequence of calls on one card. The first call goes through {@link embed} /
 * {@link rerank} (shared queue, then fallback); the private queue of the card (or host CPU)
 * that served it, its `host_task_queue`, becomes {@link pinnedQueue}, and every later call
 * goes there with a schedule-to-start budget of `pinnedScheduleToStart`. A pinned call that
 * no worker started within that budget throws {@link CardLost}: the card's worker is gone
 * (or the card is full); {@link runInSession} then starts the sequence again.
 *
 * Calls made while the first is in flight wait for it, so they are pinned too.
 */
export class CardSession {
  /** The private queue every call after the first goes to; undefined until the first call returns. */
  pinnedQueue: string | undefined = undefined;
  /** Calls completed in this session. */
  calls = 0;
  private readonly resolved: Resolved;
  private readonly pinnedScheduleToStart: Duration;
  private firstCall: Promise<unknown> | undefined = undefined;

  constructor(readonly options: SessionOptions = {}) {
    this.resolved = resolve(options);
    this.pinnedScheduleToStart = options.pinnedScheduleToStart ?? DEFAULT_PINNED_SCHEDULE_TO_START;
  }

  /** `embed`, on the session's card. */
  embed(request: EmbedRequest & { encoding: 'base64' }): Promise<EmbedResponse<string[]>>;
  embed(request: EmbedRequest & { encoding?: 'float' }): Promise<EmbedResponse<number[][]>>;
  embed(request: EmbedRequest): Promise<EmbedResponse>;
  embed(request: EmbedRequest): Promise<EmbedResponse> {
    return this.call<EmbedResponse>(Activity.EMBED, request);
  }

  /** `rerank`, on the session's card. */
  rerank(request: RerankRequest): Promise<RerankResponse> {
    return this.call<RerankResponse>(Activity.RERANK, request);
  }

  /** Any gpulane activity whose result names `host_task_queue`, on the session's card. */
  async call<R extends { host_task_queue: string }>(activity: Activity | string, request: unknown): Promise<R> {
    while (this.pinnedQueue === undefined && this.firstCall !== undefined) {
      try {
        await this.firstCall;
      } catch {
        // The first call failed; this one may become the first.
      }
    }
    if (this.pinnedQueue === undefined) {
      const first = callWithFallback<R>(activity, request, this.resolved);
      this.firstCall = first;
      try {
        const result = await first;
        if (this.pinnedQueue === undefined) this.pinnedQueue = result.host_task_queue;
        this.calls++;
        return result;
      } finally {
        if (this.firstCall === first) this.firstCall = undefined;
      }
    }
    const queue = this.pinnedQueue;
    try {
      const result = await schedule<R>(activity, request, this.resolved, queue, this.pinnedScheduleToStart);
      this.calls++;
      return result;
    } catch (err) {
      if (isScheduleToStartTimeout(err)) {
        throw new CardLost(
          `no worker started the ${activity} call pinned to ${queue} within ${String(this.pinnedScheduleToStart)}: ` +
            'its card or worker is gone (or the card is full); run the sequence again on another card',
          false,
          err as Error
        );
      }
      throw asGpulaneError(err);
    }
  }
}

/** Whether `err` is {@link CardLost} (or any `ApplicationFailure` of type `CardLost`). */
export function isCardLost(err: unknown): boolean {
  return err instanceof ApplicationFailure && err.type === Failure.CARD_LOST;
}

/**
 * Runs `body` with a fresh {@link CardSession}; when it throws {@link CardLost}, runs the
 * whole body again with a new session (a new card), up to `options.attempts` times
 * (default 3), then rethrows the last `CardLost`. Anything else `body` throws is rethrown
 * at once. `body`'s second argument is the attempt, from 1. `attempts` below 1 is a
 * programming error (a `RangeError`, which fails the workflow task, not the workflow).
 */
export async function runInSession<T>(
  body: (session: CardSession, attempt: number) => Promise<T>,
  options: RunInSessionOptions = {}
): Promise<T> {
  const { attempts = DEFAULT_SESSION_ATTEMPTS, ...sessionOptions } = options;
  if (!Number.isInteger(attempts) || attempts < 1) {
    throw new RangeError(`runInSession: attempts must be an integer of at least 1, not ${String(attempts)}`);
  }
  let last: unknown;
  for (let attempt = 1; attempt <= attempts; attempt++) {
    try {
      return await body(new CardSession(sessionOptions), attempt);
    } catch (err) {
      if (!isCardLost(err)) throw err;
      last = err;
    }
  }
  throw last;
}
