// The installed package against the contract the worker publishes: proto/gpulane.schema.json
// (generated from the Rust types). Payload interfaces are read from the package's type
// declarations with the TypeScript compiler; names and failure types from its exports.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

import * as gpulane from 'gpulane';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const ROOT = path.resolve(HERE, '..', '..', '..');
const SCHEMA = path.join(ROOT, 'proto', 'gpulane.schema.json');
const require = createRequire(import.meta.url);
const ts = require('typescript');

// Checked in, and kept current by the Rust tests: its absence is a failure, not a skip.
const schema = JSON.parse(fs.readFileSync(SCHEMA, 'utf8'));

/** Interface name → { field: optional } from the installed dist/index.d.ts. */
function declaredInterfaces() {
  const file = require.resolve('gpulane').replace(/\.js$/, '.d.ts');
  const src = ts.createSourceFile(file, fs.readFileSync(file, 'utf8'), ts.ScriptTarget.Latest, true);
  const out = {};
  const aliases = {};
  src.forEachChild((node) => {
    if (ts.isInterfaceDeclaration(node)) {
      out[node.name.text] = Object.fromEntries(
        node.members.filter(ts.isPropertySignature).map((m) => [m.name.getText(src), Boolean(m.questionToken)])
      );
    } else if (ts.isTypeAliasDeclaration(node) && ts.isUnionTypeNode(node.type)) {
      aliases[node.name.text] = node.type.types
        .filter((t) => ts.isLiteralTypeNode(t) && ts.isStringLiteral(t.literal))
        .map((t) => t.literal.text);
    }
  });
  return { interfaces: out, aliases };
}

test('every payload interface has the schema\'s fields, optional exactly where the schema does not require them', () => {
  const { interfaces, aliases } = declaredInterfaces();
  const objects = Object.entries(schema.$defs).filter(([, def]) => def.type === 'object' && def.properties);
  // DatasetProgress is what embed_dataset heartbeats, not a payload a workflow sends or gets.
  const payloads = objects.filter(([name]) => name !== 'DatasetProgress');
  assert.ok(payloads.length >= 12, payloads.map(([n]) => n).join());
  for (const [name, def] of payloads) {
    assert.ok(interfaces[name], `no interface ${name}`);
    const want = Object.fromEntries(
      Object.keys(def.properties).map((field) => [field, !(def.required ?? []).includes(field)])
    );
    assert.deepEqual(interfaces[name], want, name);
  }
  const kinds = schema.$defs.DeviceKind.oneOf?.map((v) => v.const) ?? schema.$defs.DeviceKind.enum;
  assert.deepEqual([...aliases.DeviceKind].sort(), [...kinds].sort());
});

test('activities, queues, names and failures are the schema\'s', () => {
  assert.equal(gpulane.VERSION, schema.version);
  assert.deepEqual(Object.values(gpulane.Activity).sort(), Object.keys(schema.activities).sort());
  const q = schema.queues;
  assert.equal(gpulane.GPU_TOOLS, q.gpu_tools);
  assert.equal(gpulane.CPU_TOOLS, q.cpu_tools);
  assert.equal(gpulane.QUEUE_PREFIX_SEPARATOR, q.queue_prefix_separator);
  assert.equal(gpulane.MODEL_QUEUE_SEPARATOR, q.model_queue_separator);
  assert.equal(gpulane.MODEL_NAME_MAX, q.model_name_max);
  for (const h of q.examples.hosts) {
    assert.equal(gpulane.sanitizeHost(h.host), h.sanitized, h.host);
    assert.equal(gpulane.gpuCardQueue(h.host, h.gpu_uuid), h.gpu_card_queue, h.host);
    assert.equal(gpulane.cpuHostQueue(h.host), h.cpu_host_queue, h.host);
  }
  for (const m of q.examples.model_names) assert.equal(gpulane.validModelName(m.name), m.valid, m.name);
  const mq = q.examples.model_queue;
  assert.equal(gpulane.modelQueue(mq.shared, mq.model), mq.queue);

  const types = Object.keys(schema.failures).sort();
  assert.deepEqual([...gpulane.WORKER_FAILURES].sort(), types);
  assert.deepEqual(
    Object.values(gpulane.Failure).filter((t) => t !== gpulane.CARD_LOST).sort(),
    types
  );
  assert.ok(!types.includes(gpulane.CARD_LOST), 'CardLost is ours, not the worker\'s');
  assert.deepEqual(
    [...gpulane.NON_RETRYABLE_FAILURES].sort(),
    types.filter((t) => !schema.failures[t].retried)
  );
  assert.deepEqual([...gpulane.RETRIED_FAILURES].sort(), types.filter((t) => schema.failures[t].retried));
});
