"""VRAM admission through a real Temporal dev server: a card without free memory takes no
task; the tasks wait in Temporal as backlog and all complete once memory frees."""

import asyncio
import json
import time
import uuid
from datetime import timedelta

from temporalio.api.enums.v1 import PendingActivityState, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

from conftest import FIXTURES, workflow_env

GIB = 1 << 30


async def backlog(client, queue: str) -> int:
    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace="default",
            task_queue=TaskQueue(name=queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            report_stats=True,
        )
    )
    return resp.stats.approximate_backlog_count


def test_full_card_leaves_tasks_scheduled_as_backlog_until_memory_frees(temporal_address, gpulane, tmp_path):
    mem = tmp_path / "free.json"
    mem.write_text(json.dumps({"0": 0}))
    g = gpulane(
        "--model", str(FIXTURES / "tiny-bert-cls"),
        "--simulate-gpus", "1x8GiB", "--simulated-memory", str(mem), "--memory-refresh-ms", "100",
    )
    n = 5

    async def go():
        async with workflow_env(temporal_address) as (client, queue):
            handles = [
                await client.start_workflow(
                    "EmbedOn", args=["gpu-tools", {"texts": [f"queued text {i}"]}],
                    id=f"adm-{uuid.uuid4()}", task_queue=queue,
                    execution_timeout=timedelta(minutes=3),
                )
                for i in range(n)
            ]
            # Temporal holds them: every activity SCHEDULED, none STARTED, all in backlog.
            deadline = time.monotonic() + 30
            while (seen := await backlog(client, "gpu-tools")) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert seen >= n, f"backlog {seen}, expected {n}"
            await asyncio.sleep(2)  # several refresh intervals with the card still full
            for h in handles:
                desc = await h.describe()
                pending = desc.raw_description.pending_activities
                assert len(pending) == 1, pending
                assert pending[0].state == PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED, pending[0]
            text = g.metrics()
            assert 'gpulane_gpu_memory_free_bytes{gpu_uuid="GPU-SIM-t-0"} 0' in text, text
            assert 'gpulane_permits_issued_total{gpu_uuid="GPU-SIM-t-0"' not in text, text

            # Another tenant leaves: the card frees, the worker polls, nothing is lost.
            mem.write_text(json.dumps({"0": 8 * GIB}))
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)
            return results

    results = asyncio.run(go())
    assert len(results) == n
    for r in results:
        assert r["device"]["uuid"] == "GPU-SIM-t-0" and len(r["embeddings"]) == 1
    text = g.metrics()
    assert 'gpulane_permits_used_total{activity_type="embed",gpu_uuid="GPU-SIM-t-0",task_queue="gpu-tools"} 5' in text, text
    assert "gpulane_memory_wait_seconds_total" in text


def test_a_simulated_card_holds_what_its_engines_hold_and_a_pass_past_its_total_is_an_oom(
    temporal_address, gpulane
):
    """The simulated card follows its engines: the weights are held from load, each pass's
    working set while it runs. With a working-set override far below what a pass really
    takes (`--vram-cost`), admission lets a call in that the card cannot hold: the pass
    fails as the retryable GpuOutOfMemory, as CUDA's would, the model's estimate is raised
    and the worker keeps serving calls that fit."""
    g = gpulane(
        "--model", f"tiny={FIXTURES / 'tiny-bert-cls'}",
        "--simulate-gpus", "1x12MiB", "--vram-cost", "tiny=1MiB", "--vram-headroom", "0",
    )
    card = "GPU-SIM-t-0"

    async def go():
        async with workflow_env(temporal_address) as (client, queue):
            async def once(texts):
                return await client.execute_workflow(
                    "TryOnce", args=["embed", "gpu-tools", {"texts": texts}, {}],
                    id=f"sim-{uuid.uuid4()}", task_queue=queue,
                    execution_timeout=timedelta(minutes=2),
                )
            big = await once([" ".join(["word"] * 120)] * 64)
            small = await once(["a short text"])
            return big, small

    big, small = asyncio.run(go())
    assert "error" in big, big
    assert big["error"]["type"] == "GpuOutOfMemory" and big["error"]["non_retryable"] is False, big
    assert f"simulated card {card} out of memory" in big["error"]["message"], big
    assert "ok" in small and small["ok"]["device"]["uuid"] == card, small
    text = g.metrics()
    assert f'gpulane_gpu_out_of_memory_total{{activity_type="embed",gpu_uuid="{card}"}} 1' in text, text
    assert "raising the working-set estimate" in g.log()
    status = g.status("--no-backlog")
    budget = status["devices"][0]["budget"]
    assert budget["working_set_bytes"]["tiny"] > 1 << 20, budget
    assert budget["estimates_bytes"]["embed"] == budget["working_set_bytes"]["tiny"], budget
    assert budget["weights_bytes"] > 0, budget
