"""Embedding options (dimensions, base64, prompts) and the result-size guard, through Temporal."""

import base64
import json
import shutil
import struct
import time

from conftest import FIXTURES, minilm_dir
from datasets import Local
from test_dataset import try_dataset
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


def poisoned_copy(tmp_path, fixture, tensor, words=("the",)):
    """A copy of a fixture model whose embedding rows for `words` are NaN: only texts
    holding one of them give a non-finite output."""
    dst = tmp_path / f"poisoned-{fixture}"
    shutil.copytree(FIXTURES / fixture, dst)
    vocab = (dst / "vocab.txt").read_text().splitlines()
    path = dst / "model.safetensors"
    data = bytearray(path.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    t = json.loads(data[8:8 + size])[tensor]
    hidden = t["shape"][1]
    for word in words:
        start = 8 + size + t["data_offsets"][0] + vocab.index(word) * hidden * 4
        data[start:start + hidden * 4] = struct.pack(f"<{hidden}f", *[float("nan")] * hidden)
    path.write_bytes(bytes(data))
    return dst


def test_a_non_finite_output_fails_naming_the_input_and_the_worker_keeps_serving(
        temporal_address, gpulane, tmp_path):
    # "ok" is what the health probe embeds: a model that answers it with NaN is at fault,
    # not dead, and a restart would not mend it.
    embedder = poisoned_copy(tmp_path, "tiny-bert-cls", "embeddings.word_embeddings.weight", ("the", "ok"))
    reranker = poisoned_copy(tmp_path, "tiny-cross-encoder", "bert.embeddings.word_embeddings.weight")
    loc = Local(tmp_path / "data")
    g = gpulane("--gpus", "none", "--model", f"nan-embed={embedder}", "--model", f"nan-rerank={reranker}",
                "--data-root", loc.root_uri)

    err = call(temporal_address, "embed", "cpu-tools",
               {"texts": ["a cat sat", "on the mat"], "model": "nan-embed"})["error"]
    assert err["type"] == "NonFiniteOutput" and err["non_retryable"], err
    for fragment in ["texts[1]", "f32", "checkpoint"]:
        assert fragment in err["message"], (fragment, err["message"])
    err = call(temporal_address, "rerank", "cpu-tools",
               {"query": "a question", "documents": ["no dog", "the end"], "model": "nan-rerank"})["error"]
    assert err["type"] == "NonFiniteOutput" and "documents[1]" in err["message"], err

    # Base64 would have carried the NaN bits silently; it is refused the same way.
    err = call(temporal_address, "embed", "cpu-tools",
               {"texts": ["the"], "model": "nan-embed", "encoding": "base64"})["error"]
    assert err["type"] == "NonFiniteOutput", err
    # A dataset names the source's row, not a position in one of the chunks it is fed in.
    rows = [{"id": i, "text": "on the mat" if i == 130 else f"row {i}"} for i in range(150)]
    source = loc.put("in/poisoned.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    err = try_dataset(temporal_address, "cpu-tools",
                      {"source": source, "id_column": "id", "text_column": "text",
                       "output": loc.uri("out/"), "model": "nan-embed"}, workers=[g])["error"]
    assert err["type"] == "NonFiniteOutput" and err["non_retryable"], err
    assert "source rows[130]" in err["message"], err

    out = call(temporal_address, "embed", "cpu-tools", {"texts": ["a cat sat"], "model": "nan-embed"})["ok"]
    assert all(x == x for x in out["embeddings"][0])
    time.sleep(6)  # the health checks run every 5 s
    assert g.get("/healthz") == (200, "ok\n"), g.get("/healthz")
