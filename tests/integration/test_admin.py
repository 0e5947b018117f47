"""The admin API and its CLI against running workers: `gpulane status --json` with each
lane's backlog read from Temporal, draining and resuming a card, bad requests, and a card
that cannot be read at start."""

import asyncio
import json
import subprocess
import time
import uuid
from datetime import timedelta

from conftest import BIN, FIXTURES, free_port, workflow_env
from test_rerank import call_once

GIB = 1 << 30


def lanes_by_queue(status, device):
    return {l["task_queue"]: l for l in status["lanes"] if l["device"] == device}


def device(status, uuid_):
    return next(d for d in status["devices"] if d["id"] == uuid_)


async def start_embeds(client, wf_queue, queue, n, tag):
    return [
        await client.start_workflow(
            "EmbedOn", args=[queue, {"texts": [f"{tag} {i}"]}], id=f"{tag}-{uuid.uuid4()}",
            task_queue=wf_queue, execution_timeout=timedelta(minutes=3),
        )
        for i in range(n)
    ]


def test_status_lists_every_lane_with_a_backlog_that_grows_while_a_card_is_full(
    temporal_address, gpulane, tmp_path
):
    mem = tmp_path / "free.json"
    mem.write_text(json.dumps({"0": 0}))  # card 0 full from the start: it never polls
    g = gpulane(
        "--model", str(FIXTURES / "tiny-bert-cls"), "--simulate-gpus", "2x16GiB",
        "--simulated-memory", str(mem), "--memory-refresh-ms", "100",
    )
    status = g.status()
    assert status["ready"] is True and status["problems"] == [], status
    private0 = f"gpu-tools.{g.host}.gpu-sim-t-0"
    private1 = f"gpu-tools.{g.host}.gpu-sim-t-1"
    expected = {("gpu-tools", "GPU-SIM-t-0"), (private0, "GPU-SIM-t-0"),
                ("gpu-tools", "GPU-SIM-t-1"), (private1, "GPU-SIM-t-1")}
    assert {(l["task_queue"], l["device"]) for l in status["lanes"]} == expected, status["lanes"]
    for l in status["lanes"]:
        assert l["state"] == "polling" and l["identity"].endswith(f"/{l['device']}/{l['task_queue']}"), l
        b = l["backlog"]
        assert b["error"] == "", b
        assert b["approximate_backlog_count"] == 0 and b["approximate_backlog_age_seconds"] >= 0, b
    # Each card's identity names it, so `describe` tells the cards of one host apart (the
    # server lists a poller once its first poll arrives).
    deadline = time.monotonic() + 15
    while True:
        # This worker's pollers only: earlier tests' workers may still be listed.
        shared_pollers = {p["identity"] for l in g.status()["lanes"] if l["task_queue"] == "gpu-tools"
                          for p in l["backlog"]["pollers"]
                          if p["identity"].startswith(status["identity"] + "/")}
        if any(p.endswith("/GPU-SIM-t-1/gpu-tools") for p in shared_pollers) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any(p.endswith("/GPU-SIM-t-1/gpu-tools") for p in shared_pollers), shared_pollers
    assert not any("/GPU-SIM-t-0/" in p for p in shared_pollers), "card 0 has no memory: it must not poll"
    assert device(status, "GPU-SIM-t-0")["budget"]["free_bytes"] == 0
    assert device(status, "GPU-SIM-t-1")["budget"]["total_bytes"] == 16 * GIB

    async def go():
        async with workflow_env(temporal_address) as (client, wf_queue):
            handles = await start_embeds(client, wf_queue, private0, 3, "pinned-to-full-card")
            seen = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                lane = lanes_by_queue(g.status(), "GPU-SIM-t-0")[private0]
                seen.append(lane["backlog"]["approximate_backlog_count"])
                if seen[-1] >= 3 and lane["backlog"]["approximate_backlog_age_seconds"] > 0:
                    break
                await asyncio.sleep(0.5)
            assert seen[-1] >= 3, f"backlog never reached 3: {seen}"
            assert lane["backlog"]["approximate_backlog_age_seconds"] > 0, lane
            mem.write_text(json.dumps({"0": 16 * GIB}))
            return await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 60)

    results = asyncio.run(go())
    assert all(r["device"]["uuid"] == "GPU-SIM-t-0" for r in results)
    # The human form names the same lanes.
    table = g.cli("status").stdout
    assert private0 in table and "backlog" in table and "GPU-SIM-t-1" in table, table


