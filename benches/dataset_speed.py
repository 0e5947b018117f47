"""Bulk embedding speed: gpulane's `embed_dataset` against sentence-transformers in a
Python loop, both reading the same Parquet dataset and writing Parquet parts.

- `make`: the dataset, N rows (`id` int64 0..N-1, `text` the corpus's lines in turn), one
  Parquet file in row groups of 10,000.
- `gpulane`: one `embed_dataset` (or --shards of them at once) on a task queue of a running
  dev server and `gpulane run` (benches/run.sh starts both, the worker with
  `--data-root` on the dataset's folder and RAYON_NUM_THREADS=threads); the time runs from
  the workflow's start to its result, so it includes Temporal's part (dispatch, heartbeats)
  as a user pays it. One small `embed` first, untimed, warms the worker.
- `st`: the peer, the way one would write it by hand: pyarrow reads the file in chunks of
  --part-rows, `SentenceTransformer.encode` (batch 32, same threads) embeds each, token
  counts come from the model's tokenizer (gpulane writes them too), and each chunk is
  written as a Parquet part of the same schema (id, embedding fixed_size_list<float32>,
  tokens int32). The model is loaded and warmed before the clock starts.
- `summary`: the two reports side by side, markdown, with the ratio (gpulane ÷ peer).

Reports (JSON): {"side", "rows", "tokens", "seconds", "rows_per_s", "tokens_per_s",
"part_rows", "parts", "threads" | "shards", "versions"}.
"""

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time
import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy


@workflow.defn
class BenchDataset:
    """The dataset job: one `embed_dataset`, or `shards` of them at once."""

    @workflow.run
    async def run(self, request: dict, shards: int, queue: str) -> list:
        def one(extra):
            return workflow.execute_activity(
                "embed_dataset", {**request, **extra}, task_queue=queue,
                start_to_close_timeout=timedelta(hours=2), heartbeat_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )

        if shards == 1:
            return [await one({})]
        return list(await asyncio.gather(*(one({"shard": {"index": i, "count": shards}}) for i in range(shards))))


@workflow.defn
class BenchWarm:
    """One small `embed`, untimed, so the worker's first-call costs stay out of the time."""

    @workflow.run
    async def run(self, queue: str) -> int:
        out = await workflow.execute_activity(
            "embed", {"texts": ["warm up"] * 32}, task_queue=queue,
            start_to_close_timeout=timedelta(seconds=120),
        )
        return len(out["embeddings"])


def make(args):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [l.rstrip("\n") for l in open(args.corpus, encoding="utf-8") if l.strip()]
    texts = [lines[i % len(lines)] for i in range(args.rows)]
    table = pa.table({"id": pa.array(range(args.rows), pa.int64()), "text": pa.array(texts, pa.string())})
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out, row_group_size=10_000)
    print(f"wrote {out}: {args.rows} rows from {len(lines)} corpus lines", file=sys.stderr)


def bench_gpulane(args):
    from temporalio.client import Client
    from temporalio.worker import Worker

    async def go():
        client = await Client.connect(args.address)
        wf_queue = f"bench-dataset-{uuid.uuid4().hex[:8]}"
        async with Worker(client, task_queue=wf_queue, workflows=[BenchDataset, BenchWarm]):
            await client.execute_workflow(BenchWarm.run, args.queue, id=f"warm-{uuid.uuid4()}",
                                          task_queue=wf_queue, execution_timeout=timedelta(minutes=5))
            request = {"source": args.source, "id_column": "id", "text_column": "text",
                       "output": args.output, "part_rows": args.part_rows}
            t0 = time.perf_counter()
            manifests = await client.execute_workflow(
                BenchDataset.run, args=[request, args.shards, args.queue], id=f"dataset-{uuid.uuid4()}",
                task_queue=wf_queue, execution_timeout=timedelta(hours=2),
            )
            return manifests, time.perf_counter() - t0

    manifests, seconds = asyncio.run(go())
    rows = sum(m["rows"] for m in manifests)
    tokens = sum(m["tokens"] for m in manifests)
    report = {
        "side": "gpulane", "rows": rows, "tokens": tokens, "seconds": seconds,
        "rows_per_s": rows / seconds, "tokens_per_s": tokens / seconds,
        "part_rows": args.part_rows, "parts": sum(len(m["parts"]) for m in manifests),
        "shards": args.shards, "queue": args.queue,
        "model": manifests[0]["model"], "dtype": manifests[0]["dtype"],
    }
    finish(report, args.json)


