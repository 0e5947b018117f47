"""Shutdown and supervision of a running worker: SIGTERM drains (readiness 503 at once,
running work finishes, exit 0), a second signal exits at once, a dead engine thread takes
readiness down and the process exits non-zero, and neither panicking activities nor
1 µs heartbeat timeouts cost a card its slots."""

import asyncio
import signal
import threading
import time
import uuid
from datetime import timedelta

from temporalio.api.enums.v1 import PendingActivityState

from conftest import FIXTURES, minilm_dir, workflow_env
from test_rerank import call_once

LONG_TEXT = " ".join(["a worker drains its lanes before it stops"] * 6)


def wait_started(handle, deadline_s=60):
    """Waits until the workflow's activity is running on a worker."""

    async def go():
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            desc = await handle.describe()
            pending = desc.raw_description.pending_activities
            if pending and pending[0].state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("the activity never started")

    return go()


async def start_long_embed(client, wf_queue, n, tag):
    """Starts a `n`-text embed on cpu-tools and returns once a worker runs it."""
    texts = [f"{i}: {LONG_TEXT}" for i in range(n)]
    handle = await client.start_workflow(
        "EmbedOn", args=["cpu-tools", {"texts": texts, "encoding": "base64"}],
        id=f"{tag}-{uuid.uuid4()}", task_queue=wf_queue, execution_timeout=timedelta(minutes=5),
    )
    await wait_started(handle)
    return handle


def watch_readyz(g, stop):
    """Polls /readyz every 20 ms until `stop` is set; returns [(monotonic time, status)]."""
    seen = []

    def loop():
        while not stop.is_set():
            try:
                seen.append((time.monotonic(), g.get("/readyz")[0]))
            except Exception:  # the process is gone
                seen.append((time.monotonic(), None))
            time.sleep(0.02)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return seen, t


def test_sigterm_turns_readiness_off_at_once_lets_the_running_embed_finish_and_exits_0(
    temporal_address, gpulane
):
    g = gpulane("--model", f"minilm={minilm_dir()}", "--gpus", "none",
                "--graceful-shutdown-secs", "120")
    g.expected_exit = None
    assert g.get("/readyz")[0] == 200

    async def go():
        async with workflow_env(temporal_address) as (client, wf_queue):
            handle = await start_long_embed(client, wf_queue, 512, "term")
            # It runs on this worker as the signal arrives.
            running = sum(l["running"] for l in g.status("--no-backlog")["lanes"])
            assert running == 1, running
            stop = threading.Event()
            seen, t = watch_readyz(g, stop)
            sent = time.monotonic()
            g.proc.send_signal(signal.SIGTERM)
            result = await handle.result()
            stop.set()
            t.join()
            return result, sent, seen

    result, sent, seen = asyncio.run(go())
    assert len(result["embeddings"]) == 512
    first_503 = next((ts for ts, code in seen if code == 503), None)
    assert first_503 is not None and first_503 - sent < 1.0, seen[:20]
    assert g.proc.wait(60) == 0, g.log()[-3000:]
    assert "gpulane stopped" in g.log()


def test_a_second_signal_during_the_drain_exits_at_once(temporal_address, gpulane):
    g = gpulane("--model", f"minilm={minilm_dir()}", "--gpus", "none",
                "--graceful-shutdown-secs", "120")
    g.expected_exit = None

    async def go():
        async with workflow_env(temporal_address) as (client, wf_queue):
            handle = await start_long_embed(client, wf_queue, 1024, "twice")
            g.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert g.proc.poll() is None, "the first signal must drain, not exit"
            sent = time.monotonic()
            g.proc.send_signal(signal.SIGINT)
            code = await asyncio.to_thread(g.proc.wait, 10)
            took = time.monotonic() - sent
            # The abandoned embed would be retried on cpu-tools by whichever test's worker
            # comes next: end its workflow here.
            await handle.terminate("test over")
            return code, took

    code, took = asyncio.run(go())
    assert code != 0 and took < 3, (code, took)
    assert "second stop signal" in g.log()


def test_a_dead_engine_thread_takes_readiness_down_and_the_worker_exits_non_zero(
    temporal_address, gpulane
):
    # The card's private lane keeps its drain window, so the 503 lasts long enough to see.
    g = gpulane("--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--simulate-gpus", "1x16GiB",
                "--cpu-lane", "on", "--test-faults", env={"GPULANE_DRAIN_PRIVATE_SECS": "5"})
    g.expected_exit = None
    stop = threading.Event()
    seen, t = watch_readyz(g, stop)
    out = call_once(temporal_address, "embed", "cpu-tools",
                    {"texts": ["gpulane-test-fault:engine-panic"]})
    assert out["error"]["type"] == "ModelFailure" and out["error"]["non_retryable"] is False, out
    code = g.proc.wait(60)
    stop.set()
    t.join()
    assert code != 0, g.log()[-3000:]
    assert 503 in [c for _, c in seen], seen[-20:]
    log = g.log()
    assert "the engine of model tiny on cpu died" in log, log[-3000:]


def test_panicking_activities_and_1us_heartbeat_timeouts_do_not_cost_the_card_its_slots(
    temporal_address, gpulane
):
    cap = 2
    g = gpulane("--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--simulate-gpus", "1x16GiB",
                "--max-concurrent-per-card", str(cap), "--test-faults")
    for _ in range(cap + 3):
        out = call_once(temporal_address, "embed", "gpu-tools",
                        {"texts": ["gpulane-test-fault:activity-panic"]})
        err = out["error"]
        assert err["type"] == "InternalError" and err["non_retryable"] is False, out
        assert "panic" in err["message"], err
    for _ in range(cap + 3):
        # Python's smallest timedelta; the heartbeat period would otherwise round to 0.
        out = call_once(temporal_address, "embed", "gpu-tools", {"texts": ["beat"]},
                        heartbeat_timeout_us=1)
        assert "ok" in out or out["error"]["kind"] in ("TimeoutError", "ApplicationError"), out
    # The card still serves, on both its lanes.
    ok = call_once(temporal_address, "embed", "gpu-tools", {"texts": ["still serving"]},
                   schedule_to_start_s=30)
    assert ok["ok"]["device"]["uuid"] == "GPU-SIM-t-0", ok
    pinned = call_once(temporal_address, "embed", f"gpu-tools.{g.host}.gpu-sim-t-0",
                       {"texts": ["pinned"]}, schedule_to_start_s=30)
    assert pinned["ok"]["device"]["uuid"] == "GPU-SIM-t-0", pinned
    text = g.metrics()
    assert 'gpulane_activity_panics_total{task_queue="gpu-tools"} 5' in text, text
    # Nothing is left running or holding the card's memory: only idle polls hold permits.
    deadline = time.monotonic() + 10
    while True:
        status = g.status("--no-backlog")
        budget = status["devices"][0]["budget"]
        running = sum(l["running"] for l in status["lanes"])
        if running == 0 and budget["permits_out"] <= cap:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert status["ready"] is True, status
