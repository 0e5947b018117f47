// The installed package's pure parts, without a server: names as the Rust code makes them
// (proto/src/names.rs and its tests), constants, and the typed-failure mapping.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import * as root from 'gpulane';
import {
  Activity,
  CARD_LOST,
  CPU_TOOLS,
  Failure,
  GPU_TOOLS,
  MODEL_NAME_MAX,
  MODEL_QUEUE_SEPARATOR,
  NON_RETRYABLE_FAILURES,
  QUEUE_PREFIX_SEPARATOR,
  cpuHostQueue,
  gpuCardQueue,
  modelQueue,
  sanitizeHost,
  validModelName,
} from 'gpulane';
import * as wf from 'gpulane/workflow';
import { ActivityFailure, ApplicationFailure, TimeoutFailure } from '@temporalio/common';

const HERE = path.dirname(fileURLToPath(import.meta.url));

test('constants are the worker\'s', () => {
  assert.equal(GPU_TOOLS, 'gpu-tools');
  assert.equal(CPU_TOOLS, 'cpu-tools');
  assert.equal(QUEUE_PREFIX_SEPARATOR, '.');
  assert.equal(MODEL_QUEUE_SEPARATOR, '@');
  assert.equal(MODEL_NAME_MAX, 64);
  assert.deepEqual({ ...Activity }, { EMBED: 'embed', RERANK: 'rerank', EMBED_DATASET: 'embed_dataset' });
  assert.deepEqual({ ...Failure }, {
    INVALID_INPUT: 'InvalidInput',
    UNKNOWN_MODEL: 'UnknownModel',
    TEXT_TOO_LONG: 'TextTooLong',
    RESULT_TOO_LARGE: 'ResultTooLarge',
    NON_FINITE_OUTPUT: 'NonFiniteOutput',
    UNKNOWN_ACTIVITY: 'UnknownActivity',
    GPU_OUT_OF_MEMORY: 'GpuOutOfMemory',
    MODEL_FAILURE: 'ModelFailure',
    MODEL_NOT_SERVED: 'ModelNotServed',
    WORKER_SHUTDOWN: 'WorkerShutdown',
    INTERNAL_ERROR: 'InternalError',
    STORAGE_UNAVAILABLE: 'StorageUnavailable',
    CARD_LOST: 'CardLost',
  });
  assert.equal(CARD_LOST, 'CardLost');
  assert.deepEqual([...NON_RETRYABLE_FAILURES].sort(),
    ['InvalidInput', 'NonFiniteOutput', 'ResultTooLarge', 'TextTooLong', 'UnknownActivity', 'UnknownModel']);
  assert.deepEqual([...root.RETRIED_FAILURES].sort(),
    ['GpuOutOfMemory', 'InternalError', 'ModelFailure', 'ModelNotServed', 'StorageUnavailable', 'WorkerShutdown']);
  assert.deepEqual([...root.WORKER_FAILURES].sort(), [...NON_RETRYABLE_FAILURES, ...root.RETRIED_FAILURES].sort());
});

test('the root entry loads nothing else (no workflow API), the workflow entry loads the SDK', () => {
  const loaded = (entry) => JSON.parse(execFileSync(process.execPath, ['-e',
    `require(${JSON.stringify(entry)}); console.log(JSON.stringify(Object.keys(require.cache)))`],
  { cwd: HERE, encoding: 'utf8' }));
  const rootFiles = loaded('gpulane');
  assert.deepEqual(rootFiles.map((p) => path.relative(HERE, p)), [path.join('node_modules', 'gpulane', 'dist', 'index.js')]);
  assert.ok(loaded('gpulane/workflow').some((p) => p.includes(path.join('@temporalio', 'workflow'))));
});

test('queue names follow names.rs (its unit tests, and the Rust string rules)', () => {
  assert.equal(gpuCardQueue('box-1', 'GPU-8f3a2c1e-0000-1111-2222-333344445555'),
    'gpu-tools.box-1.gpu-8f3a2c1e-0000-1111-2222-333344445555');
  assert.equal(sanitizeHost('GPU-Box.example.com'), 'gpu-box-example-com');
  assert.equal(cpuHostQueue('a.b'), 'cpu-tools.a-b');
  assert.equal(sanitizeHost('  '), 'unknown-host');
  assert.equal(sanitizeHost(''), 'unknown-host');
  assert.equal(modelQueue(GPU_TOOLS, 'e5-small'), 'gpu-tools@e5-small');
  assert.equal(modelQueue(CPU_TOOLS, 'bge.v1'), 'cpu-tools@bge.v1');
  const a = gpuCardQueue('h', 'GPU-aaaa');
  assert.notEqual(a, gpuCardQueue('h', 'GPU-bbbb'));
  assert.ok(a.startsWith('gpu-tools.h.'));
  // Rust's trim() is Unicode White_Space: U+0085 and U+3000 go, U+FEFF (not whitespace) stays.
  assert.equal(sanitizeHost('\u0085\u3000Host\t\n'), 'host');
  assert.equal(sanitizeHost('\uFEFFhost'), '-host');
  // to_ascii_lowercase: only A-Z; the Kelvin sign is not a k, and an emoji is one character.
  assert.equal(sanitizeHost('\u212Aelvin'), '-elvin');
  assert.equal(sanitizeHost('İx'), '-x');
  assert.equal(sanitizeHost('a😀b'), 'a-b');
  assert.equal(sanitizeHost('My_Host:8080'), 'my-host-8080');
  assert.equal(gpuCardQueue(' Box ', ' GPU-AB\u212A '), 'gpu-tools.box.gpu-ab\u212A');
});

