"""`rerank`, and one worker serving several named models, through a real dev server."""

import asyncio
import uuid
from datetime import timedelta

from conftest import FIXTURES, assert_vectors_close, load_reference, workflow_env


def call(address, activity, queue, payload):
    async def go():
        async with workflow_env(address) as (client, wf_queue):
            return await client.execute_workflow(
                "Try", args=[activity, queue, payload], id=f"try-{uuid.uuid4()}",
                task_queue=wf_queue, execution_timeout=timedelta(seconds=120),
            )

    return asyncio.run(go())


def test_four_named_models_serve_embed_and_rerank_by_name(temporal_address, gpulane):
    gpulane(
        "--gpus", "none",
        "--model", f"bert-cls={FIXTURES / 'tiny-bert-cls'}",
        "--model", f"xlmr-mean={FIXTURES / 'tiny-xlmr-mean'}",
        "--model", f"bert-rerank={FIXTURES / 'tiny-cross-encoder'}",
        "--model", f"xlmr-rerank={FIXTURES / 'tiny-xlmr-cross-encoder'}",
    )
    for model, fixture in [("bert-cls", "tiny-bert-cls"), ("xlmr-mean", "tiny-xlmr-mean")]:
        ref = load_reference(fixture)
        out = call(temporal_address, "embed", "cpu-tools", {"texts": ref["texts"], "model": model})["ok"]
        assert out["model"] == model
        assert_vectors_close(out["embeddings"], ref["embeddings"], model)

    # Without "model", embed takes the first embedder and rerank the first cross-encoder.
    assert call(temporal_address, "embed", "cpu-tools", {"texts": ["x"]})["ok"]["model"] == "bert-cls"

    for model, fixture in [("bert-rerank", "tiny-cross-encoder"), ("xlmr-rerank", "tiny-xlmr-cross-encoder")]:
        for case in load_reference(fixture)["cases"]:
            docs = case["documents"]
            payload = {"query": case["query"], "documents": docs, "model": model, "return_documents": True}
            out = call(temporal_address, "rerank", "cpu-tools", payload)["ok"]
            assert out["model"] == model and out["device"]["kind"] == "cpu"
            scores = [r["score"] for r in out["results"]]
            assert scores == sorted(scores, reverse=True), "highest first"
            for r in out["results"]:
                assert abs(r["score"] - case["scores"][r["index"]]) <= 1e-4, (model, r)
                assert r["document"] == docs[r["index"]]
            raw = call(temporal_address, "rerank", "cpu-tools", {**payload, "raw_scores": True, "top_n": 1})["ok"]
            assert len(raw["results"]) == 1
            best = raw["results"][0]
            assert abs(best["score"] - max(case["raw_scores"])) <= 1e-4, (model, best)
            assert best["index"] == case["raw_scores"].index(max(case["raw_scores"]))

    default = call(temporal_address, "rerank", "cpu-tools", {"query": "q", "documents": ["d"]})["ok"]
    assert default["model"] == "bert-rerank"


def call_once(address, activity, queue, payload, **options):
    """One attempt (TryOnce): the result, or how it failed and whether it is retryable."""

    async def go():
        async with workflow_env(address) as (client, wf_queue):
            return await client.execute_workflow(
                "TryOnce", args=[activity, queue, payload, options], id=f"once-{uuid.uuid4()}",
                task_queue=wf_queue, execution_timeout=timedelta(seconds=120),
            )

    return asyncio.run(go())


def test_unknown_or_wrong_kind_model_is_refused_with_the_served_names(temporal_address, gpulane):
    g = gpulane(
        "--gpus", "none",
        "--model", f"bert-cls={FIXTURES / 'tiny-bert-cls'}",
        "--model", f"bert-rerank={FIXTURES / 'tiny-cross-encoder'}",
    )
    # On the worker's own queue no other worker could serve it: refused for good.
    private = f"cpu-tools.{g.host}"
    err = call(temporal_address, "rerank", private, {"query": "q", "documents": ["d"], "model": "nope"})["error"]
    assert err["type"] == "UnknownModel" and err["non_retryable"], err
    assert "bert-cls" in err["message"] and "bert-rerank" in err["message"], err
    # On the shared queue another worker may serve it: handed back, retryably, and the
    # message names the model queue that reaches only workers that serve it.
    err = call_once(temporal_address, "rerank", "cpu-tools", {"query": "q", "documents": ["d"], "model": "nope"})["error"]
    assert err["type"] == "ModelNotServed" and err["non_retryable"] is False, err
    assert "cpu-tools@nope" in err["message"] and "bert-rerank" in err["message"], err
    err = call(temporal_address, "rerank", "cpu-tools", {"query": "q", "documents": ["d"], "model": "bert-cls"})["error"]
    assert err["type"] == "InvalidInput" and "cross-encoder" in err["message"] and "bert-rerank" in err["message"], err
    err = call(temporal_address, "rerank", "cpu-tools", {"query": "q", "documents": [], "model": "bert-rerank"})["error"]
    assert err["type"] == "InvalidInput" and '"documents" is empty' in err["message"], err
    # The worker still serves.
    assert call(temporal_address, "rerank", "cpu-tools", {"query": "q", "documents": ["d"]})["ok"]["results"]
