// End-to-end tests of the gpulane npm package: workflows written in TypeScript against
// `gpulane/workflow` (installed from the packed tarball), run by an in-process
// @temporalio/worker Worker, against a real dev server and real gpulane workers.

import { after, afterEach, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { randomUUID } from 'node:crypto';

import { Client, Connection, WorkflowFailedError } from '@temporalio/client';
import { ApplicationFailure } from '@temporalio/common';
import { DefaultLogger, NativeConnection, Runtime, Worker, bundleWorkflowCode } from '@temporalio/worker';
import { cpuHostQueue, gpuCardQueue, VERSION } from 'gpulane';

import {
  FIXTURES,
  HERE,
  WORK,
  gpulaneVersion,
  hostName,
  minilmDir,
  sleep,
  startGpulane,
  startTemporal,
  stopAll,
} from './harness.mjs';

const require = createRequire(import.meta.url);
const PIN = 'gl-pin'; // two simulated cards and a CPU lane
const FULL = 'gl-full'; // one simulated card with no free memory, and a CPU lane

Runtime.install({ logger: new DefaultLogger('WARN') });

const env = {}; // filled by before()

function cosine(a, b) {
  let dot = 0;
  let na = 0;
  let nb = 0;
  for (let i = 0; i < a.length; i++) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return dot / Math.max(Math.sqrt(na * nb), 1e-12);
}

async function history(client, handle) {
  const h = await client.workflow.getHandle(handle.workflowId).fetchHistory();
  return h.events ?? [];
}

function run(ns, workflow, args, options = {}) {
  const { client, taskQueue } = env[ns];
  return client.workflow.start(workflow, {
    args,
    taskQueue,
    workflowId: `${workflow}-${randomUUID()}`,
    workflowExecutionTimeout: '3m',
    ...options,
  });
}

before(async () => {
  const t0 = Date.now();
  // The server, the bundle and the workers start together; the bundle is shared by all tests.
  const serverP = startTemporal([PIN, FULL]);
  const bundleP = bundleWorkflowCode({
    workflowsPath: path.join(HERE, 'all-workflows.ts'),
    logger: new DefaultLogger('WARN'),
    // examples/embed_session.ts finds the package here, as a user's project finds its own.
    webpackConfigHook: (config) => {
      config.resolve.modules = [...config.resolve.modules, path.join(HERE, 'node_modules')];
      return config;
    },
  });
  const server = await serverP;
  env.address = server.address;
  const model = minilmDir();
  const ce = path.join(FIXTURES, 'tiny-cross-encoder');
  const models = ['--model', `minilm=${model}`, '--model', `ce=${ce}`];
  const full = path.join(WORK, 'no-free-memory.json');
  fs.writeFileSync(full, JSON.stringify({ 0: 0 }));
  // A dataset for embed_dataset, under a data root the card workers may read and write.
  const data = path.join(WORK, 'data');
  fs.mkdirSync(data);
  env.dataset = { root: `file://${data}`, rows: 40 };
  fs.writeFileSync(path.join(data, 'corpus.jsonl'),
    Array.from({ length: 40 }, (_, i) => JSON.stringify({ id: `doc-${i}`, text: `dataset row ${i}` })).join('\n') + '\n');
  const dataRoot = ['--data-root', env.dataset.root];
  const hosts = { a: hostName('ts-a'), b: hostName('ts-b'), cpu: hostName('ts-cpu'), full: hostName('ts-full') };
  const common = { address: server.address };
  const [a, b, cpu, fullWorker] = await Promise.all([
    startGpulane({ ...common, namespace: PIN, host: hosts.a, name: 'a',
      args: [...models, ...dataRoot, '--simulate-gpus', '1x16GiB', '--simulated-id', 'a', '--cpu-lane', 'off'] }),
    startGpulane({ ...common, namespace: PIN, host: hosts.b, name: 'b',
      args: [...models, ...dataRoot, '--simulate-gpus', '1x16GiB', '--simulated-id', 'b', '--cpu-lane', 'off'] }),
    startGpulane({ ...common, namespace: PIN, host: hosts.cpu, name: 'cpu', args: [...models, '--gpus', 'none'] }),
    startGpulane({ ...common, namespace: FULL, host: hosts.full, name: 'full',
      args: ['--model', `minilm=${model}`, '--simulate-gpus', '1x16GiB', '--simulated-id', 'f',
        '--simulated-memory', full, '--memory-refresh-ms', '100', '--cpu-lane', 'on'] }),
  ]);
  env.gpulane = { a, b, cpu, full: fullWorker };
  env.cards = {
    [gpuCardQueue(hosts.a, 'GPU-SIM-a-0')]: a,
    [gpuCardQueue(hosts.b, 'GPU-SIM-b-0')]: b,
  };
  env.hosts = hosts;
  const t1 = Date.now();
  env.bundle = await bundleP;
  const t2 = Date.now();
  const connection = await NativeConnection.connect({ address: server.address });
  const clientConnection = await Connection.connect({ address: server.address });
  env.connections = [connection, clientConnection];
  env.workers = [];
  for (const ns of [PIN, FULL]) {
    const taskQueue = `wf-${randomUUID().slice(0, 8)}`;
    const worker = await Worker.create({ connection, namespace: ns, taskQueue, workflowBundle: env.bundle });
    env.workers.push({ worker, running: worker.run() });
    env[ns] = { client: new Client({ connection: clientConnection, namespace: ns }), taskQueue };
  }
  console.log(`# setup: server and 4 gpulane workers ${((t1 - t0) / 1000).toFixed(1)} s, ` +
    `bundle ready ${((t2 - t0) / 1000).toFixed(1)} s after start; logs in ${WORK}`);
});

let failed = false;
afterEach((t) => {
  if (t.passed === false) failed = true;
});

after(async () => {
  const t0 = Date.now();
  for (const { worker } of env.workers ?? []) worker.shutdown();
  await Promise.all((env.workers ?? []).map(({ running }) => running.catch(() => undefined)));
  for (const c of env.connections ?? []) await c.close();
  const t1 = Date.now();
  const exits = await stopAll();
  console.log(`# teardown: workflow workers ${((t1 - t0) / 1000).toFixed(1)} s, processes ${((Date.now() - t1) / 1000).toFixed(1)} s`);
  for (const { log, exit, killed } of exits) {
    console.log(`# ${path.basename(log)}: exit ${exit.code ?? exit.signal}${killed ? ' (killed after grace)' : ''}`);
  }
  // As in tests/integration: a worker told to stop drains and exits 0 (the one a test
  // killed aside).
  const bad = exits.filter(({ log, exit }) => !log.endsWith(`gpulane-${env.victim}.log`) && exit.code !== 0);
  if (bad.length) failed = true;
  // The logs stay when a test failed (or setup did), or with GPULANE_TEST_KEEP_LOGS=1.
  if (!failed && env.workers && !process.env.GPULANE_TEST_KEEP_LOGS) fs.rmSync(WORK, { recursive: true, force: true });
  else console.log(`# logs kept in ${WORK}`);
  assert.deepEqual(bad, [], 'processes that did not exit 0 on SIGTERM');
});

describe('the package', () => {
  test('is the one installed from the tarball in node_modules, and its version is the binary\'s', async () => {
    const nm = path.join(HERE, 'node_modules', 'gpulane');
    assert.equal(require.resolve('gpulane'), path.join(nm, 'dist', 'index.js'));
    assert.equal(require.resolve('gpulane/workflow'), path.join(nm, 'dist', 'workflow.js'));
    assert.equal(fs.lstatSync(nm).isSymbolicLink(), false, 'node_modules/gpulane is a link');
    assert.equal(fs.realpathSync(nm), nm);
    const lock = JSON.parse(fs.readFileSync(path.join(HERE, 'node_modules', '.package-lock.json'), 'utf8'));
    const entry = lock.packages['node_modules/gpulane'];
    assert.match(entry.resolved, /gpulane-[0-9.]+\.tgz$/, JSON.stringify(entry));
    // The tarball holds dist and the README only (npm adds package.json).
    assert.deepEqual(fs.readdirSync(nm).sort(), ['README.md', 'dist', 'package.json']);
    // The workflow bundle took it from node_modules too.
    assert.ok(env.bundle.code.includes('"./node_modules/gpulane/dist/workflow.js"'), 'bundle lacks node_modules/gpulane');
    for (const source of ['clients/typescript/dist/', 'clients/typescript/src/']) {
      assert.ok(!env.bundle.code.includes(source), `the bundle includes ${source}`);
    }

    const version = await gpulaneVersion();
    const pkg = JSON.parse(fs.readFileSync(path.join(nm, 'package.json'), 'utf8'));
    assert.equal(pkg.version, version);
    assert.equal(VERSION, version);
  });
});

describe('against gpulane workers', () => {
  test('embed and rerank results round-trip with their typed fields', async () => {
    const ref = JSON.parse(fs.readFileSync(path.join(FIXTURES, 'minilm', 'reference.json'), 'utf8'));
    const ce = JSON.parse(fs.readFileSync(path.join(FIXTURES, 'tiny-cross-encoder', 'reference.json'), 'utf8')).cases[0];
    const texts = ref.texts.slice(0, 3);
    const h = await run(PIN, 'roundTrip', [{ texts, query: ce.query, documents: ce.documents }]);
    const { embed, rerank, rerankDocs } = await h.result();

    assert.equal(embed.embeddings.length, 3);
    for (const v of embed.embeddings) assert.equal(v.length, 384);
    for (let i = 0; i < 3; i++) {
      const c = cosine(embed.embeddings[i], ref.embeddings[i]);
      assert.ok(c >= 0.9999, `text ${i}: cosine ${c}`);
    }
    assert.equal(embed.model, 'minilm');
    assert.match(embed.revision, /^sha256:[0-9a-f]+/);
    assert.equal(embed.dtype, 'f32');
    assert.equal(embed.family, 'bert');
    assert.equal(embed.dimensions, 384);
    assert.equal(embed.device.kind, 'gpu');
    assert.equal(embed.device.simulated, true);
    assert.equal(typeof embed.device.name, 'string');
    assert.ok(['GPU-SIM-a-0', 'GPU-SIM-b-0'].includes(embed.device.uuid), embed.device.uuid);
    assert.equal(embed.device.index, 0);
    assert.ok(embed.host_task_queue in env.cards, embed.host_task_queue);
    assert.equal(embed.usage.tokens, ref.token_counts.slice(0, 3).reduce((x, y) => x + y, 0));

    assert.equal(rerank.model, 'ce');
    assert.equal(rerank.results.length, ce.documents.length);
    for (let i = 1; i < rerank.results.length; i++) {
      assert.ok(rerank.results[i - 1].score >= rerank.results[i].score, 'not sorted by score');
    }
    assert.deepEqual(rerank.results.map((r) => r.index).sort((x, y) => x - y), ce.documents.map((_, i) => i));
    for (const r of rerank.results) {
      assert.ok(Math.abs(r.score - ce.scores[r.index]) <= 1e-4, `document ${r.index}: ${r.score} vs ${ce.scores[r.index]}`);
      assert.equal(r.document, undefined);
    }
    assert.match(rerank.revision, /^sha256:/);
    assert.equal(typeof rerank.dtype, 'string');
    assert.equal(typeof rerank.family, 'string');
    assert.ok(rerank.usage.tokens > 0);
    assert.ok(rerank.host_task_queue in env.cards, rerank.host_task_queue);
    assert.deepEqual(rerankDocs.results.map((r) => r.index), rerank.results.slice(0, 2).map((r) => r.index));
    for (const r of rerankDocs.results) assert.equal(r.document, ce.documents[r.index]);
  });

  test('bad input is the typed, non-retryable InvalidInput in the workflow; others pass through', async () => {
    const out = await (await run(PIN, 'badInputCaught', [])).result();
    assert.deepEqual(out.invalid, {
      ...out.invalid,
      name: 'InvalidInput',
      type: 'InvalidInput',
      nonRetryable: true,
      isInvalidInput: true,
      isGpulaneError: true,
      isApplicationFailure: true,
      isGpulaneFailure: true,
      isGpulaneFailureOtherType: false,
      causeIsActivityFailure: true,
      retryState: 'NON_RETRYABLE_FAILURE',
    });
    assert.match(out.invalid.message, /texts/);
    assert.deepEqual(out.timeout, { isActivityFailure: true, isGpulaneError: false, isScheduleToStartTimeout: true });
  });

  test('bad input left uncaught fails the workflow with InvalidInput after one attempt', async () => {
    const h = await run(PIN, 'badInputPropagates', [], { workflowExecutionTimeout: '30s' });
    const err = await h.result().then(
      () => assert.fail('the workflow completed'),
      (e) => e
    );
    assert.ok(err instanceof WorkflowFailedError, String(err));
    assert.ok(err.cause instanceof ApplicationFailure, String(err.cause));
    assert.equal(err.cause.type, 'InvalidInput');
    assert.equal(err.cause.nonRetryable, true);
    const events = await history(env[PIN].client, h);
    const started = events.filter((e) => e.activityTaskStartedEventAttributes);
    assert.equal(started.length, 1);
    assert.equal(started[0].activityTaskStartedEventAttributes.attempt, 1);
    assert.equal(events.filter((e) => e.activityTaskFailedEventAttributes).length, 1);
    assert.equal(events.filter((e) => e.workflowExecutionFailedEventAttributes).length, 1);
    assert.equal(events.filter((e) => e.workflowTaskFailedEventAttributes).length, 0);
  });

  test('a card session keeps 10 follow-up embeds on one card', async () => {
    const out = await (await run(PIN, 'sessionFollowUps', [10, {}])).result();
    assert.equal(out.results.length, 11);
    const queues = new Set(out.results.map((r) => r.host_task_queue));
    assert.equal(queues.size, 1, [...queues].join(', '));
    const [queue] = queues;
    assert.equal(out.pinnedQueue, queue);
    assert.match(queue, /^gpu-tools\.ts-[ab]-[0-9a-f]{8}\.gpu-sim-[ab]-0$/);
    assert.ok(queue in env.cards, queue);
    assert.equal(new Set(out.results.map((r) => r.device.uuid)).size, 1);
    for (const r of out.results) {
      assert.equal(r.device.kind, 'gpu');
      assert.equal(r.rows, 1);
      assert.equal(r.width, 384);
    }
  });

  test('with no card free, embed falls back to cpu-tools after its schedule-to-start budget', async () => {
    const t0 = Date.now();
    const h = await run(FULL, 'embedWithFallback', ['3s']);
    const out = await h.result();
    const elapsed = Date.now() - t0;
    assert.equal(out.result.device.kind, 'cpu');
    assert.equal(out.result.host_task_queue, cpuHostQueue(env.hosts.full));
    assert.equal(out.result.width, 384);
    assert.ok(elapsed >= 3000, `took ${elapsed} ms`);
    assert.ok(out.elapsedMs >= 3000, `took ${out.elapsedMs} ms in workflow time`);
    const events = await history(env[FULL].client, h);
    const queues = events
      .filter((e) => e.activityTaskScheduledEventAttributes)
      .map((e) => e.activityTaskScheduledEventAttributes.taskQueue.name);
    assert.deepEqual(queues, ['gpu-tools', 'cpu-tools']);
    const timedOut = events.filter((e) => e.activityTaskTimedOutEventAttributes);
    assert.equal(timedOut.length, 1);
  });

  test('examples/embed_session.ts embeds a document on one card', async () => {
    const chunks = ['one', 'two', 'three', 'four', 'five'];
    const out = await (await run(PIN, 'embedDocument', [chunks, 2])).result();
    assert.equal(out.vectors.length, 5);
    for (const v of out.vectors) {
      assert.equal(v.length, 384);
      assert.ok(Math.abs(Math.hypot(...v) - 1) < 1e-4);
    }
    assert.ok(out.card in env.cards, out.card);
    assert.equal(out.attempts, 1);
    assert.ok(out.tokens >= 15, String(out.tokens));
  });

  test('embedDatasetJob embeds a dataset in shards over the cards and returns the manifests', async () => {
    const { root, rows } = env.dataset;
    const request = { source: `${root}/corpus.jsonl`, id_column: 'id', text_column: 'text', output: `${root}/out/`, part_rows: 10 };
    const manifests = await (await run(PIN, 'embedDatasetJob', [{ request, shards: 2 }])).result();
    assert.equal(manifests.length, 2);
    assert.deepEqual(manifests.map((m) => [m.start, m.end, m.rows]), [[0, rows / 2, rows / 2], [rows / 2, rows, rows / 2]]);
    for (const m of manifests) {
      assert.equal(m.dimensions, 384);
      assert.equal(m.model, 'minilm');
      assert.equal(m.source, request.source);
      assert.equal(m.output, request.output);
      assert.equal(m.parts.length, 2);
      assert.equal(m.skipped_parts, 0);
      assert.ok(m.tokens > 0);
      for (const part of [...m.parts.map((p) => p.uri), m.manifest]) {
        assert.ok(fs.existsSync(new URL(part)), part);
      }
    }
    // A job with its own shard is refused by the workflow, typed.
    const bad = await run(PIN, 'embedDatasetJob', [{ request: { ...request, shard: { index: 0, count: 2 } }, shards: 2 }]);
    const err = await bad.result().then(() => assert.fail('completed'), (e) => e);
    assert.ok(err instanceof WorkflowFailedError);
    assert.equal(err.cause.type, 'InvalidInput');
    assert.equal(err.cause.nonRetryable, true);
    // So are a missing request and a timeout that is not a number of seconds, which
    // threw TypeErrors that failed the workflow task, retried forever.
    for (const [job, field] of [
      [{ shards: 2 }, 'request'],
      [{ request, shards: 2, heartbeat_timeout_s: '60' }, 'heartbeat_timeout_s'],
      [{ request, shards: 2, start_to_close_s: -1 }, 'start_to_close_s'],
      [{ request, shards: 2, task_queue: 7 }, 'task_queue'],
      [null, 'the job must be an object'],
    ]) {
      const h = await run(PIN, 'embedDatasetJob', [job], { workflowExecutionTimeout: '30s' });
      const e = await h.result().then(() => assert.fail('completed'), (x) => x);
      assert.ok(e instanceof WorkflowFailedError, String(e));
      assert.equal(e.cause.type, 'InvalidInput', field);
      assert.equal(e.cause.nonRetryable, true);
      assert.ok(e.cause.message.includes(field), e.cause.message);
    }
  });

  test('a lost card makes runInSession run the whole sequence again on the other card', async () => {
    const h = await run(PIN, 'sequenceInSession', [
      { calls: 10, sleepMs: 1000, session: { pinnedScheduleToStart: '3s', heartbeatTimeout: '5s', attempts: 2 } },
    ]);
    let progress;
    const deadline = Date.now() + 60_000;
    for (;;) {
      progress = await h.query('progress');
      if (progress.attempt === 1 && progress.done >= 3) break;
      assert.ok(progress.attempt <= 1, `attempt ${progress.attempt} before any card was lost`);
      assert.ok(Date.now() < deadline, `no progress: ${JSON.stringify(progress)}`);
      await sleep(100);
    }
    const pinned = progress.pinnedQueue;
    const victim = env.cards[pinned];
    assert.ok(victim, `pinned to ${pinned}, not a card queue`);
    env.victim = victim === env.gpulane.a ? 'a' : 'b';
    victim.kill('SIGKILL');
    await victim.exited;
    const other = Object.keys(env.cards).find((q) => q !== pinned);

    const out = await h.result();
    assert.equal(out.attempts, 2);
    assert.equal(out.queues.length, 10);
    assert.deepEqual(new Set(out.queues), new Set([other]));
    assert.equal(out.lost.length, 1);
    assert.equal(out.lost[0].attempt, 1);
    assert.ok(out.lost[0].done >= 3 && out.lost[0].done < 10, JSON.stringify(out.lost));
  });
});
