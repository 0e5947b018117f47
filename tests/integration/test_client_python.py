"""The Python client package (clients/python, installed into the venv by scripts/setup.sh
like any user would install it) against the dev server and real gpulane workers: card
sessions, the sequence restarted after a card is killed, the CPU fallback, typed results
and typed errors, the sharded dataset job, and the contract it shares with the worker."""

import asyncio
import dataclasses
import datetime
import importlib.metadata
import json
import pathlib
import signal
import subprocess
import time
import uuid

import pytest

import gpulane as gl
from gpulane.dataset import gather_manifests, start_embed_dataset

from conftest import BIN, FIXTURES, ROOT, assert_vectors_close, load_reference, minilm_dir


def schema() -> dict:
    return json.loads(subprocess.run([str(BIN), "schema"], capture_output=True, text=True,
                                     check=True).stdout)


async def client_and_worker(address):
    from temporalio.client import Client
    from temporalio.worker import Worker

    import client_workflows

    client = await Client.connect(address)
    queue = f"cwf-{uuid.uuid4().hex[:8]}"
    return client, Worker(client, task_queue=queue, workflows=client_workflows.ALL), queue


def run(address, workflow, *args, timeout=180):
    async def go():
        client, worker, queue = await client_and_worker(address)
        async with worker:
            return await client.execute_workflow(
                workflow, args=list(args), id=f"c-{uuid.uuid4()}", task_queue=queue,
                execution_timeout=datetime.timedelta(seconds=timeout))

    return asyncio.run(go())


def test_the_tests_use_the_installed_package_of_the_binarys_version():
    path = pathlib.Path(gl.__file__).resolve()
    assert "site-packages" in path.parts, path
    assert ROOT / "clients" not in path.parents, path
    binary = subprocess.run([str(BIN), "--version"], capture_output=True, text=True,
                            check=True).stdout.split()[1]
    assert gl.__version__ == importlib.metadata.version("gpulane") == binary


def test_names_follow_the_workers_rules():
    s = schema()
    q = s["queues"]
    assert (gl.GPU_TOOLS, gl.CPU_TOOLS) == (q["gpu_tools"], q["cpu_tools"])
    assert gl.QUEUE_PREFIX_SEPARATOR == q["queue_prefix_separator"]
    assert gl.MODEL_QUEUE_SEPARATOR == q["model_queue_separator"]
    assert gl.MODEL_NAME_MAX == q["model_name_max"]
    for ex in q["examples"]["hosts"]:
        assert gl.sanitize_host(ex["host"]) == ex["sanitized"], ex
        assert gl.cpu_host_queue(ex["host"]) == ex["cpu_host_queue"], ex
        assert gl.gpu_card_queue(ex["host"], ex["gpu_uuid"]) == ex["gpu_card_queue"], ex
    for ex in q["examples"]["model_names"]:
        assert gl.valid_model_name(ex["name"]) == ex["valid"], ex
    mq = q["examples"]["model_queue"]
    assert gl.model_queue(mq["shared"], mq["model"]) == mq["queue"]
    assert set(s["activities"]) == {gl.Activity.EMBED, gl.Activity.RERANK,
                                    gl.Activity.EMBED_DATASET}
    assert gl.Failure.ALL == set(s["failures"])
    assert gl.Failure.RETRIED == {k for k, v in s["failures"].items() if v["retried"]}
    for name in s["failures"]:
        assert gl.BY_TYPE[name].TYPE == name


def test_dataclasses_match_the_schema():
    defs = schema()["$defs"]
    for cls in (gl.EmbedRequest, gl.EmbedResponse, gl.DeviceInfo, gl.Usage,
                gl.RerankRequest, gl.RerankResult, gl.RerankResponse,
                gl.EmbedDatasetRequest, gl.Shard, gl.RowRange, gl.PartRef,
                gl.Manifest):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields == set(defs[cls.__name__]["properties"]), cls.__name__
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        assert required == set(defs[cls.__name__].get("required", [])), cls.__name__


