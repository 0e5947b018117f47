"""(b) The Temporal server killed and restarted (same ports, same database) mid-load: the
worker keeps running, is ready again once the server answers, and every workflow
completes."""

import asyncio
import os
import signal
import time

import pytest

from chaos_load import Tracker, bad_shapes, pending_states, start_many, summaries, terminate_unfinished
from conftest import ReadyzWatcher, model_args, workflow_env

N = 100
OPTIONS = {"start_to_close_s": 30, "heartbeat_s": 5, "retry_initial_s": 1, "retry_max_s": 5}
READY_AGAIN_S = 60
# How long the server stays down: longer than the worker's 5 s readiness check and the
# client's ~10 s of retries, as a real restart (a deploy, a failover) would be.
DOWN_S = float(os.environ.get("CHAOS_SERVER_DOWN_S", "15"))


@pytest.mark.bound(420)
def test_b_temporal_server_restart_mid_load(exp, server, workers):
    exp.expect(
        f"{N} workflows (embed on gpu-tools, heartbeat 5 s, retried) on one worker; the dev server "
        f"SIGKILLed at ~1/3 done, left down {DOWN_S:.0f} s, and started again on the same ports and db: the worker process keeps "
        f"running, /readyz is 200 again within {READY_AGAIN_S} s of the server answering, all {N} complete")
    w = workers(*model_args(), "--simulate-gpus", "1x16GiB", name="w1")
    w.expected_exit = 0

    async def go():
        async with workflow_env(server.address) as (client, wf_queue):
            t0 = time.monotonic()
            started = await start_many(client, wf_queue, N, "gpu-tools", OPTIONS, "restart")
            exp.see(f"{N} workflows started in {time.monotonic() - t0:.1f} s")
            tracker = Tracker(started, time.monotonic() + 300)
            try:
                with ReadyzWatcher(w, period=0.2) as watch:
                    assert await tracker.until(N // 3, 120), f"only {tracker.done}/{N} done after 120 s"
                    done_at = tracker.done
                    t_kill = time.monotonic()
                    times = await asyncio.to_thread(server.restart, signal.SIGKILL, DOWN_S)
                    t_back = time.monotonic()
                    exp.see(f"server SIGKILLed at {done_at}/{N} done; answering again after "
                            f"{t_back - t_kill:.1f} s (start took {times['start_s']:.1f} s)")
                    # Ready again?
                    ready_again = None
                    deadline = t_back + READY_AGAIN_S
                    while time.monotonic() < deadline:
                        if w.proc.poll() is not None:
                            break
                        after = [(t, c) for t, c in watch.seen if t >= t_back]
                        if after and after[-1][1] == 200:
                            ready_again = after[-1][0]
                            break
                        await asyncio.sleep(0.2)
                    finished = await tracker.all(180)
                    seen = list(watch.seen)
                not_ready = [t for t, c in seen if t >= t_kill and c != 200]
                alive = w.proc.poll() is None
                if ready_again is not None:
                    first = f"+{not_ready[0] - t_kill:.1f} s after the kill" if not_ready else "never seen (always 200)"
                    exp.see(f"worker alive: {alive}; /readyz first not 200 {first}, 200 again "
                            f"{ready_again - t_back:.1f} s after the server answered")
                else:
                    tail = [c for _, c in seen[-5:]]
                    exp.see(f"worker alive: {alive} (exit {w.proc.returncode}); /readyz not 200 again within "
                            f"{READY_AGAIN_S} s of the server answering (last: {tail})")
                if finished < N:
                    states = await pending_states([h for (h, _), r, e in zip(started, tracker.results, tracker.errors)
                                                   if r is None and e is None])
                    exp.see(f"only {finished}/{N} finished within 180 s after the restart; pending: {dict(states)}")
                    await terminate_unfinished([h for h, _ in started])
                else:
                    exp.see(f"all {N} finished {time.monotonic() - t_back:.1f} s after the restart")
                sums = await summaries([h for h, _ in started])
                return started, tracker, sums, alive, ready_again
            finally:
                tracker.cancel()

    started, tracker, sums, alive, ready_again = asyncio.run(asyncio.wait_for(go(), 400))
    ok = tracker.ok()
    errors = [repr(e)[:200] for e in tracker.errors if e is not None]
    shapes = bad_shapes(started, tracker.results)
    retried = sum(1 for s in sums if (s["attempt"] or 1) > 1)
    doubles = sum(1 for s in sums if s["completed"] != 1)
    exp.see(f"{ok}/{N} completed; retried (attempt > 1): {retried}; histories without exactly one "
            f"ActivityTaskCompleted: {doubles}; wrong shapes: {len(shapes)}; workflow errors: {len(errors)}"
            f"{(' e.g. ' + errors[0]) if errors else ''}")
    assert alive, f"the worker exited {w.proc.returncode}:\n{w.log()[-3000:]}"
    assert ready_again is not None, f"/readyz never 200 again:\n{w.log()[-3000:]}"
    assert ok == N, errors[:3]
    assert not shapes and doubles == 0
