"""What an operator scrapes: Temporal's own worker metrics beside gpulane's on one
/metrics, label values that no workflow can inject into or multiply, and probes that idle
connections cannot block. Plus the prompt limit, found by feeding a running worker bad
input."""

import asyncio
import re
import socket
import uuid
from datetime import timedelta

from conftest import FIXTURES, workflow_env
from test_rerank import call_once

# One sample line of the Prometheus text format: a name, optional labels, a value.
SAMPLE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\.)*",?)*\})? '
    r'([-+]?[0-9.eE+-]+|NaN|[+-]Inf)$'
)


def samples(text):
    lines = [l for l in text.splitlines() if l and not l.startswith("#")]
    bad = [l for l in lines if not SAMPLE.match(l)]
    assert not bad, f"malformed exposition lines: {bad[:5]}"
    return lines


def run_many(address, activity_types, queue, payload):
    async def go():
        async with workflow_env(address) as (client, wf_queue):
            handles = [
                await client.start_workflow(
                    "TryOnce", args=[t, queue, payload, {}], id=f"m-{uuid.uuid4()}",
                    task_queue=wf_queue, execution_timeout=timedelta(minutes=2),
                )
                for t in activity_types
            ]
            return await asyncio.gather(*(h.result() for h in handles))

    return asyncio.run(go())


def test_metrics_carry_temporals_worker_series_beside_gpulanes(temporal_address, gpulane):
    g = gpulane("--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--gpus", "none")
    outs = run_many(temporal_address, ["embed"] * 6, "cpu-tools", {"texts": ["load"]})
    assert all("ok" in o for o in outs), outs
    text = g.metrics()
    samples(text)
    m = re.search(r'^temporal_activity_schedule_to_start_latency_count\{[^}]*task_queue="cpu-tools"[^}]*\} (\d+)',
                  text, re.M)
    assert m and int(m.group(1)) >= 6, text
    assert re.search(r'^temporal_activity_schedule_to_start_latency_bucket\{[^}]*le="0.1"', text, re.M)
    assert re.search(r'^temporal_activity_execution_latency_count\{[^}]*task_queue="cpu-tools"', text, re.M)
    assert re.search(r'^temporal_worker_task_slots_used\{[^}]*task_queue="cpu-tools"', text, re.M), text
    assert ('gpulane_activity_seconds_count{activity_type="embed",model="tiny",'
            'outcome="completed",task_queue="cpu-tools"} 6') in text, text
    assert re.search(r'^gpulane_batch_rows_count\{device="cpu",model="tiny"\} [1-9]', text, re.M)
    assert re.search(r'^gpulane_engine_queue_seconds_count\{device="cpu",model="tiny"\} 6$', text, re.M)
    assert "gpulane_ready 1" in text


def test_made_up_activity_types_neither_inject_lines_nor_multiply_series(temporal_address, gpulane):
    g = gpulane("--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--gpus", "none")
    run_many(temporal_address, ["embed"], "cpu-tools", {"texts": ["warm"]})
    before = len(samples(g.metrics()))
    evil = 'embed\n gpulane_injected_total{evil="1"} 42'
    outs = run_many(temporal_address, [evil] + [f"made-up-{i}" for i in range(300)], "cpu-tools",
                    {"texts": ["x"]})
    for o in outs:
        assert o["error"]["type"] == "UnknownActivity" and o["error"]["non_retryable"], o
        assert len(o["error"]["message"]) < 300, o
    text = g.metrics()
    lines = samples(text)
    assert not any(l.startswith("gpulane_injected_total") for l in lines), text
    assert "made-up" not in text and "evil" not in text
    # A bounded handful of new series (the `other` type's), not one per made-up type.
    assert len(lines) - before < 40, (before, len(lines))
    assert re.search(r'^gpulane_activity_seconds_count\{activity_type="other",model="none",'
                     r'outcome="failed",task_queue="cpu-tools"\} 301$', text, re.M), text


def test_idle_connections_do_not_stop_a_scrape(temporal_address, gpulane):
    g = gpulane("--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--gpus", "none")
    host, port = g.http_address().split(":")
    idle = []
    try:
        for _ in range(200):
            s = socket.create_connection((host, int(port)), timeout=5)
            idle.append(s)
        status, body = g.get("/metrics")
        assert status == 200 and "gpulane_ready 1" in body
        assert g.get("/readyz") == (200, "ready\n")
        assert g.get("/healthz") == (200, "ok\n")
    finally:
        for s in idle:
            s.close()


def test_an_oversized_prompt_is_refused_naming_the_limit(temporal_address, gpulane):
    gpulane("--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--gpus", "none")
    # Longer than a text may be.
    out = call_once(temporal_address, "embed", "cpu-tools", {"texts": ["a"], "prompt": "p" * 100_001})
    err = out["error"]
    assert err["type"] == "InvalidInput" and err["non_retryable"], err
    assert '"prompt" has 100001 characters' in err["message"] and "limit of 100000" in err["message"], err
    # Short enough alone, but before each of 1,024 texts it is over the per-call limit.
    out = call_once(temporal_address, "embed", "cpu-tools",
                    {"texts": ["a"] * 1024, "prompt": "p" * 1000})
    err = out["error"]
    assert err["type"] == "InvalidInput" and err["non_retryable"], err
    assert "limit of 1000000 per call" in err["message"] and "prompt" in err["message"], err
    # The worker serves on.
    assert "ok" in call_once(temporal_address, "embed", "cpu-tools", {"texts": ["fine"], "prompt": "q: "})