def wait_lane_state(g, device_id, queue, want, deadline_s=20):
    deadline = time.monotonic() + deadline_s
    while True:
        lane = lanes_by_queue(g.status("--no-backlog"), device_id)[queue]
        if lane["state"] == want:
            return
        assert time.monotonic() < deadline, (lane, g.log()[-3000:])
        time.sleep(0.2)


def test_drain_moves_shared_work_to_the_other_card_keeps_the_private_window_and_resume_undoes_it(
    temporal_address, gpulane
):
    window = 10
    g = gpulane(
        "--model", str(FIXTURES / "tiny-bert-cls"), "--simulate-gpus", "2x16GiB",
        env={"GPULANE_DRAIN_PRIVATE_SECS": str(window)},
    )
    drained_at = time.monotonic()
    out = g.cli("drain", "--card", "GPU-SIM-t-0").stdout
    assert "GPU-SIM-t-0" in out, out
    status = g.status("--no-backlog")
    assert device(status, "GPU-SIM-t-0")["state"] == "draining"
    private0 = f"gpu-tools.{g.host}.gpu-sim-t-0"
    assert lanes_by_queue(status, "GPU-SIM-t-0")[private0]["state"] == "polling"
    # One drained card of two: the worker still serves, so it stays ready.
    assert status["ready"] is True, status
    # Once the card's shared lane has shut down, none of its polls is left open.
    wait_lane_state(g, "GPU-SIM-t-0", "gpu-tools", "stopped")

    async def calls(queue, n, tag):
        async with workflow_env(temporal_address) as (client, wf_queue):
            handles = await start_embeds(client, wf_queue, queue, n, tag)
            return await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 60)

    shared = asyncio.run(calls("gpu-tools", 20, "after-drain"))
    assert [r["device"]["uuid"] for r in shared] == ["GPU-SIM-t-1"] * 20, shared
    pinned = asyncio.run(calls(private0, 1, "pinned-in-window"))
    assert pinned[0]["device"]["uuid"] == "GPU-SIM-t-0"
    assert time.monotonic() - drained_at < window, "the pinned call must land inside the window"

    # After the window the private lane stops too: a pinned call is no longer served.
    wait_lane_state(g, "GPU-SIM-t-0", private0, "stopped", deadline_s=window + 10)
    assert device(g.status("--no-backlog"), "GPU-SIM-t-0")["state"] == "drained"
    late = call_once(temporal_address, "embed", private0, {"texts": ["too late"]},
                     schedule_to_start_s=3)
    assert late.get("error", {}).get("kind") == "TimeoutError", late

    g.cli("resume", "--card", "GPU-SIM-t-0")
    status = g.status("--no-backlog")
    assert device(status, "GPU-SIM-t-0")["state"] == "serving"
    assert {l["state"] for l in status["lanes"]} == {"polling"}, status["lanes"]
    served = set()
    for _ in range(5):
        served |= {r["device"]["uuid"] for r in asyncio.run(calls("gpu-tools", 30, "after-resume"))}
        if served == {"GPU-SIM-t-0", "GPU-SIM-t-1"}:
            break
    assert served == {"GPU-SIM-t-0", "GPU-SIM-t-1"}, served