def two_cards_and_a_cpu(gpulane_fixture):
    """Two workers with one simulated card each (so one can be killed alone), and the CPU
    lane in a third."""
    model = ("--model", str(minilm_dir()))
    a = gpulane_fixture(*model, "--simulate-gpus", "1x16GiB", "--cpu-lane", "off",
                        env={"GPULANE_SIMULATED_ID": "a"})
    b = gpulane_fixture(*model, "--simulate-gpus", "1x16GiB", "--cpu-lane", "off",
                        env={"GPULANE_SIMULATED_ID": "b"})
    c = gpulane_fixture(*model, "--gpus", "none")
    return a, b, c


def test_a_card_session_keeps_ten_follow_ups_on_one_card(temporal_address, gpulane):
    a, b, _ = two_cards_and_a_cpu(gpulane)
    out = run(temporal_address, "SessionSequence", 10, 0.0, 30.0)
    assert out["attempts"] == 1
    assert len(out["queues"]) == 11 and len(set(out["queues"])) == 1, out
    (queue,) = set(out["queues"])
    assert queue in {gl.gpu_card_queue(w.host, f"GPU-SIM-{n}-0")
                     for w, n in ((a, "a"), (b, "b"))}, queue


def test_killing_the_pinned_card_restarts_the_whole_sequence_elsewhere(temporal_address, gpulane):
    workers = two_cards_and_a_cpu(gpulane)
    a, b, _ = workers

    async def go():
        client, worker, queue = await client_and_worker(temporal_address)
        async with worker:
            handle = await client.start_workflow(
                "SessionSequence", args=[10, 1.0, 3.0], id=f"kill-{uuid.uuid4()}",
                task_queue=queue, execution_timeout=datetime.timedelta(minutes=3))
            deadline = time.monotonic() + 60
            while True:
                p = await handle.query("progress")
                if p["done"] >= 3:
                    break
                assert time.monotonic() < deadline, p
                await asyncio.sleep(0.1)
            pinned = p["pinned"]
            (victim,) = [w for w in (a, b) if f".{w.host}." in pinned]
            victim.expected_exit = None
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            return pinned, await handle.result()

    pinned, out = asyncio.run(go())
    assert out["attempts"] == 2, out
    # The second attempt ran the whole sequence again, all of it on one card that is up.
    assert len(out["queues"]) == 11 and len(set(out["queues"])) == 1, out
    assert out["queues"][0] != pinned, (pinned, out)


def test_embed_falls_back_to_the_cpu_lane_when_no_card_has_memory(temporal_address, gpulane,
                                                                  tmp_path):
    mem = tmp_path / "memory.json"
    mem.write_text(json.dumps({"0": 0, "1": 0}))
    gpulane("--model", str(minilm_dir()), "--simulate-gpus", "2x16GiB", "--simulated-memory",
            str(mem), "--memory-refresh-ms", "100", "--cpu-lane", "on")
    out = run(temporal_address, "FallbackEmbed", ["no card has room"], 3.0)
    assert out["device_kind"] == "cpu", out
    assert out["host_task_queue"].startswith("cpu-tools."), out
    assert out["waited_s"] >= 3.0, out


