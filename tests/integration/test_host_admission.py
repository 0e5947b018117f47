"""The CPU lanes admit by host memory (issue 14) through a real Temporal dev server: on a
small simulated host, a flood of the longest calls the limits allow runs at most as many
at once as the host can hold, none runs out of memory, and the rest wait in Temporal; a
neighbour that takes the host's memory stops admission until it leaves."""

import asyncio
import json
import re
import subprocess
import time
import uuid
from datetime import timedelta

from temporalio.api.enums.v1 import PendingActivityState

from conftest import BIN, minilm_dir, workflow_env

# Small limits keep each call cheap to run here while it is still the longest call the
# worker accepts: 16 texts of 1,200 characters (19,200 of the 20,000 allowed).
LIMITS = ["--max-texts", "16", "--max-total-chars", "20000", "--host-memory-headroom", "0"]
# A real model, so that calls take long enough on the CPU to pile up.
MODEL = ["--model", f"m={minilm_dir()}"]
FITS = 4


def host_numbers() -> dict:
    """The host budget's parts, as `gpulane admission` prints them for these flags."""
    out = subprocess.run(
        [str(BIN), "admission", *MODEL, *LIMITS, "--simulated-host-memory", "1GiB"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    host = next(line for line in out.splitlines() if line.startswith("host simulated "))
    nums = {k: int(v) for k, v in re.findall(r"(\w+_bytes)=(\d+)", host)}
    nums["working"] = int(re.search(r"model m working_set_bytes=(\d+)", out).group(1))
    nums["rows"] = int(re.search(r"activity embed waiting_rows_bytes=(\d+)", out).group(1))
    return nums


def cpu_budget(g) -> dict:
    return next(d for d in g.status("--no-backlog")["devices"] if d["id"] == "cpu")["budget"]


def test_a_flood_of_long_calls_runs_as_many_as_the_host_holds_and_a_neighbour_stops_admission(
    temporal_address, gpulane, tmp_path
):
    n = host_numbers()
    assert n["reserve_bytes"] > 0 and n["weights_bytes"] > 0, n
    # Room for the fixed parts, one working set and FITS calls' inputs, and half a call
    # more: the host admits FITS calls at once, not the 64 --max-concurrent-cpu allows.
    total = n["weights_bytes"] + n["reserve_bytes"] + n["working"] + FITS * n["rows"] + n["rows"] // 2
    mem = tmp_path / "free.json"
    mem.write_text("{}")
    g = gpulane(
        *MODEL, *LIMITS, "--simulated-host-memory", str(total), "--simulated-memory", str(mem),
        "--memory-refresh-ms", "100", "--max-concurrent-cpu", "64",
    )
    long_call = {"texts": [("memory " * 179)[:1200]] * 16}
    flood = 24

    async def go():
        async with workflow_env(temporal_address) as (client, queue):
            async def start(i):
                return await client.start_workflow(
                    "TryOnce", args=["embed", "cpu-tools", long_call, {}],
                    id=f"host-{i}-{uuid.uuid4()}", task_queue=queue,
                    execution_timeout=timedelta(minutes=3),
                )

            handles = [await start(i) for i in range(flood)]
            most, samples = 0, 0
            results = asyncio.gather(*(h.result() for h in handles))
            while not results.done():
                most = max(most, cpu_budget(g)["permits_out"])
                samples += 1
                await asyncio.sleep(0.05)
            flooded = await results
            flood_log = g.log()

            # A neighbour takes all but the weights' worth: no new poll opens. The polls
            # already open (they hold nothing until a task arrives) may still take one
            # call each, which then runs out of (simulated) memory and is retried; every
            # call beyond them waits in Temporal as scheduled. The neighbour leaves, and
            # they all run (EmbedOn retries, as a workflow's default policy does).
            mem.write_text(json.dumps({"host": n["weights_bytes"]}))
            await asyncio.sleep(0.5)
            open_polls = cpu_budget(g)["idle_polls"]
            waiting = [
                await client.start_workflow(
                    "EmbedOn", args=["cpu-tools", long_call],
                    id=f"host-w{i}-{uuid.uuid4()}", task_queue=queue,
                    execution_timeout=timedelta(minutes=3),
                )
                for i in range(open_polls + 3)
            ]
            await asyncio.sleep(2)
            scheduled = 0
            for h in waiting:
                pending = (await h.describe()).raw_description.pending_activities
                scheduled += sum(
                    p.state == PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED for p in pending
                )
            assert scheduled >= 3, f"{scheduled} of {len(waiting)} waiting, {open_polls} polls were open"
            assert cpu_budget(g)["permits_out"] == 0
            mem.write_text("{}")
            after = await asyncio.wait_for(asyncio.gather(*(h.result() for h in waiting)), 120)
            return flooded, flood_log, after, most, samples

    flooded, flood_log, after, most, samples = asyncio.run(go())
    for r in flooded:
        assert "ok" in r, r
        assert len(r["ok"]["embeddings"]) == 16, r
    assert all(len(r["embeddings"]) == 16 for r in after), after
    assert samples >= 3, samples
    assert 1 <= most <= FITS, f"at most {FITS} calls at once on this host, saw {most}"
    assert "out of memory" not in flood_log
    text = g.metrics()
    assert f"gpulane_host_memory_total_bytes {total}" in text, text
    assert "gpulane_host_memory_wait_seconds_total" in text, text
