"""(e) Idle-poll starvation on a card that can take only one task at a time (a cap of 1, or
memory for exactly one task): after the worker has been idle, a call pinned to the card's
private queue and a call on the shared `gpu-tools` queue, started together, must each
start within a second, and an idle card must hold no memory reservation."""

import asyncio
import os
import time
import uuid
from datetime import timedelta

import pytest

from chaos_load import pending_states, terminate_unfinished
from conftest import EMBED_MODEL, history_summary, model_args, workflow_env

IDLE_S = 5
START_WITHIN_S = 1.0
# How long to wait for the two calls before calling it starvation (a starved lane waits for
# the other lane's long poll, about a minute on the dev server).
WAIT_S = float(os.environ.get("CHAOS_STARVATION_WAIT_S", "10"))

SETUPS = {
    "cap_1": ["--simulate-gpus", "1x16GiB", "--max-concurrent-per-card", "1"],
    "memory_for_1": ["--simulate-gpus", "1x3GiB", "--vram-cost", f"{EMBED_MODEL}=2GiB", "--vram-headroom", "0"],
}


PHASES = [("together", ("pinned", "shared")), ("pinned alone", ("pinned",)), ("shared alone", ("shared",))]


@pytest.mark.fast
@pytest.mark.bound(150)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_e_idle_poll_starvation(exp, server, workers, setup):
    flags = SETUPS[setup]
    exp.expect(
        f"worker `{' '.join(flags)}`, ready and idle {IDLE_S} s: gpulane_gpu_memory_reserved_bytes of the "
        f"card is 0; a pinned embed (the card's private queue) and a shared one (gpu-tools) started "
        f"together each START within {START_WITHIN_S:.0f} s of being scheduled (history: "
        f"ActivityTaskStarted - ActivityTaskScheduled); so does each alone after another {IDLE_S} s idle")
    w = workers(*model_args(), *flags, name="w1")
    card = w.devices()[0]
    queues = {"pinned": w.private_queues()[card], "shared": "gpu-tools"}

    def idle_state():
        status = w.status("--no-backlog")
        running = sum(l["running"] for l in status["lanes"])
        budget = status["devices"][0]["budget"]
        # The gauge counts a busy engine's working set; a health check's one-text pass can
        # make the engine busy for a moment (the gauge refreshes every 0.5 s). Idle polls
        # holding memory would read non-zero in every sample, so take the least of a few.
        samples = []
        for _ in range(5):
            samples.append(w.gauge("gpulane_gpu_memory_reserved_bytes", gpu_uuid=card))
            time.sleep(0.3)
        reserved = min(samples)
        return running, reserved, budget

    async def go():
        observed = []  # (phase, reserved, {call: (state, wait, extra)})
        async with workflow_env(server.address) as (client, wf_queue):
            run = uuid.uuid4().hex[:6]
            for phase, names in PHASES:
                await asyncio.sleep(IDLE_S)
                running, reserved, budget = idle_state()
                exp.see(f"{phase}: after {IDLE_S} s idle ({running} running) the reserved gauge of {card} reads "
                        f"{reserved:.0f} bytes ({reserved / 2**30:.2f} GiB); status: reserved_bytes "
                        f"{budget['reserved_bytes']}, permits out {budget['permits_out']} of {budget['permit_cap']}")
                handles = await asyncio.gather(*(
                    client.start_workflow(
                        "ChaosEmbed", args=[queues[name], {"texts": [f"{name} call"]},
                                            {"start_to_close_s": 30, "maximum_attempts": 1}],
                        id=f"starve-{run}-{phase.replace(' ', '-')}-{name}", task_queue=wf_queue,
                        execution_timeout=timedelta(seconds=90),
                    )
                    for name in names
                ))
                futures = [asyncio.ensure_future(h.result()) for h in handles]
                done, _ = await asyncio.wait(futures, timeout=WAIT_S)
                for f in futures:
                    if f not in done:
                        f.cancel()
                calls = {}
                for h, name in zip(handles, names):
                    s = await history_summary(h)
                    if s["wait_s"] is not None:
                        calls[name] = ("started", s["wait_s"], s["identity"])
                        exp.see(f"{phase}: {name} call started {s['wait_s']:.2f} s after it was scheduled")
                    else:
                        states = dict(await pending_states([h]))
                        calls[name] = ("not started", None, states)
                        exp.see(f"{phase}: {name} call not finished {WAIT_S:.0f} s after it was scheduled ({states})")
                await terminate_unfinished(handles)
                observed.append((phase, reserved, calls))
        return observed

    observed = asyncio.run(asyncio.wait_for(go(), 110))
    held = [f"{phase}: {reserved:.0f}" for phase, reserved, _ in observed if reserved != 0]
    slow = [f"{phase}: {name}" for phase, _, calls in observed for name, (state, wait, _) in calls.items()
            if state != "started" or wait > START_WITHIN_S]
    assert not held and not slow, (f"idle card reserved bytes before a phase: {held or 'none'}; "
                                   f"calls not started within {START_WITHIN_S} s: {slow or 'none'}")
