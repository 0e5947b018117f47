"""Model speed of the peer: sentence-transformers on PyTorch, CPU, float32.

The counterpart of `gpulane bench`: the same corpus file, the same number of threads,
batches of 32 texts, one `encode` call over the whole corpus per run (sentence-transformers
sorts texts by length itself before batching, as gpulane does), one warm-up run, the
median of N timed runs. Tokens are counted as gpulane counts them: per text, special
tokens included, after truncation at the model's max_seq_length (256 for MiniLM).

Writes the same JSON shape as `gpulane bench --json`, with a "peer" field naming versions:
{"model", "threads", "peer", "results": [{"device": "cpu", "dtype": "f32", "batch_rows",
 "texts", "tokens", "seconds": [...], "seconds_median", "texts_per_s", "tokens_per_s"}]}
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a sentence-transformers model directory")
    ap.add_argument("--corpus", required=True, help="a text file, one text per line")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--batch-rows", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--dump", help="write the last run's vectors here, one JSON list per line")
    args = ap.parse_args()

    # Before torch starts its OpenMP pool, so MKL and OpenMP agree with set_num_threads.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    import sentence_transformers
    import torch

    torch.set_num_threads(args.threads)
    model = sentence_transformers.SentenceTransformer(args.model, device="cpu")
    texts = [line for line in pathlib.Path(args.corpus).read_text().split("\n") if line]

    # Token count as gpulane reports it: specials included, truncated to max_seq_length.
    enc = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)
    tokens = sum(len(ids) for ids in enc["input_ids"])

    last = []

    def run():
        start = time.perf_counter()
        out = model.encode(texts, batch_size=args.batch_rows, convert_to_numpy=True,
                           show_progress_bar=False)
        seconds = time.perf_counter() - start
        assert out.shape[0] == len(texts), "one vector per text; this is a bug"
        last[:] = [out]
        return seconds

    for _ in range(args.warmup):
        run()
    seconds = [run() for _ in range(args.repeat)]
    median = statistics.median(seconds)
    result = {
        "model": pathlib.Path(args.model).name,
        "threads": torch.get_num_threads(),
        # What ATEN_CPU_CAPABILITY left PyTorch's own kernels (BENCH_CPU_ISA caps it).
        "cpu_isa": torch.backends.cpu.get_cpu_capability().lower(),
        "peer": f"sentence-transformers {sentence_transformers.__version__} / torch {torch.__version__}",
        "results": [{
            "device": "cpu",
            "dtype": "f32",
            "batch_rows": args.batch_rows,
            "texts": len(texts),
            "tokens": tokens,
            "seconds": [round(s, 4) for s in seconds],
            "seconds_median": round(median, 4),
            "texts_per_s": round(len(texts) / median, 2),
            "tokens_per_s": round(tokens / median, 1),
        }],
    }
    if args.dump:
        with open(args.dump, "w") as f:
            for v in last[0]:
                f.write(json.dumps([float(x) for x in v]) + "\n")
    text = json.dumps(result)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
