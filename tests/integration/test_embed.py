"""`embed` through a real Temporal dev server, driven by Python workflows."""

import asyncio
import uuid

from conftest import (
    FIXTURES,
    assert_vectors_close,
    cosine_and_max_abs,
    load_reference,
    minilm_dir,
    workflow_env,
)


def run_workflow(address, workflow, *args, timeout=180):
    async def go():
        async with workflow_env(address) as (client, queue):
            return await client.execute_workflow(
                workflow, args=list(args), id=f"test-{uuid.uuid4()}", task_queue=queue,
                execution_timeout=__import__("datetime").timedelta(seconds=timeout),
            )

    return asyncio.run(go())


def test_embed_on_cpu_lane_matches_sentence_transformers(temporal_address, gpulane):
    # Declared without a name: the model is named by its README card (the PyPI package's
    # folder is just `model`).
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none")
    ref = load_reference("minilm")
    out = run_workflow(temporal_address, "EmbedOn", "cpu-tools", {"texts": ref["texts"]})

    assert out["model"] == "all-MiniLM-L6-v2"
    # Which weights made the vectors: a plain directory's revision is its weights' hash.
    weights = (minilm_dir() / "model.safetensors").read_bytes()
    assert out["revision"] == "sha256:" + __import__("hashlib").sha256(weights).hexdigest()
    assert (out["dtype"], out["family"]) == ("f32", "bert")
    assert out["dimensions"] == 384
    assert out["device"] == {"kind": "cpu", "name": "cpu", "simulated": False}
    assert out["host_task_queue"] == f"cpu-tools.{g.host}"
    assert out["usage"]["tokens"] == sum(ref["token_counts"])
    assert len(out["embeddings"]) == len(ref["embeddings"])
    assert_vectors_close(out["embeddings"], ref["embeddings"], "minilm")

    # The host queue is served too: a call pinned there lands on the same worker.
    again = run_workflow(temporal_address, "EmbedOn", out["host_task_queue"], {"texts": ["pinned"]})
    assert again["host_task_queue"] == out["host_task_queue"]


def test_cpu_lane_in_int8_names_its_dtype_and_stays_within_cosine_0_99(temporal_address, gpulane):
    # One worker with a simulated card too: a simulated card stands for a card, so it
    # keeps computing in f32 while the CPU lane runs int8.
    gpulane(
        "--model", f"m={minilm_dir()}", "--cpu-dtype", "int8", "--simulate-gpus", "1x16GiB",
        "--cpu-lane", "on",
    )
    ref = load_reference("minilm")
    out = run_workflow(temporal_address, "EmbedOn", "cpu-tools", {"texts": ref["texts"]})
    assert out["device"]["kind"] == "cpu" and out["dtype"] == "int8", out["device"]
    assert out["usage"]["tokens"] == sum(ref["token_counts"])
    worst = 1.0
    moved = 0.0
    for got, want in zip(out["embeddings"], ref["embeddings"]):
        cos, max_abs = cosine_and_max_abs(got, want)
        worst, moved = min(worst, cos), max(moved, max_abs)
    assert worst >= 0.99, worst
    # Quantization really ran: f32 stays within 1e-4 of the reference, int8 does not.
    assert moved > 1e-4, moved
    card = run_workflow(temporal_address, "EmbedOn", "gpu-tools", {"texts": ref["texts"][:2]})
    assert card["device"]["kind"] == "gpu" and card["dtype"] == "f32", card["device"]
    assert_vectors_close(card["embeddings"], ref["embeddings"][:2], "simulated card")


def test_pin_pattern_keeps_both_calls_on_one_simulated_card(temporal_address, gpulane):
    g = gpulane("--model", str(FIXTURES / "tiny-bert-cls"), "--simulate-gpus", "2x16GiB")
    log = g.log()
    assert "simulated" in log

    async def many():
        async with workflow_env(temporal_address) as (client, queue):
            handles = [
                await client.start_workflow(
                    "PinnedPair", args=[[f"text {i}", "another"]], id=f"pin-{uuid.uuid4()}",
                    task_queue=queue,
                )
                for i in range(16)
            ]
            return await asyncio.gather(*(h.result() for h in handles))

    results = asyncio.run(many())
    served = set()
    for r in results:
        first, second = r["first"], r["second"]
        assert first["device"]["kind"] == "gpu" and first["device"]["simulated"] is True
        assert first["device"]["uuid"] in ("GPU-SIM-t-0", "GPU-SIM-t-1")
        assert first["host_task_queue"] == f"gpu-tools.{g.host}.{first['device']['uuid'].lower()}"
        assert second["device"] == first["device"], r
        assert second["host_task_queue"] == first["host_task_queue"]
        served.add(first["device"]["uuid"])
    assert served, "no card served anything"


def test_bad_input_fails_non_retryably_and_worker_keeps_serving(temporal_address, gpulane):
    gpulane("--model", f"tiny={FIXTURES / 'tiny-bert-cls'}", "--gpus", "none", "--max-texts", "4")
    cases = [
        ({"texts": []}, "InvalidInput", ['"texts"', "empty"]),
        ({"texts": ["ok", 7]}, "InvalidInput", ["texts[1]", "string"]),
        ({"text": ["a"]}, "InvalidInput", ['unknown field "text"']),
        ("just a string", "InvalidInput", ["JSON object"]),
        ({"texts": ["a"] * 5}, "InvalidInput", ["5 texts", "limit of 4", "split"]),
        # A model no worker serves: on the shared queue that is handed back, retryably,
        # for another worker (test_routing.py); a malformed name fails for good anywhere.
        ({"texts": ["a"], "model": "no\nsuch\"model"}, "InvalidInput", ["not a model name"]),
        ({"texts": ["word " * 400], "truncate": False}, "TextTooLong", ["limit of 128", "truncate"]),
    ]
    for bad, want_type, fragments in cases:
        out = run_workflow(temporal_address, "BadThenGood", "cpu-tools", bad, {"texts": ["still serving"]})
        err = out["error"]
        assert err is not None, f"{bad!r} did not fail"
        assert err["type"] == want_type, (bad, err)
        assert err["non_retryable"] is True, (bad, err)
        assert "NON_RETRYABLE" in err["retry_state"], (bad, err)
        for f in fragments:
            assert f in err["message"], (bad, f, err["message"])
        assert len(out["good"]["embeddings"]) == 1
