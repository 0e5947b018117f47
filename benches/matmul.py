"""The peer's side of `models/examples/gemm_probe.rs`: the same f32 products of MiniLM's
dense layers through PyTorch's `linear` (MKL on x86 in the PyPI wheel), alone, GFLOP/s
per shape. Run it with the bench venv: .venv-bench/bin/python benches/matmul.py [--threads 2]
"""

import argparse
import time

import torch

SHAPES = [(8192, 384, 1152), (8192, 384, 384), (8192, 384, 1536), (8192, 1536, 384),
          (800, 384, 1152), (800, 1536, 384)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for m, k, n in SHAPES:
        a, w = torch.full((m, k), 0.5), torch.full((n, k), 0.25)
        torch.nn.functional.linear(a, w)
        reps = 10
        start = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(a, w)
        s = (time.perf_counter() - start) / reps
        print(f"{m} x {k} x {n}: {s * 1e3:.2f} ms, {2 * m * k * n / s / 1e9:.0f} GFLOP/s "
              f"({args.threads} threads, torch {torch.__version__})")


if __name__ == "__main__":
    main()
