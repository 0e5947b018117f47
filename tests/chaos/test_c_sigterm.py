"""(c) SIGTERM of one of two workers mid-load, with activities that have no heartbeat
timeout (as the README's example): every workflow completes soon after the signal (none
waits out its 2-minute start-to-close timeout) and the stopped worker exits 0."""

import asyncio
import collections
import signal
import time

import pytest

from chaos_load import Tracker, bad_shapes, pending_states, start_many, summaries, terminate_unfinished
from conftest import model_args, workflow_env

N = 60
TEXTS_PER_CALL = 256  # about a quarter of a second of work per call, so calls are running at the signal
WITHIN_S = 30
EXIT_WITHIN_S = 60  # drain window (1 s) + grace (30 s) + the stop's own 15 s deadline, and slack
OPTIONS = {"start_to_close_s": 120, "retry_initial_s": 1, "retry_max_s": 5}


@pytest.mark.fast
@pytest.mark.bound(240)
def test_c_sigterm_one_of_two_workers_mid_load(exp, server, workers):
    exp.expect(
        f"{N} workflows (embed of {TEXTS_PER_CALL} texts on gpu-tools, start_to_close 2 min, no heartbeat timeout) over two "
        f"workers; SIGTERM of one mid-load, while it runs activities: all {N} complete within {WITHIN_S} s of the signal, "
        f"no activity times out, and the stopped worker exits 0")
    ws = [workers(*model_args(), "--simulate-gpus", "1x16GiB", name=f"w{i}") for i in (1, 2)]
    by_host = {w.host: w for w in ws}

    async def go():
        async with workflow_env(server.address) as (client, wf_queue):
            t0 = time.monotonic()
            started = await start_many(client, wf_queue, N, "gpu-tools", OPTIONS, "term",
                                       texts_per_call=TEXTS_PER_CALL)
            exp.see(f"{N} workflows started in {time.monotonic() - t0:.1f} s")
            tracker = Tracker(started, time.monotonic() + 200)
            try:
                assert await tracker.until(N // 3, 90), f"only {tracker.done}/{N} done after 90 s"
                served = tracker.served_by()
                victim = max(ws, key=lambda w: served[w.host])
                victim.expected_exit = None  # judged here
                # Signal it while it runs something, so the drain has work in hand.
                deadline = time.monotonic() + 10
                while True:
                    running = sum(l["running"] for l in victim.status("--no-backlog")["lanes"])
                    if running or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                done_at = tracker.done
                victim.signal(signal.SIGTERM)
                t_sig = time.monotonic()

                def wait_exit():
                    code = victim.wait_exit(EXIT_WITHIN_S)
                    return code, time.monotonic() - t_sig

                exit_task = asyncio.ensure_future(asyncio.to_thread(wait_exit))
                exp.see(f"SIGTERM {victim.name} at {done_at}/{N} done (it had served {served[victim.host]}, "
                        f"{running} running)")
                finished = await tracker.all(WITHIN_S)
                last = max((t for t in tracker.finished_at if t is not None), default=t_sig) - t_sig
                if finished < N:
                    waiting = [h for (h, _), t in zip(started, tracker.finished_at) if t is None]
                    states = await pending_states(waiting)
                    exp.see(f"only {finished}/{N} finished within {WITHIN_S} s of the SIGTERM; "
                            f"the rest: {dict(states)}")
                    await terminate_unfinished(waiting)
                else:
                    exp.see(f"all {N} finished, the last {last:.1f} s after the SIGTERM")
                code, exit_s = await exit_task
                exp.see(f"{victim.name} exited {code} {exit_s:.1f} s after the SIGTERM"
                        if code is not None else f"{victim.name} still running {EXIT_WITHIN_S} s after the SIGTERM")
                sums = await summaries([h for h, _ in started])
                return started, tracker, sums, victim, code, finished
            finally:
                tracker.cancel()

    started, tracker, sums, victim, code, finished = asyncio.run(asyncio.wait_for(go(), 220))
    ok = tracker.ok()
    shapes = bad_shapes(started, tracker.results)
    timed_out = sum(s["timed_out"] for s in sums)
    retried = sum(1 for s in sums if (s["attempt"] or 1) > 1)
    served = collections.Counter()
    for r in tracker.results:
        if r is not None:
            host = r["host_task_queue"].split(".")[1]
            served[by_host[host].name if host in by_host else host] += 1
    exp.see(f"{ok}/{N} completed; served by " + ", ".join(f"{h}: {n}" for h, n in sorted(served.items()))
            + f"; activity timeouts in histories: {timed_out}; retried (attempt > 1): {retried}; "
            f"wrong shapes: {len(shapes)}")
    assert finished == N and ok == N, f"{ok}/{N} completed within {WITHIN_S} s of the SIGTERM"
    assert timed_out == 0
    assert not shapes
    assert code == 0, f"{victim.name} exited {code}:\n{victim.log()[-3000:]}"
