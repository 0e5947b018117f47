/**
 * A Temporal workflow (TypeScript) that embeds a document's chunks on one GPU card with the
 * `gpulane` npm package (clients/typescript): the first batch goes to `gpu-tools` (or
 * `cpu-tools` when no card takes it within 30 s), every later batch to the card that served
 * it, and if that card is lost midway the whole document starts again on another card.
 *
 *     npm install ./clients/typescript/gpulane-0.1.0.tgz @temporalio/workflow @temporalio/worker @temporalio/client
 *     (the tarball from `npm pack` in clients/typescript; the package is not on the registry)
 *
 * Register it like any workflow: `Worker.create({ workflowsPath:
 * require.resolve('./embed_session'), taskQueue: 'my-app', ... })`, then
 * `client.workflow.execute(embedDocument, { args: [chunks], taskQueue: 'my-app', workflowId })`.
 * tests/clients/typescript runs it against gpulane workers.
 */

import { InvalidInput, runInSession } from 'gpulane/workflow';

export interface EmbeddedDocument {
  /** One vector per chunk, in order. */
  vectors: number[][];
  /** The private queue of the card (or host CPU) that embedded every chunk. */
  card: string;
  /** Sessions it took (more than 1 when a card was lost). */
  attempts: number;
  /** Tokens embedded in the last session. */
  tokens: number;
}

export async function embedDocument(chunks: string[], batchSize = 16): Promise<EmbeddedDocument> {
  if (chunks.length === 0) throw new InvalidInput('embedDocument: no chunks');
  return await runInSession(
    async (session, attempt) => {
      const vectors: number[][] = [];
      let tokens = 0;
      for (let i = 0; i < chunks.length; i += batchSize) {
        const r = await session.embed({ texts: chunks.slice(i, i + batchSize), normalize: true });
        vectors.push(...r.embeddings);
        tokens += r.usage.tokens;
      }
      return { vectors, card: session.pinnedQueue ?? '', attempts: attempt, tokens };
    },
    { pinnedScheduleToStart: '20s', attempts: 3 }
  );
}
