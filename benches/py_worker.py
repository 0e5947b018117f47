"""The peer Temporal worker: what a user runs today to embed text from Temporal workflows in
Python, sentence-transformers inside a `temporalio` activity worker.

It serves an `embed` activity with gpulane's JSON shape (`{"texts": [...], "model"?}` in,
`{"embeddings": [[...]], "model", "dimensions"}` out; gpulane's other options are not
implemented), so the same workflow can call either worker by task queue.

Written as a competent user would, not as a strawman:
- the model is loaded once, at start, and shared by all activities (PyTorch modules are
  safe to call from several threads in inference);
- the activity is a plain `def`, run by the SDK in a thread pool, so inference never blocks
  the event loop that polls and heartbeats; PyTorch releases the GIL in its kernels;
- torch's intra-op threads are set to the cores given to the worker, and one `encode`
  runs at a time (`--inferences`, default 1): concurrent calls would only make several
  OpenMP teams of that size fight over the same cores, and sentence-transformers batches
  within one call only, so concurrency buys no batching. A few activities may be in flight
  (`--max-concurrent`, default 4) so that polling, payload decoding and result encoding of
  the next ones overlap the running inference;
- results are float lists through the SDK's default JSON converter, as gpulane's are.

Usage: py_worker.py --model DIR --task-queue Q [--address 127.0.0.1:7233] [--threads 2]
                    [--max-concurrent 4] [--inferences 1]
Prints "py_worker ready" when it polls.
"""

import argparse
import asyncio
import concurrent.futures
import os
import pathlib
import signal
import threading


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a sentence-transformers model directory")
    ap.add_argument("--task-queue", required=True)
    ap.add_argument("--address", default=os.environ.get("TEMPORAL_ADDRESS", "127.0.0.1:7233"))
    ap.add_argument("--namespace", default=os.environ.get("TEMPORAL_NAMESPACE", "default"))
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    ap.add_argument("--max-concurrent", type=int, default=4,
                    help="most embed activities in flight at once (the thread pool's size)")
    ap.add_argument("--inferences", type=int, default=1,
                    help="most model.encode calls running at once")
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers batch size")
    args = ap.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    import torch
    from sentence_transformers import SentenceTransformer
    from temporalio import activity
    from temporalio.client import Client
    from temporalio.exceptions import ApplicationError
    from temporalio.worker import Worker

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model, device="cpu")
    name = pathlib.Path(args.model).name
    dims = model.get_embedding_dimension()
    # Warm up once so the first activity does not pay for lazy initialisation.
    model.encode(["warm up"], show_progress_bar=False)
    inference_slots = threading.Semaphore(args.inferences)

    @activity.defn(name="embed")
    def embed(payload: dict) -> dict:
        texts = payload.get("texts") if isinstance(payload, dict) else None
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ApplicationError("`texts` must be a non-empty array of strings",
                                   type="InvalidInput", non_retryable=True)
        if payload.get("model", name) != name:
            raise ApplicationError(f"unknown model {payload['model']!r}; served: {name}",
                                   type="UnknownModel", non_retryable=True)
        # The model's own pipeline decides normalization (MiniLM's has a Normalize module).
        with inference_slots:
            vectors = model.encode(texts, batch_size=args.batch_size, convert_to_numpy=True,
                                   show_progress_bar=False)
        return {"embeddings": vectors.tolist(), "model": name, "dimensions": dims}

    async def serve():
        client = await Client.connect(args.address, namespace=args.namespace)
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.max_concurrent) as pool:
            worker = Worker(client, task_queue=args.task_queue, activities=[embed],
                            activity_executor=pool,
                            max_concurrent_activities=args.max_concurrent)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            async with worker:
                print(f"py_worker ready: queue {args.task_queue}, model {name}, "
                      f"threads {args.threads}, max concurrent {args.max_concurrent}, "
                      f"inferences {args.inferences}", flush=True)
                await stop.wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
