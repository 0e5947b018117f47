"""Embedding options (dimensions, base64, prompts) and the result-size guard, through Temporal."""

import base64
import struct

from conftest import minilm_dir
from test_rerank import call


def unit(v):
    n = sum(x * x for x in v) ** 0.5
    return [x / n for x in v]


def test_oversize_result_is_refused_and_base64_with_fewer_dimensions_fits(temporal_address, gpulane):
    gpulane("--gpus", "none", "--model", f"minilm={minilm_dir()}")
    texts = [f"sentence number {i} about task queues" for i in range(1024)]

    err = call(temporal_address, "embed", "cpu-tools", {"texts": texts})["error"]
    assert err["type"] == "ResultTooLarge" and err["non_retryable"], err
    for fragment in ["bytes of JSON", "limit of 2000000", "base64", "dimensions", "fewer texts"]:
        assert fragment in err["message"], (fragment, err["message"])

    out = call(temporal_address, "embed", "cpu-tools",
               {"texts": texts, "encoding": "base64", "dimensions": 128})["ok"]
    assert out["dimensions"] == 128 and len(out["embeddings"]) == 1024
    full = call(temporal_address, "embed", "cpu-tools", {"texts": texts[:3]})["ok"]["embeddings"]
    for b64, whole in zip(out["embeddings"][:3], full):
        got = struct.unpack("<128f", base64.b64decode(b64))
        want = unit(whole[:128])  # a Matryoshka prefix, re-normalized
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_prompt_prefixes_the_texts(temporal_address, gpulane):
    gpulane("--gpus", "none", "--model", f"minilm={minilm_dir()}")
    with_prompt = call(temporal_address, "embed", "cpu-tools",
                       {"texts": ["what is a lane?"], "prompt": "query: "})["ok"]
    spelled_out = call(temporal_address, "embed", "cpu-tools", {"texts": ["query: what is a lane?"]})["ok"]
    plain = call(temporal_address, "embed", "cpu-tools", {"texts": ["what is a lane?"]})["ok"]
    assert with_prompt["embeddings"] == spelled_out["embeddings"]
    assert with_prompt["embeddings"] != plain["embeddings"]
    assert with_prompt["usage"]["tokens"] > plain["usage"]["tokens"]
    err = call(temporal_address, "embed", "cpu-tools", {"texts": ["x"], "prompt_name": "query"})["error"]
    assert err["type"] == "InvalidInput" and '"prompt_name"' in err["message"], err
    err = call(temporal_address, "embed", "cpu-tools", {"texts": ["x"], "dimensions": 1000})["error"]
    assert err["type"] == "InvalidInput" and "384" in err["message"], err