test('model names follow valid_model_name', () => {
  for (const ok of ['all-MiniLM-L6-v2', 'e5_small', 'bge.v1.5', 'm', 'm'.repeat(64)]) {
    assert.ok(validModelName(ok), ok);
  }
  for (const bad of ['', 'a b', 'org/name', 'x\n', 'q"uote', 'a@b', 'm'.repeat(65), 'é', 'ｍ']) {
    assert.ok(!validModelName(bad), JSON.stringify(bad));
  }
});

test('an activity\'s gpulane failure becomes its typed ApplicationFailure; anything else passes through', () => {
  const cause = new ApplicationFailure('texts must not be empty', 'InvalidInput', true, ['detail']);
  const activity = new ActivityFailure('Activity task failed', 'embed', '1', 'NON_RETRYABLE_FAILURE', 'gpulane@x', cause);
  const typed = wf.asGpulaneError(activity);
  assert.ok(typed instanceof wf.InvalidInput);
  assert.ok(typed instanceof wf.GpulaneError);
  assert.ok(typed instanceof ApplicationFailure);
  assert.ok(!(typed instanceof wf.TextTooLong));
  assert.ok(!(typed instanceof ActivityFailure));
  assert.equal(typed.type, 'InvalidInput');
  assert.equal(typed.message, 'texts must not be empty');
  assert.equal(typed.nonRetryable, true);
  assert.deepEqual(typed.details, ['detail']);
  assert.equal(typed.cause, activity);
  assert.equal(typed.name, 'InvalidInput');
  assert.ok(wf.isGpulaneFailure(typed, Failure.INVALID_INPUT));
  assert.ok(wf.isGpulaneFailure(activity, Failure.INVALID_INPUT));
  assert.ok(!wf.isGpulaneFailure(activity, Failure.UNKNOWN_MODEL));

  // A retryable type stays retryable.
  const oom = wf.asGpulaneError(new ActivityFailure('x', 'embed', '1', 'MAXIMUM_ATTEMPTS_REACHED', 'i',
    new ApplicationFailure('out of memory', 'GpuOutOfMemory', false)));
  assert.ok(oom instanceof wf.GpuOutOfMemory);
  assert.equal(oom.nonRetryable, false);

  // Every type has its class.
  for (const type of Object.values(Failure)) {
    const e = wf.asGpulaneError(new ActivityFailure('x', 'embed', '1', 'NON_RETRYABLE_FAILURE', 'i',
      new ApplicationFailure('m', type, false)));
    assert.ok(e instanceof wf.FAILURE_CLASSES[type], type);
    assert.equal(e.name, type);
    assert.equal(e.type, type);
  }

  // Not ours: unchanged.
  const other = new ActivityFailure('x', 'embed', '1', 'NON_RETRYABLE_FAILURE', 'i',
    new ApplicationFailure('m', 'SomethingElse', true));
  assert.equal(wf.asGpulaneError(other), other);
  const timeout = new ActivityFailure('x', 'embed', '1', 'TIMEOUT', 'i',
    new TimeoutFailure('t', undefined, 'SCHEDULE_TO_START'));
  assert.equal(wf.asGpulaneError(timeout), timeout);
  assert.ok(wf.isScheduleToStartTimeout(timeout));
  assert.ok(!wf.isScheduleToStartTimeout(new ActivityFailure('x', 'embed', '1', 'TIMEOUT', 'i',
    new TimeoutFailure('t', undefined, 'START_TO_CLOSE'))));
  const plain = new Error('plain');
  assert.equal(wf.asGpulaneError(plain), plain);

  // typedError: the typed error or undefined (Python's typed_error); BY_TYPE is FAILURE_CLASSES.
  assert.ok(wf.typedError(activity) instanceof wf.InvalidInput);
  assert.equal(wf.typedError(typed), typed);
  assert.equal(wf.typedError(timeout), undefined);
  assert.equal(wf.typedError(plain), undefined);
  assert.equal(wf.BY_TYPE, wf.FAILURE_CLASSES);

  // CardLost is retryable, and recognised by type too.
  const lost = new wf.CardLost('gone');
  assert.equal(lost.nonRetryable, false);
  assert.ok(wf.isCardLost(lost));
  assert.ok(wf.isCardLost(ApplicationFailure.retryable('gone', 'CardLost')));
  assert.ok(!wf.isCardLost(ApplicationFailure.retryable('gone', 'Other')));
});

test('gpulane/workflow re-exports the root entry', () => {
  const names = Object.keys(root).filter((n) => n !== 'default' && n !== 'module.exports');
  assert.ok(names.includes('sanitizeHost') && names.includes('VERSION'), names.join());
  for (const name of names) assert.equal(wf[name], root[name], name);
});