def test_bad_admin_requests_are_refused_clearly_and_change_nothing(temporal_address, gpulane):
    # A window long enough that the drained card is still "draining" throughout.
    g = gpulane("--model", str(FIXTURES / "tiny-bert-cls"), "--simulate-gpus", "2x16GiB",
                env={"GPULANE_DRAIN_PRIVATE_SECS": "5"})

    def states():
        s = g.status("--no-backlog")
        return ({d["id"]: d["state"] for d in s["devices"]},
                sorted((l["task_queue"], l["device"], l["state"]) for l in s["lanes"]))

    before = states()
    out = g.cli("drain", "--card", "GPU-NOPE", check=False)
    assert out.returncode != 0 and "no device" in out.stderr and "GPU-SIM-t-0" in out.stderr, out
    assert "Stack backtrace" not in out.stderr, out.stderr
    out = g.cli("resume", "--card", "GPU-SIM-t-1", check=False)
    assert out.returncode != 0 and "not drained" in out.stderr, out
    assert states() == before

    g.cli("drain", "--card", "GPU-SIM-t-1")
    drained = states()
    out = g.cli("drain", "--card", "GPU-SIM-t-1", check=False)
    assert out.returncode != 0 and "already draining" in out.stderr, out
    assert states() == drained
    g.cli("resume", "--card", "gpu-sim-t-1")  # UUIDs match in any case
    assert states() == before
    out = g.cli("resume", "--card", "GPU-SIM-t-1", check=False)
    assert out.returncode != 0 and "not drained" in out.stderr, out
    assert states() == before

    # No worker there: one clear line, non-zero.
    out = subprocess.run([str(BIN), "status", "--admin-address", f"127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "cannot connect" in out.stderr, out


def test_a_card_unreadable_at_start_is_set_aside_reported_and_served_once_it_reads(
    temporal_address, gpulane, tmp_path
):
    mem = tmp_path / "free.json"
    mem.write_text(json.dumps({"1": "fail"}))
    g = gpulane(
        "--model", str(FIXTURES / "tiny-bert-cls"), "--simulate-gpus", "2x16GiB",
        "--simulated-memory", str(mem), "--memory-refresh-ms", "100", "--card-retry-secs", "1",
    )
    assert "cannot read this card" in g.log()
    status = g.status("--no-backlog")
    assert status["ready"] is True, status
    broken = device(status, "GPU-SIM-t-1")
    assert broken["state"] == "broken" and "scripted to fail" in broken["error"], broken
    assert device(status, "GPU-SIM-t-0")["state"] == "serving"

    async def pinned(card):
        async with workflow_env(temporal_address) as (client, wf_queue):
            return await client.execute_workflow(
                "EmbedOn", args=[f"gpu-tools.{g.host}.{card}", {"texts": ["x"]}],
                id=f"pin-{uuid.uuid4()}", task_queue=wf_queue, execution_timeout=timedelta(minutes=2),
            )

    assert asyncio.run(pinned("gpu-sim-t-0"))["device"]["uuid"] == "GPU-SIM-t-0"
    mem.write_text("{}")
    deadline = time.monotonic() + 30
    while device(g.status("--no-backlog"), "GPU-SIM-t-1")["state"] != "serving":
        assert time.monotonic() < deadline, g.log()[-3000:]
        time.sleep(0.5)
    assert "card readable again" in g.log()
    assert asyncio.run(pinned("gpu-sim-t-1"))["device"]["uuid"] == "GPU-SIM-t-1"


def test_temporal_knobs_reach_sdk_core_and_the_identity_names_pod_and_card(temporal_address, gpulane):
    pod = f"gpulane-{uuid.uuid4().hex[:6]}"
    g = gpulane(
        "--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--gpus", "none",
        "--pollers", "auto:1-4", "--max-activities-per-second", "50",
        "--max-task-queue-activities-per-second", "100",
        "--deployment-name", "gpulane-test", "--build-id", "b1",
        env={"POD_NAME": pod},
    )
    status = g.status("--no-backlog")
    assert status["identity"] == f"gpulane@{pod}", status["identity"]
    for lane in status["lanes"]:
        assert lane["identity"] == f"gpulane@{pod}/cpu/{lane['task_queue']}", lane

    async def go():
        async with workflow_env(temporal_address) as (client, wf_queue):
            handles = await start_embeds(client, wf_queue, "cpu-tools", 8, "knobs")
            return await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 60)

    assert len(asyncio.run(go())) == 8
    lane = next(l for l in g.status()["lanes"] if l["task_queue"] == "cpu-tools")
    mine = [p for p in lane["backlog"]["pollers"] if p["identity"] == f"gpulane@{pod}/cpu/cpu-tools"]
    assert mine, lane["backlog"]["pollers"]
    # The server saw the deployment version and the queue's rate limit this worker set.
    assert (mine[0]["deployment_name"], mine[0]["build_id"]) == ("gpulane-test", "b1"), mine
    assert lane["backlog"]["rate_limit_source"] == "worker", lane["backlog"]
    assert lane["backlog"]["rate_limit_per_second"] == 100, lane["backlog"]