def bench_st(args):
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    import importlib.metadata as md

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentence_transformers
    import torch

    torch.set_num_threads(args.threads)
    model = sentence_transformers.SentenceTransformer(args.model, device="cpu")
    model.encode(["warm up"] * args.batch_rows, batch_size=args.batch_rows)
    out_dir = pathlib.Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part-*.parquet"):
        old.unlink()

    tokenize = getattr(model, "preprocess", None) or model.tokenize  # `tokenize` before 6.x
    rows = tokens = parts = 0
    dims = None
    t0 = time.perf_counter()
    source = pq.ParquetFile(args.source)
    start = 0
    for batch in source.iter_batches(batch_size=args.part_rows, columns=["id", "text"]):
        texts = batch.column("text").to_pylist()
        vectors = model.encode(texts, batch_size=args.batch_rows, convert_to_numpy=True)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        dims = vectors.shape[1]
        counts = tokenize(texts)["attention_mask"].sum(dim=1).to(torch.int32).numpy()
        table = pa.table({
            "id": batch.column("id"),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dims),
            "tokens": pa.array(counts, pa.int32()),
        })
        end = start + len(texts)
        pq.write_table(table, out_dir / f"part-{start:09d}-{end:09d}.parquet")
        rows += len(texts)
        tokens += int(counts.sum())
        parts += 1
        start = end
    seconds = time.perf_counter() - t0
    report = {
        "side": "sentence-transformers", "rows": rows, "tokens": tokens, "seconds": seconds,
        "rows_per_s": rows / seconds, "tokens_per_s": tokens / seconds,
        "part_rows": args.part_rows, "parts": parts, "threads": args.threads,
        "batch_rows": args.batch_rows, "dimensions": dims,
        "versions": ", ".join(f"{p} {md.version(p)}" for p in ("sentence-transformers", "torch", "pyarrow")),
    }
    finish(report, args.json)


def finish(report, path):
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        pathlib.Path(path).write_text(text + "\n")


def summary(args):
    out = pathlib.Path(args.out_dir)

    def load(name):
        try:
            return json.loads((out / name).read_text())
        except (OSError, ValueError):
            return None

    gl, st = load("dataset-gpulane.json"), load("dataset-st.json")
    lines = ["## Bulk embedding: `embed_dataset` vs sentence-transformers in a loop", ""]
    if gl is None and st is None:
        skipped = out / "dataset-skipped.txt"
        lines.append(skipped.read_text().strip() if skipped.exists() else "not run")
    else:
        lines += ["| side | rows | tokens | seconds | rows/s | tokens/s |", "|---|---|---|---|---|---|"]
        for r, label in ((gl, "gpulane `embed_dataset` (Temporal, CPU lane)"), (st, "sentence-transformers loop")):
            if r is None:
                lines.append(f"| {label} | not run | | | | |")
            else:
                lines.append(f"| {label} | {r['rows']:,} | {r['tokens']:,} | {r['seconds']:.1f} | "
                             f"{r['rows_per_s']:.0f} | {r['tokens_per_s']:,.0f} |")
        if gl and st:
            lines += ["", f"gpulane ÷ peer (rows/s): **{gl['rows_per_s'] / st['rows_per_s']:.2f}×**"]
    text = "\n".join(lines) + "\n"
    (out / "dataset-summary.md").write_text(text)
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the dataset")
    m.add_argument("--corpus", required=True)
    m.add_argument("--rows", type=int, default=100_000)
    m.add_argument("--out", required=True, help="a .parquet path")
    g = sub.add_parser("gpulane", help="time embed_dataset through Temporal")
    g.add_argument("--address", required=True)
    g.add_argument("--queue", default="cpu-tools")
    g.add_argument("--source", required=True, help="the dataset's URI (file://...)")
    g.add_argument("--output", required=True, help="the output prefix URI")
    g.add_argument("--part-rows", type=int, default=1000)
    g.add_argument("--shards", type=int, default=1)
    g.add_argument("--json")
    s = sub.add_parser("st", help="time the sentence-transformers loop")
    s.add_argument("--model", required=True)
    s.add_argument("--source", required=True, help="the dataset's path")
    s.add_argument("--output-dir", required=True)
    s.add_argument("--part-rows", type=int, default=1000)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--batch-rows", type=int, default=32)
    s.add_argument("--json")
    r = sub.add_parser("summary", help="markdown of the two reports")
    r.add_argument("out_dir")
    args = ap.parse_args()
    {"make": make, "gpulane": bench_gpulane, "st": bench_st, "summary": summary}[args.cmd](args)


if __name__ == "__main__":
    main()
