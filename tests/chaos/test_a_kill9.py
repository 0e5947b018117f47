"""(a) kill -9 of one of two workers mid-load: every workflow still completes, with the
right shape, and no activity completes twice."""

import asyncio
import collections
import time

import pytest

from chaos_load import Tracker, bad_shapes, pending_states, start_many, summaries, terminate_unfinished
from conftest import EMBED_DIMENSIONS, model_args, workflow_env

N = 200
OPTIONS = {"start_to_close_s": 60, "heartbeat_s": 5, "retry_initial_s": 1, "retry_max_s": 5}


@pytest.mark.bound(420)
def test_a_kill9_one_of_two_workers_mid_load(exp, server, workers):
    exp.expect(
        f"{N} workflows (embed of 64 texts on gpu-tools, heartbeat_timeout 5 s, retried) over two "
        f"workers (1x16GiB simulated each); SIGKILL of one at ~1/3 done: all {N} complete, each "
        f"result {64} vectors of {EMBED_DIMENSIONS} floats, and every history has exactly one "
        f"ActivityTaskCompleted")
    ws = [workers(*model_args(), "--simulate-gpus", "1x16GiB", name=f"w{i}") for i in (1, 2)]
    by_host = {w.host: w for w in ws}

    async def go():
        async with workflow_env(server.address) as (client, wf_queue):
            t0 = time.monotonic()
            started = await start_many(client, wf_queue, N, "gpu-tools", OPTIONS, "kill9")
            exp.see(f"{N} workflows started in {time.monotonic() - t0:.1f} s")
            tracker = Tracker(started, time.monotonic() + 300)
            try:
                assert await tracker.until(N // 3, 120), f"only {tracker.done}/{N} done after 120 s"
                served = tracker.served_by()
                victim = max(ws, key=lambda w: served[w.host])
                running = sum(l["running"] for l in victim.status("--no-backlog")["lanes"])
                done_at_kill = tracker.done
                victim.kill9()
                t_kill = time.monotonic()
                exp.see(f"SIGKILL {victim.name} at {done_at_kill}/{N} done "
                        f"(it had served {served[victim.host]}, {running} running)")
                finished = await tracker.all(240)
                took = time.monotonic() - t_kill
                if finished < N:
                    states = await pending_states([h for (h, _), r, e in zip(started, tracker.results, tracker.errors)
                                                   if r is None and e is None])
                    exp.see(f"only {finished}/{N} finished within 240 s of the kill; pending: {dict(states)}")
                    await terminate_unfinished([h for h, _ in started])
                    tracker.cancel()
                else:
                    exp.see(f"all {N} finished {took:.1f} s after the kill ({time.monotonic() - t0:.1f} s in all)")
                sums = await summaries([h for h, _ in started])
                return started, tracker, sums, victim, done_at_kill
            finally:
                tracker.cancel()

    started, tracker, sums, victim, done_at_kill = asyncio.run(asyncio.wait_for(go(), 400))

    errors = [repr(e)[:200] for e in tracker.errors if e is not None]
    ok = tracker.ok()
    shapes = bad_shapes(started, tracker.results)
    completed_counts = collections.Counter(s["completed"] for s in sums)
    retried = sum(1 for s in sums if (s["attempt"] or 1) > 1)
    served = collections.Counter()
    for r in tracker.results:
        if r is not None:
            host = r["host_task_queue"].split(".")[1]
            served[by_host[host].name if host in by_host else host] += 1
    exp.see(f"{ok}/{N} completed; served by " + ", ".join(f"{h}: {n}" for h, n in served.items())
            + f"; ActivityTaskCompleted per history: {dict(completed_counts)}; "
            f"retried after the kill (attempt > 1): {retried}; wrong shapes: {len(shapes)}; "
            f"workflow errors: {len(errors)}{(' e.g. ' + errors[0]) if errors else ''}")
    assert victim.proc.poll() is not None, "the killed worker still runs"
    assert ok == N, f"{ok}/{N} completed: {errors[:3]}"
    assert not shapes, f"wrong shapes in workflows {shapes[:10]}"
    assert completed_counts == {1: N}, dict(completed_counts)
