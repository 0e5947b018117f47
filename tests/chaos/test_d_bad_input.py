"""(d) A matrix of bad payloads to `embed` and `rerank`: each fails on its first attempt
with a non-retryable, typed ApplicationError, and the worker then serves good calls."""

import asyncio
import time
import uuid
from datetime import timedelta

import pytest

from conftest import EMBED_MODEL, history_summary, model_args, workflow_env

MAX_TEXTS = 1024          # gpulane's default --max-texts
MAX_TEXT_CHARS = 100_000  # gpulane's default --max-text-chars

# (case name, activity, ChaosCall case, expected failure type)
CASES = [
    ("embed: texts missing", "embed", {"payload": {"model": EMBED_MODEL}}, "InvalidInput"),
    ("embed: texts not a list", "embed", {"payload": {"texts": "just one text"}}, "InvalidInput"),
    ("embed: texts empty", "embed", {"payload": {"texts": []}}, "InvalidInput"),
    ("embed: a text not a string", "embed", {"payload": {"texts": ["ok", 7]}}, "InvalidInput"),
    ("embed: too many texts", "embed", {"payload": {"texts": ["a"] * (MAX_TEXTS + 1)}}, "InvalidInput"),
    ("embed: a text too long", "embed", {"payload": {"texts": ["a" * (MAX_TEXT_CHARS + 1)]}}, "InvalidInput"),
    ("embed: unknown field", "embed", {"payload": {"texts": ["a"], "colour": "blue"}}, "InvalidInput"),
    ("embed: unknown model", "embed", {"payload": {"texts": ["a"], "model": "no-such-model"}}, "UnknownModel"),
    ("embed: wrong JSON type (array)", "embed", {"payload": ["a", "b"]}, "InvalidInput"),
    ("embed: wrong JSON type (number)", "embed", {"payload": 42}, "InvalidInput"),
    ("embed: null", "embed", {"payload": None}, "InvalidInput"),
    ("embed: wrong field type (normalize)", "embed", {"payload": {"texts": ["a"], "normalize": "yes"}}, "InvalidInput"),
    ("embed: duplicate key", "embed", {"raw": '{"texts": ["a"], "texts": ["b"]}'}, "InvalidInput"),
    ("embed: extra argument", "embed",
     {"payload": {"texts": ["a"]}, "extra_args": [{"texts": ["b"]}]}, "InvalidInput"),
    ("rerank: query missing", "rerank", {"payload": {"documents": ["d"]}}, "InvalidInput"),
    ("rerank: documents not a list", "rerank", {"payload": {"query": "q", "documents": "d"}}, "InvalidInput"),
    ("rerank: documents empty", "rerank", {"payload": {"query": "q", "documents": []}}, "InvalidInput"),
    ("rerank: too many documents", "rerank",
     {"payload": {"query": "q", "documents": ["d"] * (MAX_TEXTS + 1)}}, "InvalidInput"),
    ("rerank: query too long", "rerank",
     {"payload": {"query": "q" * (MAX_TEXT_CHARS + 1), "documents": ["d"]}}, "InvalidInput"),
    ("rerank: unknown field", "rerank", {"payload": {"query": "q", "documents": ["d"], "k": 3}}, "InvalidInput"),
    ("rerank: top_n 0", "rerank", {"payload": {"query": "q", "documents": ["d"], "top_n": 0}}, "InvalidInput"),
    ("rerank: unknown model", "rerank",
     {"payload": {"query": "q", "documents": ["d"], "model": "no-such-reranker"}}, "UnknownModel"),
    ("rerank: embedder as reranker", "rerank",
     {"payload": {"query": "q", "documents": ["d"], "model": EMBED_MODEL}}, "InvalidInput"),
    ("rerank: wrong JSON type (string)", "rerank", {"payload": "q"}, "InvalidInput"),
    ("rerank: duplicate key", "rerank",
     {"raw": '{"query": "q", "query": "r", "documents": ["d"]}'}, "InvalidInput"),
    ("rerank: extra argument", "rerank",
     {"payload": {"query": "q", "documents": ["d"]}, "extra_args": ["second"]}, "InvalidInput"),
]

