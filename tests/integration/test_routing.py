"""The capability contract with two workers that serve different models: routed by model
queue (`cpu-tools@<model>`), every task reaches a worker with its model; on the shared
queue, a task that lands on the wrong worker is handed back retryably and completes on
the other. No workflow fails on a model it was never meant to reach."""

import asyncio
import re
import uuid
from datetime import timedelta

from conftest import FIXTURES, assert_vectors_close, load_reference, workflow_env
from test_rerank import call_once


def run_all(address, runs, workers=()):
    """runs: [(workflow, args)]; returns their results in order. On a timeout, says where
    each activity stands and what the workers logged."""

    async def go():
        async with workflow_env(address) as (client, wf_queue):
            handles = [
                await client.start_workflow(
                    wf, args=args, id=f"route-{uuid.uuid4()}", task_queue=wf_queue,
                    execution_timeout=timedelta(minutes=3),
                )
                for wf, args in runs
            ]
            try:
                return await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)
            except asyncio.TimeoutError:
                pending = [(await h.describe()).raw_description.pending_activities for h in handles]
                logs = "".join(f"\n--- {g.host}:\n{g.log()[-4000:]}" for g in workers)
                raise AssertionError(f"{pending}{logs}")

    return asyncio.run(go())


def not_served(g):
    m = re.search(r'^gpulane_model_not_served_total\{task_queue="cpu-tools"\} (\S+)$', g.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def test_two_workers_with_different_models_serve_every_workflow(temporal_address, gpulane):
    bert = gpulane("--gpus", "none", "--model-queues", "--model", f"bert={FIXTURES / 'tiny-bert-cls'}")
    refs = {"bert": load_reference("tiny-bert-cls"), "xlmr": load_reference("tiny-xlmr-mean")}

    async def shared_then_second_worker():
        # On the shared queue, naming a model the only worker there lacks: the task is
        # handed back (retryable ModelNotServed) until a worker that has it arrives.
        async with workflow_env(temporal_address) as (client, wf_queue):
            handles = [
                await client.start_workflow(
                    "Try", args=["embed", "cpu-tools", {"texts": refs["xlmr"]["texts"], "model": "xlmr"}],
                    id=f"route-{uuid.uuid4()}", task_queue=wf_queue,
                    execution_timeout=timedelta(minutes=3),
                )
                for _ in range(3)
            ]
            deadline = asyncio.get_running_loop().time() + 30
            while not_served(bert) < 3:
                assert asyncio.get_running_loop().time() < deadline, bert.log()[-3000:]
                await asyncio.sleep(0.3)
            xlmr = await asyncio.to_thread(
                gpulane, "--gpus", "none", "--model-queues", "--model", f"xlmr={FIXTURES / 'tiny-xlmr-mean'}"
            )
            try:
                outs = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)
            except asyncio.TimeoutError:
                pending = [(await h.describe()).raw_description.pending_activities for h in handles]
                raise AssertionError(f"{pending}\n--- bert:\n{bert.log()[-3000:]}\n--- xlmr:\n{xlmr.log()[-3000:]}")
            return xlmr, outs

    xlmr, outs = asyncio.run(shared_then_second_worker())
    for out in outs:
        assert "ok" in out, out
        assert out["ok"]["model"] == "xlmr" and out["ok"]["host_task_queue"] == f"cpu-tools.{xlmr.host}"
        assert_vectors_close(out["ok"]["embeddings"], refs["xlmr"]["embeddings"], "xlmr")

    hosts = {"bert": f"cpu-tools.{bert.host}", "xlmr": f"cpu-tools.{xlmr.host}"}
    for g in (bert, xlmr):
        lanes = [l["task_queue"] for l in g.status("--no-backlog")["lanes"]]
        assert any(q.startswith("cpu-tools@") for q in lanes), lanes

    # By model queue: only workers that serve the model poll it, so every task lands on
    # one that has it. "model" may be omitted there.
    runs = []
    for model in ("bert", "xlmr"):
        for i in range(6):
            payload = {"texts": refs[model]["texts"]}
            if i % 2:
                payload["model"] = model
            runs.append(("EmbedOn", [f"cpu-tools@{model}", payload]))
    for (_, args), out in zip(runs, run_all(temporal_address, runs, (bert, xlmr))):
        model = args[0].split("@")[1]
        assert out["model"] == model and out["host_task_queue"] == hosts[model], out["host_task_queue"]
        assert_vectors_close(out["embeddings"], refs[model]["embeddings"], model)

    # Both workers on the shared queue, each model named: every workflow completes.
    runs = [("Try", ["embed", "cpu-tools", {"texts": ["shared"], "model": m}])
            for m in ("bert", "xlmr") for _ in range(4)]
    for (_, args), out in zip(runs, run_all(temporal_address, runs, (bert, xlmr))):
        assert "ok" in out and out["ok"]["model"] == args[2]["model"], out

    # A model queue's task that names another model is the workflow's mistake: final.
    err = call_once(temporal_address, "embed", "cpu-tools@bert", {"texts": ["x"], "model": "xlmr"})["error"]
    assert err["type"] == "InvalidInput" and err["non_retryable"], err
    assert "cpu-tools@bert" in err["message"], err