def test_typed_results_round_trip(temporal_address, gpulane):
    gpulane("--model", f"minilm={minilm_dir()}",
            "--model", f"ce={FIXTURES / 'tiny-cross-encoder'}", "--simulate-gpus", "1x16GiB")
    ref = load_reference("minilm")
    docs = ["a cat sat on the mat", "stock markets fell", "the kitten slept"]
    out = run(temporal_address, "TypedRoundTrip", ref["texts"], "where is the cat", docs)
    assert (out["embed_type"], out["device_type"], out["usage_type"], out["result_type"]) == (
        "EmbedResponse", "DeviceInfo", "Usage", "RerankResult")
    assert_vectors_close(out["embeddings"], ref["embeddings"], "minilm via gl.workflow")
    assert (out["model"], out["dimensions"], out["dtype"], out["family"]) == (
        "minilm", 384, "f32", "bert")
    assert out["revision"].startswith("sha256:")
    assert out["device_kind"] == "gpu" and out["host_task_queue"].startswith("gpu-tools.")
    assert out["tokens"] == sum(ref["token_counts"])
    assert out["rerank_model"] == "ce"
    scores = [r["score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True)
    assert sorted(r["index"] for r in out["results"]) == [0, 1, 2]
    assert all(r["document"] == docs[r["index"]] for r in out["results"])


def test_bad_input_is_a_typed_non_retryable_error(temporal_address, gpulane):
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import ApplicationError

    gpulane("--model", str(minilm_dir()), "--gpus", "none")
    caught = run(temporal_address, "BadInput", True)
    assert caught["class"] == "InvalidInput" and caught["is_gpulane_error"], caught
    assert (caught["type"], caught["non_retryable"]) == ("InvalidInput", True), caught
    assert "texts" in caught["message"], caught

    with pytest.raises(WorkflowFailureError) as info:
        run(temporal_address, "BadInput", False)
    cause = info.value.cause
    assert isinstance(cause, ApplicationError), cause
    assert (cause.type, cause.non_retryable) == ("InvalidInput", True), cause


def test_a_bad_dataset_job_fails_its_workflow_with_invalid_input(temporal_address):
    """Bad job fields fail the workflow at once, typed, instead of failing its workflow
    task (a KeyError, a TypeError), which Temporal retries until the execution times out."""
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import ApplicationError

    request = {"source": "file:///d/x.csv", "id_column": "id", "text_column": "text",
               "output": "file:///d/out/"}
    for job, field in [({"shards": 2}, "request"),
                       ({"request": "x.csv", "shards": 2}, "request"),
                       ({"request": request, "shards": True}, "shards"),
                       ({"request": request, "shards": 2, "heartbeat_timeout_s": "60"},
                        "heartbeat_timeout_s"),
                       ({"request": request, "shards": 2, "start_to_close_s": -1},
                        "start_to_close_s"),
                       # timedelta overflows past ~3e13 s: an OverflowError in the task.
                       ({"request": request, "shards": 2, "heartbeat_timeout_s": 1e14},
                        "heartbeat_timeout_s"),
                       ({"request": request, "shards": 2, "task_queue": 7}, "task_queue"),
                       (["not", "an", "object"], "the job")]:
        with pytest.raises(WorkflowFailureError) as info:
            run(temporal_address, "gpulane.EmbedDatasetJob", job, timeout=30)
        cause = info.value.cause
        assert isinstance(cause, ApplicationError), (job, cause)
        assert (cause.type, cause.non_retryable) == ("InvalidInput", True), (job, cause)
        assert field in cause.message, (job, cause.message)
    # A caller's string is not repeated in the message.
    job = {"request": request, "shards": "x" * 10_000}
    with pytest.raises(WorkflowFailureError) as info:
        run(temporal_address, "gpulane.EmbedDatasetJob", job, timeout=30)
    assert "shards is str" in info.value.cause.message and "xxx" not in info.value.cause.message


def test_a_sharded_dataset_job_gathers_every_manifest(temporal_address, gpulane, tmp_path):
    root = tmp_path / "data"
    (root / "in").mkdir(parents=True)
    rows = [f"{i},text number {i}" for i in range(30)]
    (root / "in" / "corpus.csv").write_text("id,text\n" + "\n".join(rows) + "\n")
    gpulane("--model", str(minilm_dir()), "--simulate-gpus", "2x16GiB",
            "--data-root", f"file://{root}")
    request = gl.EmbedDatasetRequest(source=f"file://{root}/in/corpus.csv", id_column="id",
                                          text_column="text", output=f"file://{root}/out/",
                                          part_rows=8)

    async def go():
        client, worker, queue = await client_and_worker(temporal_address)
        async with worker:
            handle = await start_embed_dataset(client, request, shards=3,
                                               id=f"ds-{uuid.uuid4()}", task_queue=queue)
            return await gather_manifests(handle)

    manifests = asyncio.run(go())
    assert [type(m).__name__ for m in manifests] == ["Manifest"] * 3
    assert [(m.start, m.end) for m in manifests] == [(0, 10), (10, 20), (20, 30)]
    assert sum(m.rows for m in manifests) == 30
    for m in manifests:
        assert m.dimensions == 384 and sum(p.rows for p in m.parts) == m.rows
        for p in m.parts:
            assert pathlib.Path(p.uri.removeprefix("file://")).is_file(), p.uri
