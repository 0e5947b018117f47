"""Cross-activity batching, heartbeats and cancellation through a real dev server."""

import asyncio
import json
import re
import uuid
from datetime import timedelta

from conftest import cosine_and_max_abs, load_reference, minilm_dir, workflow_env


def test_concurrent_one_text_activities_share_batches_and_keep_their_own_rows(
    temporal_address, gpulane
):
    # A long wait makes the batch deterministic enough to assert on: the workflows below
    # start within it.
    g = gpulane(
        "--model", f"minilm={minilm_dir()}", "--gpus", "none", "--batch-wait-ms", "1500",
        env={"RUST_LOG": "info,gpulane_models=debug"},
    )
    ref = load_reference("minilm")
    texts = ref["texts"][:12]

    async def many():
        async with workflow_env(temporal_address) as (client, queue):
            handles = [
                await client.start_workflow(
                    "EmbedOn", args=["cpu-tools", {"texts": [t]}], id=f"b-{uuid.uuid4()}",
                    task_queue=queue,
                )
                for t in texts
            ]
            return await asyncio.gather(*(h.result() for h in handles))

    results = asyncio.run(many())
    for i, out in enumerate(results):
        assert len(out["embeddings"]) == 1
        cos, max_abs = cosine_and_max_abs(out["embeddings"][0], ref["embeddings"][i])
        assert cos >= 0.9999 and max_abs <= 1e-4, (i, cos, max_abs)
        assert out["usage"]["tokens"] == ref["token_counts"][i]
    calls = [int(c) for c in re.findall(r"calls=(\d+)", g.log())]
    assert calls and max(calls) > 1, f"no batch held two activities: {calls}"

    # The same batches in the engine's Prometheus counters: 12 rows in fewer passes.
    text = g.metrics()

    def counter(name):
        m = re.search(name + r'\{device="cpu",model="minilm"\} ([0-9.e+]+)', text)
        assert m, f"{name} missing:\n{text}"
        return float(m.group(1))

    assert counter("gpulane_batch_rows_total") == 12
    assert counter("gpulane_batch_tokens_total") == sum(ref["token_counts"][:12])
    assert 1 <= counter("gpulane_batches_total") < 12
    assert counter("gpulane_batch_seconds_total") > 0


def test_a_cancelled_long_embed_heartbeats_progress_and_leaves_the_engine(
    temporal_address, gpulane
):
    g = gpulane(
        "--model", f"minilm={minilm_dir()}", "--gpus", "none",
        env={"RUST_LOG": "info,gpulane_models=debug"},
    )
    # The most texts a call takes (1,024) of ~200 words, just under the 1M characters a call
    # takes: ~200k tokens, many seconds of 2-core CPU work. 512 texts of 256 tokens once ran
    # out just before a 6 s cancel on a faster host (no rows left to abandon), so the cancel
    # now comes at 3 s: still after the 1 s heartbeats (a 2 s heartbeat timeout) have shown.
    words = "the quick brown fox jumps over the lazy dog near a quiet river bank "
    texts = [f"{i} " + words * 14 for i in range(1024)]

    async def go():
        async with workflow_env(temporal_address) as (client, queue):
            handle = await client.start_workflow(
                "CancelAfter", args=["cpu-tools", {"texts": texts}, 3.0],
                id=f"c-{uuid.uuid4()}", task_queue=queue,
                execution_timeout=timedelta(seconds=300),
            )
            # While it runs, the activity's heartbeat details count the texts done.
            details = None
            for _ in range(50):
                await asyncio.sleep(0.2)
                desc = await handle.describe()
                pending = desc.raw_description.pending_activities
                if pending and pending[0].heartbeat_details.payloads:
                    details = json.loads(pending[0].heartbeat_details.payloads[0].data)
                    break
            ended = await handle.result()
            again = await client.execute_workflow(
                "EmbedOn", args=["cpu-tools", {"texts": ["still serving"]}],
                id=f"a-{uuid.uuid4()}", task_queue=queue,
            )
            return details, ended, again

    details, ended, again = asyncio.run(go())
    assert details is not None and "done" in details, (details, g.log()[-4000:])
    assert ended == "CancelledError", ended
    assert len(again["embeddings"]) == 1
    log = g.log()
    assert "activity cancelled" in log
    assert "call abandoned; its rows leave the queue" in log
