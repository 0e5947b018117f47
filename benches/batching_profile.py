"""Where a batched round's time goes (issue 14, item 2, "profile first"): 64 one-sentence
`embed` activities scheduled at once from one workflow on `cpu-tools` (the shape of
`benches/run.sh batching` with BENCH_FANOUT=1), timed from the workflow's own history and
from gpulane's /metrics, and the same round against the no-op worker (`null_worker.py`).

From the history (server timestamps): when the activities were scheduled, when each was
started (handed to a poll), when each completed, and when the workflow closed. From
/metrics over the round: forward passes (count, seconds, rows), the seconds activities
waited in the engine's queue, and the seconds activities spent in the worker.

    .venv/bin/python benches/batching_profile.py [--rounds 3] [--threads 2] [--activities 64]
"""

import argparse
import asyncio
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benches"))

from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.worker import Worker  # noqa: E402

from devserver import dev_server, free_port, model_dir  # noqa: E402
from load import BenchFanout  # noqa: E402

SERIES = {
    "batches": r'^gpulane_batches_total\{[^}]*\} (\S+)',
    "rows": r'^gpulane_batch_rows_total\{[^}]*\} (\S+)',
    "forward_s": r'^gpulane_batch_seconds_total\{[^}]*\} (\S+)',
    "queued_s": r'^gpulane_engine_queue_seconds_sum\{[^}]*\} (\S+)',
    "in_worker_s": r'^gpulane_activity_seconds_sum\{[^}]*activity_type="embed"[^}]*\} (\S+)',
}


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {k: sum(float(m) for m in re.findall(p, text, re.M)) for k, p in SERIES.items()}


async def timeline(handle):
    """Seconds from the workflow's start: scheduled, started and completed of each activity,
    and the close."""
    sched, started, done = {}, {}, {}
    t0 = close = None
    async for e in handle.fetch_history_events():
        t = e.event_time.ToDatetime().timestamp()
        if t0 is None:
            t0 = t
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            sched[e.event_id] = t - t0
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started[e.activity_task_started_event_attributes.scheduled_event_id] = t - t0
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            done[e.activity_task_completed_event_attributes.scheduled_event_id] = t - t0
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            close = t - t0
    ids = sorted(sched)
    return {
        "scheduled_last": max(sched.values()),
        "started_first": min(started.values()), "started_last": max(started.values()),
        "completed_first": min(done.values()), "completed_last": max(done.values()),
        "close": close,
        "wait_median": statistics.median(started[i] - sched[i] for i in ids),
        "run_median": statistics.median(done[i] - started[i] for i in ids),
        "run_max": max(done[i] - started[i] for i in ids),
    }


async def rounds(client, wf_queue, queue, texts, n, metrics_port=None):
    out = []
    batches = [[t] for t in texts]
    for r in range(n + 1):  # the first is a warm-up
        before = scrape(metrics_port) if metrics_port else None
        handle = await client.start_workflow(BenchFanout.run, args=[queue, batches],
                                             id=f"prof-{uuid.uuid4().hex}", task_queue=wf_queue)
        await handle.result()
        row = await timeline(handle)
        if metrics_port:
            after = scrape(metrics_port)
            row.update({k: after[k] - before[k] for k in SERIES})
        if r:
            out.append(row)
            print(f"  {queue} round {r}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                flush=True)
    return {k: statistics.median(x[k] for x in out) for k in out[0]}


def wait_for(path, line, proc):
    while line not in open(path).read():
        if proc.poll() is not None:
            raise RuntimeError(open(path).read())
        time.sleep(0.1)


async def main(args):
    model = model_dir()
    corpus = ROOT / "benches/out/corpus-short.txt"
    lines = (corpus.read_text().splitlines() if corpus.exists() else
             [f"sentence {i} about the quick brown fox and the lazy dog" for i in range(64)])
    texts = lines[:args.activities]
    procs = []
    async with dev_server() as (client, address, tmp):
        try:
            wf_queue = f"wf-{uuid.uuid4().hex[:8]}"
            async with Worker(client, task_queue=wf_queue, workflows=[BenchFanout]):
                metrics = free_port()
                env = {**os.environ, "TEMPORAL_ADDRESS": address, "GPULANE_HOST": "prof",
                       "GPULANE_METRICS_ADDRESS": f"127.0.0.1:{metrics}",
                       "GPULANE_ADMIN_ADDRESS": "off", "GPULANE_CPU_THREADS": str(args.threads)}
                g = subprocess.Popen(
                    [str(ROOT / "target/release/gpulane"), "run", "--model", model, "--gpus",
                     "none", "--max-concurrent-cpu", "64", *args.gpulane.split()],
                    stdout=open(f"{tmp}/g.log", "w"), stderr=subprocess.STDOUT, env=env)
                procs.append(g)
                wait_for(f"{tmp}/g.log", "gpulane ready", g)
                gm = await rounds(client, wf_queue, "cpu-tools", texts, args.rounds, metrics)
                g.terminate()
                g.wait(60)
                nq = f"null-{uuid.uuid4().hex[:6]}"
                n = subprocess.Popen([sys.executable, str(ROOT / "benches/null_worker.py"),
                                      "--task-queue", nq, "--address", address],
                                     stdout=open(f"{tmp}/n.log", "w"), stderr=subprocess.STDOUT)
                procs.append(n)
                wait_for(f"{tmp}/n.log", "null_worker ready", n)
                nm = await rounds(client, wf_queue, nq, texts, args.rounds)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
    print(f"\nmedians of {args.rounds} rounds, {args.activities} one-sentence activities, "
          f"seconds from the workflow's start:")
    for k in ("scheduled_last", "started_first", "started_last", "completed_first",
              "completed_last", "close", "wait_median", "run_median", "run_max"):
        print(f"  {k:16} gpulane {gm[k]:7.3f}   no-op {nm[k]:7.3f}")
    for k in SERIES:
        print(f"  {k:16} gpulane {gm[k]:7.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activities", type=int, default=64)
    ap.add_argument("--gpulane", default="", help="extra `gpulane run` flags, one string: --gpulane=\"--pollers 8\"")
    asyncio.run(main(ap.parse_args()))
