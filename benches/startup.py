"""Start-up and footprint (issue 14, item 5): gpulane's CPU lane against the Python worker
users run today (`py_worker.py`: sentence-transformers in a temporalio worker), both
serving all-MiniLM-L6-v2 on one dev server, one after the other:

- process start to the first poll: the time from spawning the process until Temporal's
  `DescribeTaskQueue` lists a poller on the worker's activity queue (the server's view, the
  same for both), and until the worker says it is ready;
- idle RSS: the process's resident memory 10 s after its first poll, before any call;
- RSS under load: the peak, sampled every 20 ms, while 16 workflows of one 32-text `embed`
  each run at once, and again 10 s after the load.

    .venv-bench/bin/python benches/startup.py [--rounds 3] [--threads 2]

Prints one line per worker and round, then the medians and the model's weight size (the
goals: first poll under 1 s, idle RSS under twice the weights).
"""

import argparse
import asyncio
import os
import pathlib
import statistics
import subprocess
import sys
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "benches"))

from temporalio.api.enums.v1 import TaskQueueType  # noqa: E402
from temporalio.api.taskqueue.v1 import TaskQueue  # noqa: E402
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest  # noqa: E402
from temporalio.worker import Worker  # noqa: E402

import workflows  # noqa: E402
from devserver import dev_server, model_dir, rss_mib  # noqa: E402


async def has_poller(client, queue):
    resp = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace="default", task_queue=TaskQueue(name=queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY))
    return len(resp.pollers) > 0


async def measure(client, wf_queue, name, argv, queue, env, log_path, ready_line):
    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    first_poll = ready = None
    try:
        while first_poll is None or ready is None:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{open(log_path).read()}")
            now = time.monotonic() - t0
            if ready is None and ready_line in open(log_path).read():
                ready = now
            if first_poll is None and await has_poller(client, queue):
                first_poll = now
            if now > 120:
                raise TimeoutError(f"{name} did not poll:\n{open(log_path).read()}")
            await asyncio.sleep(0.02)
        await asyncio.sleep(10)
        idle = rss_mib(proc.pid)
        peak = idle
        texts = [f"sentence {i} about the quick brown fox and the lazy dog" for i in range(32)]

        async def sample():
            nonlocal peak
            while True:
                peak = max(peak, rss_mib(proc.pid))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(client.execute_workflow(
            "EmbedOn", args=[queue, {"texts": texts}], id=f"su-{uuid.uuid4()}",
            task_queue=wf_queue) for _ in range(16)))
        sampler.cancel()
        await asyncio.sleep(10)
        after = rss_mib(proc.pid)
        return {"first_poll_s": first_poll, "ready_s": ready, "idle_mib": idle,
                "load_peak_mib": peak, "after_load_mib": after}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def main(args):
    model = model_dir()
    weights_mib = os.path.getsize(f"{model}/model.safetensors") / 2**20
    async with dev_server() as (client, address, tmp):
        env = {**os.environ, "TEMPORAL_ADDRESS": address, "GPULANE_METRICS_ADDRESS": "off",
               "GPULANE_ADMIN_ADDRESS": "off", "GPULANE_CPU_THREADS": str(args.threads)}
        wf_queue = f"wf-{uuid.uuid4().hex[:8]}"
        results = {"gpulane": [], "py_worker": []}
        async with Worker(client, task_queue=wf_queue, workflows=[workflows.EmbedOn]):
            for r in range(args.rounds):
                # A fresh shared queue per round: no poller left from the last process.
                q = f"startup-{uuid.uuid4().hex[:6]}"
                g = await measure(
                    client, wf_queue, "gpulane",
                    [str(ROOT / "target/release/gpulane"), "run", "--model", model,
                     "--gpus", "none"],
                    # Its private CPU queue: new each round, so a poller there is this
                    # process's (the shared queue remembers the last round's pollers). The
                    # CPU lane opens both queues' polls together.
                    f"cpu-tools.{q}", {**env, "GPULANE_HOST": q},
                    f"{tmp}/g{r}.log", "gpulane ready")
                results["gpulane"].append(g)
                print(f"gpulane   round {r}: {g}", flush=True)
                p = await measure(
                    client, wf_queue, "py_worker",
                    [sys.executable, str(ROOT / "benches/py_worker.py"), "--model", model,
                     "--task-queue", q, "--address", address, "--threads", str(args.threads)],
                    q, env, f"{tmp}/p{r}.log", "py_worker ready")
                results["py_worker"].append(p)
                print(f"py_worker round {r}: {p}", flush=True)
    print(f"\nmodel weights (model.safetensors): {weights_mib:.1f} MiB; medians of "
          f"{args.rounds} rounds, {args.threads} threads:")
    for key in ("first_poll_s", "ready_s", "idle_mib", "load_peak_mib", "after_load_mib"):
        g = statistics.median(x[key] for x in results["gpulane"])
        p = statistics.median(x[key] for x in results["py_worker"])
        print(f"  {key:15} gpulane {g:8.2f}   py_worker {p:8.2f}   ratio {p / g:5.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    asyncio.run(main(ap.parse_args()))
