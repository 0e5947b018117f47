"""The families beyond BERT, XLM-R and ModernBERT, end to end: `gpulane models` lists
each with family, dtype, revision, pooling, dimensions and max length; one worker serves
MPNet, DistilBERT, BERT with a Dense head, Qwen3 and a sharded bf16 Qwen3 by name to a
Python workflow, which gets the vectors sentence-transformers computes (with the models'
own prompts too); a model gpulane cannot run is refused at start, naming the file.
Fixtures: models/tests/data/make_tiny_families.py."""

import json
import os
import shutil
import subprocess

from conftest import BIN, ROOT, assert_vectors_close
from test_rerank import call

DATA = ROOT / "models" / "tests" / "data"
MODELS = {
    "mpnet": ("tiny-mpnet-mean", "mpnet", "mean", 32),
    "distilbert": ("tiny-distilbert-cls", "distilbert", "cls", 32),
    "bert-dense": ("tiny-bert-dense", "bert", "mean", 16),
    "qwen3": ("tiny-qwen3-last", "qwen3", "lasttoken", 64),
    "qwen3-sharded": ("tiny-qwen3-sharded", "qwen3", "lasttoken", 64),
}


def reference(folder):
    return json.loads((DATA / folder / "reference.json").read_text())


def test_models_lists_family_dtype_revision_pooling_dimensions_and_length():
    args = [a for name, (folder, *_) in MODELS.items() for a in ("--model", f"{name}={DATA / folder}")]
    out = subprocess.run([str(BIN), "models", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    for name, (folder, family, pooling, dims) in MODELS.items():
        line = lines[name]
        # Declared without a dtype: f16 on cards (the default), f32 on the CPU as always.
        assert f"family {family}" in line and "dtype gpu f16 cpu f32" in line, line
        assert "revision sha256:" in line, line
        assert f"pooling {pooling}" in line and f"dimensions {dims}" in line, line
        assert f"max length {reference(folder)['max_seq_length']}" in line, line
    assert "+dense(32→16 tanh)+normalize" in lines["bert-dense"]


def test_each_family_serves_its_reference_vectors_by_name(temporal_address, gpulane):
    # The first is declared without a name: it is named after its folder.
    gpulane("--gpus", "none", "--model", str(DATA / "tiny-mpnet-mean"),
            *[a for name, (folder, *_) in MODELS.items() if name != "mpnet"
              for a in ("--model", f"{name}={DATA / folder}")])
    for name, (folder, family, _, dims) in MODELS.items():
        served = "tiny-mpnet-mean" if name == "mpnet" else name
        ref = reference(folder)
        out = call(temporal_address, "embed", "cpu-tools", {"texts": ref["texts"], "model": served})
        assert "ok" in out, out
        out = out["ok"]
        assert (out["model"], out["family"], out["dtype"]) == (served, family, "f32"), out["model"]
        assert out["revision"].startswith("sha256:") and out["dimensions"] == dims
        assert out["usage"]["tokens"] == sum(ref["token_counts"])
        assert_vectors_close(out["embeddings"], ref["embeddings"], name)
        if "prompt_name" in ref:
            prompted = call(temporal_address, "embed", "cpu-tools", {
                "texts": ref["texts"][:len(ref["prompted_embeddings"])], "model": served,
                "prompt_name": ref["prompt_name"],
            })["ok"]
            assert_vectors_close(prompted["embeddings"], ref["prompted_embeddings"], f"{name} prompted")


def refused_at_start(temporal_address, tmp_path, model_dir):
    """Runs a worker on `model_dir`; it must exit non-zero at start. Returns its output."""
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_address, "GPULANE_HOST": "refused",
           "GPULANE_METRICS_ADDRESS": "127.0.0.1:0", "GPULANE_ADMIN_ADDRESS": "127.0.0.1:0"}
    out = subprocess.run([str(BIN), "run", "--gpus", "none", "--model", f"bad={model_dir}"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0, out
    return out.stdout + out.stderr


def test_unsupported_modules_and_pickles_are_refused_at_start(temporal_address, tmp_path):
    module = tmp_path / "module"
    shutil.copytree(DATA / "tiny-bert-dense", module)
    modules = module / "modules.json"
    modules.write_text(modules.read_text().replace(
        "sentence_transformers.base.modules.dense.Dense", "sentence_transformers.models.WordWeights"))
    log = refused_at_start(temporal_address, tmp_path, module)
    assert "WordWeights" in log and str(modules) in log, log

    pickle = tmp_path / "pickle"
    shutil.copytree(DATA / "tiny-distilbert-cls", pickle)
    (pickle / "model.safetensors").unlink()
    (pickle / "pytorch_model.bin").write_bytes(b"never unpickled")
    log = refused_at_start(temporal_address, tmp_path, pickle)
    assert str(pickle / "pytorch_model.bin") in log and "safe_serialization=True" in log, log
