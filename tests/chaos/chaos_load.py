"""Load for the chaos experiments: many one-activity workflows started at once, a tracker
that counts them as they finish (so a fault can be injected at ~1/3 done), and the checks
every load experiment makes on results and histories."""

import asyncio
import collections
import random
import time
import uuid
from datetime import timedelta

from conftest import EMBED_DIMENSIONS, history_summary, result_retrying

WORDS = ("the quick brown fox jumps over a lazy dog while workers drain their lanes and "
         "cards serve private queues under a temporal dev server that restarts").split()


def texts_for(i: int, count: int = 64, words: int = 100) -> list:
    """`count` texts of about `words` words (about 100 tokens each with the tiny BERT's
    tokenizer): about 65 ms of work for the tiny model on one core here."""
    rng = random.Random(i)
    return [f"workflow {i} text {j}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for j in range(count)]


async def start_many(client, wf_queue, n, queue, options, tag, texts_per_call=64, concurrency=16):
    """Starts n ChaosEmbed workflows; returns [(handle, texts)] in order."""
    sem = asyncio.Semaphore(concurrency)
    run = uuid.uuid4().hex[:6]

    async def one(i):
        texts = texts_for(i, texts_per_call)
        async with sem:
            h = await client.start_workflow(
                "ChaosEmbed", args=[queue, {"texts": texts}, options],
                id=f"{tag}-{run}-{i:04d}", task_queue=wf_queue,
                execution_timeout=timedelta(minutes=10),
            )
        return h, texts

    return await asyncio.gather(*(one(i) for i in range(n)))


class Tracker:
    """Waits on every workflow's result in the background; counts what has finished."""

    def __init__(self, started, deadline):
        self.started = started
        self.results = [None] * len(started)
        self.errors = [None] * len(started)
        self.finished_at = [None] * len(started)
        self.done = 0
        self.t0 = time.monotonic()
        self.tasks = [asyncio.create_task(self._wait(i, h, deadline)) for i, (h, _) in enumerate(started)]

    async def _wait(self, i, handle, deadline):
        try:
            self.results[i] = await result_retrying(handle, deadline)
        except Exception as e:  # noqa: BLE001 - recorded, judged by the experiment
            self.errors[i] = e
        self.finished_at[i] = time.monotonic()
        self.done += 1

    async def until(self, count, timeout):
        """Waits until `count` workflows finished; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.done < count:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def all(self, timeout):
        """Waits for every workflow (up to `timeout`); returns how many finished."""
        await asyncio.wait(self.tasks, timeout=timeout)
        return self.done

    def cancel(self):
        for t in self.tasks:
            t.cancel()

    def ok(self):
        return sum(1 for r in self.results if r is not None)

    def served_by(self):
        """Counter of the host part of each result's host_task_queue so far."""
        c = collections.Counter()
        for r in self.results:
            if r is not None:
                c[r["host_task_queue"].split(".")[1]] += 1
        return c


def bad_shapes(started, results) -> list:
    """Indices whose result is not one vector of the model's width per text."""
    bad = []
    for i, ((_, texts), r) in enumerate(zip(started, results)):
        if r is None:
            continue
        emb = r.get("embeddings", [])
        if (len(emb) != len(texts) or any(len(v) != EMBED_DIMENSIONS for v in emb)
                or r.get("dimensions") != EMBED_DIMENSIONS):
            bad.append(i)
    return bad


async def summaries(handles, concurrency=16):
    sem = asyncio.Semaphore(concurrency)

    async def one(h):
        async with sem:
            return await history_summary(h)

    return await asyncio.gather(*(one(h) for h in handles))


async def pending_states(handles) -> collections.Counter:
    """How the unfinished workflows' activities stand: Counter of 'STATE attempt N'."""
    c = collections.Counter()
    for h in handles:
        try:
            d = await h.describe()
        except Exception as e:  # noqa: BLE001
            c[f"describe failed: {type(e).__name__}"] += 1
            continue
        if d.status is not None and d.status.name != "RUNNING":
            c[d.status.name] += 1
            continue
        pending = d.raw_description.pending_activities
        if not pending:
            c["no pending activity"] += 1
        for p in pending:
            state = p.state
            from temporalio.api.enums.v1 import PendingActivityState

            c[f"{PendingActivityState.Name(state).replace('PENDING_ACTIVITY_STATE_', '')} attempt {p.attempt}"] += 1
    return c


async def terminate_unfinished(handles, reason="chaos experiment bound reached"):
    for h in handles:
        try:
            d = await h.describe()
            if d.status is not None and d.status.name == "RUNNING":
                await h.terminate(reason)
        except Exception:  # noqa: BLE001
            pass
