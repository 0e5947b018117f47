// Compile-only checks of the installed package's declarations (run.sh type-checks this file
// with tsc; it is never run). Each @ts-expect-error line must be an error, or tsc fails.

import {
  CardSession,
  Failure,
  InvalidInput,
  embed,
  rerank,
  runInSession,
  type EmbedResponse,
  type GpulaneError,
  type Manifest,
  type RerankResponse,
} from 'gpulane/workflow';
import { gpuCardQueue, type EmbedDatasetRequest, type EmbedRequest } from 'gpulane';

export async function checks(): Promise<void> {
  const floats = await embed({ texts: ['a'] });
  const x: number = floats.embeddings[0][0];
  const b64 = await embed({ texts: ['a'], encoding: 'base64' });
  const s: string = b64.embeddings[0];
  const dynamic: EmbedRequest = { texts: ['a'] };
  const either: EmbedResponse = await embed(dynamic);
  // @ts-expect-error the encoding is not known, so neither is the form
  const y: number = either.embeddings[0][0];
  const tokens: number = floats.usage.tokens;
  const kind: 'gpu' | 'cpu' = floats.device.kind;
  const queue: string = floats.host_task_queue;
  // @ts-expect-error JSON names are snake_case
  floats.hostTaskQueue;
  // @ts-expect-error texts is an array
  await embed({ texts: 'a' });
  // @ts-expect-error no such field
  await embed({ texts: ['a'], prompt_nam: 'q' });
  // @ts-expect-error no such encoding
  await embed({ texts: ['a'], encoding: 'f16' });
  const r: RerankResponse = await rerank({ query: 'q', documents: ['d'], top_n: 1, return_documents: true });
  const doc: string | undefined = r.results[0].document;
  // @ts-expect-error documents are required
  await rerank({ query: 'q' });
  await embed({ texts: ['a'] }, { taskQueue: 'gpu-tools@minilm', fallback: null, scheduleToStart: '1m', retry: { maximumAttempts: 2 } });
  const session = new CardSession({ pinnedScheduleToStart: '5s' });
  const pinned: string | undefined = session.pinnedQueue;
  const v: number[][] = (await session.embed({ texts: ['a'] })).embeddings;
  const n: number = await runInSession(async (sess, attempt) => (await sess.embed({ texts: ['a'] })).dimensions + attempt, {
    attempts: 2,
  });
  const dataset: EmbedDatasetRequest = { source: 's3://b/x.parquet', id_column: 'id', text_column: 't', output: 's3://b/out/', shard: { index: 0, count: 4 } };
  // @ts-expect-error a Manifest has no such field
  const m: Manifest['row_count'] = 0;
  try {
    await embed({ texts: [] });
  } catch (err) {
    if (err instanceof InvalidInput) {
      const e: GpulaneError = err;
      const t: string | null | undefined = e.type;
      const f: Failure = Failure.INVALID_INPUT;
      void [t, f];
    }
  }
  void [x, s, y, tokens, kind, queue, doc, pinned, v, n, dataset, m, gpuCardQueue('h', 'u')];
}
