"""What one `embed_dataset` activity holds of its source: the worker's peak resident memory
(VmHWM) and the activity's time, for a job over a small range of a large Parquet file, by
binary. A shard of a big file is the case: before 4e20214 every shard read the whole
file; since, a Parquet shard reads the footer, every id, and its own rows' texts, and
since ddc1a6f a JSON Lines or CSV shard holds every id and its own rows' texts.

Makes the file (N rows: id int64, text `row <i>: ` plus filler to --chars characters;
Parquet in row groups of 10,000, zstd, or --format jsonl), starts its own dev server and, per binary and round, a fresh
worker (CPU lane, --data-root on the file's folder); rounds alternate the binaries. Each
round: the worker's RSS once ready and warmed by one small `embed`, then one
`embed_dataset` of rows [N/2, N/2 + --range) and the worker's VmHWM after it (reset
through /proc/PID/clear_refs before the job, so the peak is the job's).

With --jobs K, K jobs of --range rows each (consecutive ranges from N/2) start at once on
the one worker, and the peak and time are the K jobs' together: since 53032bd the worker's
jobs share --max-dataset-bytes (--limit), where before each held up to it alone.

    .venv/bin/python benches/dataset_memory.py --bin A --bin B [--rows 200000] \
        [--chars 1000] [--range 64] [--rounds 2] [--format parquet|jsonl] [--jobs 1] \
        [--limit BYTES] [--json out.json]
"""

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time
import uuid
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benches"))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from temporalio import workflow  # noqa: E402
from temporalio.common import RetryPolicy  # noqa: E402
from temporalio.worker import UnsandboxedWorkflowRunner, Worker  # noqa: E402

from devserver import dev_server, model_dir, rss_mib  # noqa: E402


@workflow.defn
class MemDataset:
    @workflow.run
    async def run(self, request: dict) -> dict:
        return await workflow.execute_activity(
            "embed_dataset", request, task_queue="cpu-tools",
            start_to_close_timeout=timedelta(minutes=30), heartbeat_timeout=timedelta(seconds=120),
            retry_policy=RetryPolicy(maximum_attempts=1))


@workflow.defn
class MemWarm:
    @workflow.run
    async def run(self) -> int:
        out = await workflow.execute_activity(
            "embed", {"texts": ["warm up"]}, task_queue="cpu-tools",
            start_to_close_timeout=timedelta(minutes=2))
        return out["dimensions"]


def hwm_mib(pid: int) -> float:
    """A process's peak resident memory so far (VmHWM), in MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make(path: pathlib.Path, rows: int, chars: int):
    filler = "the lane keeps its cards busy while the queue is long " * (chars // 50 + 1)
    if path.suffix == ".jsonl":
        with open(path, "w") as f:
            for i in range(rows):
                f.write(json.dumps({"id": i, "text": (f"row {i}: " + filler)[:chars]}) + "\n")
        return
    writer = None
    for start in range(0, rows, 10_000):
        ids = list(range(start, min(start + 10_000, rows)))
        texts = [(f"row {i}: " + filler)[:chars] for i in ids]
        t = pa.table({"id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())})
        if writer is None:
            writer = pq.ParquetWriter(path, t.schema, compression="zstd")
        writer.write_table(t, row_group_size=10_000)
    writer.close()


async def one_round(client, address, tmp, binary, data_dir, requests, wf_queue, extra):
    log_path = f"{tmp}/gpulane-{uuid.uuid4().hex[:6]}.log"
    env = {**os.environ, "TEMPORAL_ADDRESS": address, "GPULANE_HOST": "mem",
           "GPULANE_METRICS_ADDRESS": "off", "GPULANE_ADMIN_ADDRESS": "off"}
    worker = subprocess.Popen(
        [binary, "run", "--model", model_dir(), "--gpus", "none", "--data-root", f"file://{data_dir}/", *extra],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        while "gpulane ready" not in open(log_path).read():
            if worker.poll() is not None:
                raise RuntimeError(f"{binary} exited: {open(log_path).read()[-2000:]}")
            await asyncio.sleep(0.1)
        await client.execute_workflow(MemWarm.run, id=f"warm-{uuid.uuid4()}", task_queue=wf_queue)
        ready = rss_mib(worker.pid)
        # Resets VmHWM to the RSS now, so the peak is the job's, not start-up's or the warm call's.
        with open(f"/proc/{worker.pid}/clear_refs", "w") as f:
            f.write("5")
        before = hwm_mib(worker.pid)
        t0 = time.monotonic()
        manifests = await asyncio.gather(*(client.execute_workflow(
            MemDataset.run, {**request, "output": request["output"] + uuid.uuid4().hex[:8] + "/"},
            id=f"mem-{uuid.uuid4()}", task_queue=wf_queue) for request in requests))
        took = time.monotonic() - t0
        return {"rss_ready_mib": ready, "hwm_reset_mib": before, "hwm_mib": hwm_mib(worker.pid), "seconds": took,
                "rows": sum(m["rows"] for m in manifests)}
    finally:
        worker.terminate()
        worker.wait(30)


async def main(args):
    async with dev_server() as (client, address, tmp):
        data_dir = pathlib.Path(tmp) / "data"
        data_dir.mkdir()
        source = data_dir / f"big.{args.format}"
        make(source, args.rows, args.chars)
        size = source.stat().st_size
        print(f"file: {args.format}, {args.rows} rows of {args.chars} characters, {size} bytes stored",
              flush=True)
        start = args.rows // 2
        requests = [{"source": f"file://{source}", "id_column": "id", "text_column": "text",
                     "output": f"file://{data_dir}/out/",
                     "rows": {"start": start + j * args.range, "end": start + (j + 1) * args.range}}
                    for j in range(args.jobs)]
        extra = ["--max-dataset-bytes", str(args.limit)] if args.limit else []
        # A row of more characters than the default per-text limit is still one row.
        extra += ["--max-text-chars", str(max(args.chars, 100_000))]
        wf_queue = f"mem-{uuid.uuid4().hex[:6]}"
        results = []
        # Unsandboxed: this module imports pyarrow, which the sandbox refuses to re-import.
        async with Worker(client, task_queue=wf_queue, workflows=[MemDataset, MemWarm],
                          workflow_runner=UnsandboxedWorkflowRunner()):
            for r in range(args.rounds):
                for binary in args.bin:
                    got = await one_round(client, address, tmp, binary, data_dir, requests, wf_queue, extra)
                    got.update(round=r, binary=binary)
                    print(json.dumps(got), flush=True)
                    results.append(got)
        report = {"format": args.format, "rows": args.rows, "chars": args.chars, "range": args.range, "jobs": args.jobs,
                  "limit": args.limit, "stored_bytes": size, "results": results}
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        print("\n| binary | round | RSS ready (MiB) | peak (MiB) | peak − ready | seconds |")
        print("|---|---|---|---|---|---|")
        for g in results:
            print(f"| {pathlib.Path(g['binary']).name} | {g['round']} | {g['rss_ready_mib']:.0f} | "
                  f"{g['hwm_mib']:.0f} | {g['hwm_mib'] - g['rss_ready_mib']:.0f} | {g['seconds']:.2f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", action="append", required=True, help="a gpulane binary (repeat to compare)")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--chars", type=int, default=1000)
    p.add_argument("--range", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    p.add_argument("--jobs", type=int, default=1, help="jobs at once, over consecutive ranges")
    p.add_argument("--limit", help="--max-dataset-bytes for the worker (its default if unset)")
    p.add_argument("--json")
    asyncio.run(main(p.parse_args()))