KNOWN_TYPES = {"InvalidInput", "UnknownModel", "ModelNotServed", "TextTooLong", "ResultTooLarge", "NonFiniteOutput",
               "UnknownActivity", "GpuOutOfMemory", "ModelFailure", "WorkerShutdown", "InternalError"}


@pytest.mark.fast
@pytest.mark.bound(180)
def test_d_bad_input_matrix(exp, server, workers):
    exp.expect(
        f"{len(CASES)} bad payloads (embed and rerank; on the worker's private queue, so an unknown "
        f"model is final): each fails after exactly one attempt (ActivityTaskStarted attempt 1) with an "
        f"ApplicationError, non_retryable, of the listed type (InvalidInput, or UnknownModel); then a good "
        f"embed and a good rerank succeed on the same worker")
    w = workers(*model_args(rerank=True), "--gpus", "none", name="w1")
    queue = f"cpu-tools.{w.host}"

    async def go():
        async with workflow_env(server.address) as (client, wf_queue):
            run = uuid.uuid4().hex[:6]
            handles = [
                await client.start_workflow(
                    "ChaosCall", args=[activity, queue, case], id=f"bad-{run}-{i:02d}",
                    task_queue=wf_queue, execution_timeout=timedelta(seconds=120),
                )
                for i, (_, activity, case, _) in enumerate(CASES)
            ]
            outs = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 90)
            hist = await asyncio.gather(*(history_summary(h) for h in handles))
            good = await asyncio.wait_for(asyncio.gather(
                client.execute_workflow("ChaosCall", args=["embed", queue, {"payload": {"texts": ["still serving"]}}],
                                        id=f"good-embed-{run}", task_queue=wf_queue,
                                        execution_timeout=timedelta(seconds=60)),
                client.execute_workflow("ChaosCall", args=["rerank", queue, {"payload": {"query": "q", "documents": ["a", "b"]}}],
                                        id=f"good-rerank-{run}", task_queue=wf_queue,
                                        execution_timeout=timedelta(seconds=60)),
            ), 60)
            return outs, hist, good

    t0 = time.monotonic()
    outs, hist, good = asyncio.run(asyncio.wait_for(go(), 160))
    exp.see(f"{len(CASES)} cases ran in {time.monotonic() - t0:.1f} s")

    failures = []
    print(f"  {'case':42} {'expected':13} {'saw':14} {'final':6} attempt")
    for (name, _, case, want), out, h in zip(CASES, outs, hist):
        err = out.get("error")
        attempt = h["attempt"]
        if err is None:
            saw = "completed"
            ok = False
        else:
            saw = err["type"] if err["class"] == "ApplicationError" else err["class"]
            ok = (err["class"] == "ApplicationError" and err["non_retryable"] is True and err["type"] == want
                  and err["type"] in KNOWN_TYPES)
        ok = ok and attempt == 1 and h["started"] == 1
        if "raw" in case:  # the bytes went out as written, duplicate key and all
            assert h["inputs"] == [case["raw"].encode()], (name, h["inputs"])
        if "extra_args" in case:
            assert len(h["inputs"]) == 1 + len(case["extra_args"]), (name, h["inputs"])
        print(f"  {name:42} {want:13} {saw:14} {str(err['non_retryable'] if err else '-'):6} {attempt}"
              f"{'' if ok else '   <-- not as expected'}")
        if not ok:
            detail = f"{name}: {saw}"
            if err:
                detail += f" (non_retryable={err['non_retryable']}, attempt {attempt}: {err['message'][:100]!r})"
            else:
                detail += f" on attempt {attempt}"
            failures.append(detail)
    good_ok = all("ok" in g for g in good)
    exp.see(f"{len(CASES) - len(failures)}/{len(CASES)} refused once, non-retryably, with the expected type")
    if failures:
        exp.see("not as expected: " + " | ".join(failures))
    exp.see("good embed and rerank afterwards: " + ("served" if good_ok else f"FAILED {good}")
            + f"; worker {'running' if w.proc.poll() is None else f'exited {w.proc.returncode}'}")
    assert good_ok, good
    assert w.proc.poll() is None
    assert not failures, f"{len(failures)} of {len(CASES)} cases not as expected (see SAW)"
