"""(f) Two workers that would poll the same private queue: a second worker with the same
host name and the same simulated card ids must refuse to start (naming the queue and who
polls it), leaving the first serving its pinned calls alone; a third with the same host
but no simulated id gets card ids of its own and serves its own private queue."""

import asyncio
import signal
import time
import uuid
from datetime import timedelta

import pytest

from conftest import history_summary, model_args, workflow_env

HOST = "chaos-same"
SIM_ID = "x"
EXIT_WITHIN_S = 30
PINNED_CALLS = 20


def pinned_calls(address, queue, n, tag):
    """n one-text embeds on `queue`, one attempt each; returns [(result or None, history)]."""

    async def go():
        async with workflow_env(address) as (client, wf_queue):
            run = uuid.uuid4().hex[:6]
            handles = [
                await client.start_workflow(
                    "ChaosEmbed", args=[queue, {"texts": [f"{tag} pinned {i}"]},
                                        {"start_to_close_s": 30, "schedule_to_start_s": 20, "maximum_attempts": 1}],
                    id=f"{tag}-{run}-{i:02d}", task_queue=wf_queue, execution_timeout=timedelta(seconds=60),
                )
                for i in range(n)
            ]
            results = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
            hist = await asyncio.gather(*(history_summary(h) for h in handles))
            return [(None if isinstance(r, BaseException) else r, h) for r, h in zip(results, hist)]

    return asyncio.run(asyncio.wait_for(go(), 90))


def served_by(calls, identity, card):
    """How many calls were served by the worker with `identity` on `card`."""
    return sum(1 for r, h in calls
               if r is not None and r["device"]["uuid"] == card and (h["identity"] or "").startswith(identity + "/"))


@pytest.mark.fast
@pytest.mark.bound(200)
def test_f_same_host_collision(exp, server, workers):
    exp.expect(
        f"A (GPULANE_HOST={HOST}, GPULANE_SIMULATED_ID={SIM_ID}) serves; B with the same host and simulated "
        f"id exits non-zero within {EXIT_WITHIN_S} s, its log naming A's private queue, 'already polled by' "
        f"and A's identity; A keeps serving: {PINNED_CALLS} pinned calls all served by A (result device uuid, "
        f"ActivityTaskStarted identity); C with the same host and no simulated id starts, its card uuids differ "
        f"from A's, and it serves its own private queue")
    sim = ["--simulate-gpus", "1x16GiB"]
    a = workers(*model_args(), *sim, host=HOST, env={"GPULANE_SIMULATED_ID": SIM_ID}, name="A")
    a_identity = a.identity()
    a_cards = a.devices()
    a_queue = a.private_queues()[a_cards[0]]
    exp.see(f"A ready: identity {a_identity}, cards {a_cards}, private queue {a_queue}")

    t0 = time.monotonic()
    b = workers(*model_args(), *sim, host=HOST, env={"GPULANE_SIMULATED_ID": SIM_ID}, name="B", wait_ready=False)
    b.expected_exit = None
    code = b.wait_exit(EXIT_WITHIN_S)
    refusal = [line for line in b.log().splitlines() if "already polled by" in line]
    mentions = {"'already polled by'": bool(refusal),
                "the queue (on that line)": any(a_queue in line for line in refusal),
                "A's identity (on that line)": any(a_identity in line for line in refusal)}
    if code is None:
        exp.see(f"B still running {EXIT_WITHIN_S} s after its start (ready: {'gpulane ready' in b.log()})")
    else:
        exp.see(f"B exited {code} after {time.monotonic() - t0:.1f} s")
    exp.see("B's log names " + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in mentions.items()))
    if refusal:
        exp.see(f"B's refusal: {refusal[0].strip()[:300]}")

    calls = pinned_calls(server.address, a_queue, PINNED_CALLS, "a")
    by_a = served_by(calls, a_identity, a_cards[0])
    failed = sum(1 for r, _ in calls if r is None)
    others = sorted({h["identity"].split("/")[0] for r, h in calls
                     if r is not None and not (h["identity"] or "").startswith(a_identity + "/")})
    exp.see(f"{by_a}/{PINNED_CALLS} pinned calls to {a_queue} served by A"
            + (f"; {failed} failed" if failed else "")
            + (f"; others served by {others}" if others else "")
            + f"; A {'running' if a.proc.poll() is None else f'exited {a.proc.returncode}'}")

    if b.proc.poll() is None:  # out of the way before C, so C's check is about C alone
        b.signal(signal.SIGTERM)
        b.wait_exit(60)

    c_cards, c_queue, c_by_c, c_error = [], None, 0, None
    try:
        c = workers(*model_args(), *sim, host=HOST, env={"GPULANE_SIMULATED_ID": None}, name="C",
                    ready_timeout=60)
        c_identity = c.identity()
        c_cards = c.devices()
        c_queue = c.private_queues()[c_cards[0]]
        exp.see(f"C ready: cards {c_cards}, private queue {c_queue}")
        c_calls = pinned_calls(server.address, c_queue, 5, "c")
        c_by_c = served_by(c_calls, c_identity, c_cards[0])
        exp.see(f"{c_by_c}/5 pinned calls to C's queue served by C")
    except Exception as e:  # noqa: BLE001 - reported as what was seen
        c_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        exp.see(f"C did not start/serve: {c_error}")

    assert code is not None and code != 0, f"B exit status {code} (None: still running)"
    assert all(mentions.values()), mentions
    assert by_a == PINNED_CALLS and a.proc.poll() is None, f"{by_a}/{PINNED_CALLS} served by A"
    assert c_error is None, c_error
    assert c_cards and not set(c_cards) & set(a_cards), f"C's cards {c_cards} vs A's {a_cards}"
    assert c_by_c == 5
