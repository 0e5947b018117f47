// Test workflows for the gpulane npm package. They import `gpulane/workflow` as a user
// would: from the package installed (from its tarball) in this folder's node_modules.

import type { Duration } from '@temporalio/common';
import { ActivityFailure, ApplicationFailure, defineQuery, setHandler, sleep, uuid4 } from '@temporalio/workflow';
import {
  CardSession,
  GpulaneError,
  InvalidInput,
  Failure,
  embed,
  isGpulaneFailure,
  isScheduleToStartTimeout,
  rerank,
  runInSession,
  type EmbedResponse,
  type RerankResponse,
  type SessionOptions,
} from 'gpulane/workflow';

type Summary = Omit<EmbedResponse, 'embeddings'> & { rows: number; width: number };

function summary(r: EmbedResponse): Summary {
  const { embeddings, ...rest } = r;
  return { ...rest, rows: embeddings.length, width: (embeddings[0] as number[]).length };
}

/** One session: a first embed, then `followUps` more; every result's queue and device. */
export async function sessionFollowUps(followUps: number, options: SessionOptions): Promise<{
  pinnedQueue: string | undefined;
  results: Summary[];
}> {
  const session = new CardSession(options);
  const results: Summary[] = [summary(await session.embed({ texts: ['the first call picks the card'] }))];
  for (let i = 0; i < followUps; i++) {
    results.push(summary(await session.embed({ texts: [`follow-up ${i}`] })));
  }
  return { pinnedQueue: session.pinnedQueue, results };
}

export interface Progress {
  attempt: number;
  pinnedQueue: string | undefined;
  done: number;
}

export const progressQuery = defineQuery<Progress>('progress');

/**
 * `calls` embeds in one session, `sleepMs` apart, run by `runInSession`: when the pinned
 * card is lost the whole sequence starts again. Progress is queryable.
 */
export async function sequenceInSession(input: {
  calls: number;
  sleepMs: number;
  session: SessionOptions & { attempts?: number };
}): Promise<{ attempts: number; queues: string[]; devices: string[]; lost: { attempt: number; done: number }[] }> {
  const progress: Progress = { attempt: 0, pinnedQueue: undefined, done: 0 };
  const lost: { attempt: number; done: number }[] = [];
  setHandler(progressQuery, () => progress);
  return await runInSession(async (session, attempt) => {
    if (progress.attempt > 0) lost.push({ attempt: progress.attempt, done: progress.done });
    progress.attempt = attempt;
    progress.done = 0;
    progress.pinnedQueue = undefined;
    const queues: string[] = [];
    const devices: string[] = [];
    for (let i = 0; i < input.calls; i++) {
      if (i > 0) await sleep(input.sleepMs);
      const r = await session.embed({ texts: [`call ${i} of attempt ${attempt}`] });
      progress.pinnedQueue = session.pinnedQueue;
      progress.done = i + 1;
      queues.push(r.host_task_queue);
      devices.push(r.device.uuid ?? r.device.kind);
    }
    return { attempts: attempt, queues, devices, lost };
  }, input.session);
}

/** A first call that must fall back; the time it took, in workflow time. */
export async function embedWithFallback(scheduleToStart: Duration): Promise<{ result: Summary; elapsedMs: number }> {
  const t0 = Date.now();
  const result = await embed({ texts: ['no card has room for me'] }, { scheduleToStart });
  return { result: summary(result), elapsedMs: Date.now() - t0 };
}

/** `embed` and `rerank` with the payload fields a user sets; the results as they come. */
export async function roundTrip(input: {
  texts: string[];
  query: string;
  documents: string[];
}): Promise<{ embed: EmbedResponse; rerank: RerankResponse; rerankDocs: RerankResponse }> {
  const e = await embed({ texts: input.texts, model: 'minilm' });
  const r = await rerank({ query: input.query, documents: input.documents, model: 'ce' });
  const d = await rerank({ query: input.query, documents: input.documents, model: 'ce', top_n: 2, return_documents: true });
  return { embed: e, rerank: r, rerankDocs: d };
}

/** Bad input caught in the workflow, and a non-gpulane failure that must pass through unchanged. */
export async function badInputCaught(): Promise<Record<string, unknown>> {
  const out: Record<string, unknown> = {};
  try {
    await embed({ texts: [] });
    out.invalid = 'no error';
  } catch (err) {
    const e = err as ApplicationFailure;
    out.invalid = {
      name: e.name,
      type: e.type,
      nonRetryable: e.nonRetryable,
      message: e.message,
      isInvalidInput: err instanceof InvalidInput,
      isGpulaneError: err instanceof GpulaneError,
      isApplicationFailure: err instanceof ApplicationFailure,
      isGpulaneFailure: isGpulaneFailure(err, Failure.INVALID_INPUT),
      isGpulaneFailureOtherType: isGpulaneFailure(err, Failure.TEXT_TOO_LONG),
      causeIsActivityFailure: e.cause instanceof ActivityFailure,
      retryState: e.cause instanceof ActivityFailure ? e.cause.retryState : null,
    };
  }
  try {
    // Nobody polls this queue and there is no fallback: Temporal's timeout comes through as is.
    await embed({ texts: ['x'] }, { taskQueue: `nobody-${uuid4()}`, fallback: null, scheduleToStart: '1s' });
    out.timeout = 'no error';
  } catch (err) {
    out.timeout = {
      isActivityFailure: err instanceof ActivityFailure,
      isGpulaneError: err instanceof GpulaneError,
      isScheduleToStartTimeout: isScheduleToStartTimeout(err),
    };
  }
  return out;
}

/** Bad input left to fail the workflow. */
export async function badInputPropagates(): Promise<EmbedResponse> {
  return await embed({ texts: [] });
}
