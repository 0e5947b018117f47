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
            assert 'gpulane_gpu_memory_free_bytes{gpu_uuid="GPU-SIM-0"} 0' in text, text
            assert 'gpulane_permits_issued_total{gpu_uuid="GPU-SIM-0"' not in text, text

            # Another tenant leaves: the card frees, the worker polls, nothing is lost.
            mem.write_text(json.dumps({"0": 8 * GIB}))
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)
            return results

    results = asyncio.run(go())
    assert len(results) == n
    for r in results:
        assert r["device"]["uuid"] == "GPU-SIM-0" and len(r["embeddings"]) == 1
    text = g.metrics()
    assert 'gpulane_permits_used_total{activity_type="embed",gpu_uuid="GPU-SIM-0",task_queue="gpu-tools"} 5' in text, text
    assert "gpulane_memory_wait_seconds_total" in text
