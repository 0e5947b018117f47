"""A model named by Hugging Face repo id: downloaded through hf-hub into the cache
(from a local stand-in for the hub's file endpoint, `hub.py`, since no hub is reachable
here), loaded, and then served from the cache with downloads off."""

import hashlib
import os
import subprocess

from conftest import BIN, ROOT
from hub import local_hub

MODEL = ROOT / "models" / "tests" / "data" / "tiny-modernbert-mean"
REPO = "gpulane-test/tiny-modernbert"


def models(*args, endpoint=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run([str(BIN), "models", *args], capture_output=True, text=True, env=env, timeout=120)


def test_a_repo_id_downloads_into_the_cache_and_then_loads_offline(tmp_path):
    home = tmp_path / "hf"
    with local_hub({REPO: MODEL}) as (endpoint, requests):
        out = models("--model", REPO, "--hf-home", str(home), endpoint=endpoint)
        assert out.returncode == 0, out.stderr
        assert "tiny-modernbert" in out.stdout and "ModernBertModel" in out.stdout, out.stdout
        fetched = {p.rsplit("/resolve/main/", 1)[1] for p, rng in requests if rng}
        assert {"config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json"} <= fetched

        # A repo the hub does not have fails at start, naming it.
        missing = models("--model", "gpulane-test/absent", "--hf-home", str(home), endpoint=endpoint)
        assert missing.returncode != 0 and "gpulane-test/absent" in missing.stderr, missing.stderr

    snapshot = home / "hub" / "models--gpulane-test--tiny-modernbert" / "snapshots"
    [commit] = list(snapshot.iterdir())
    for name in ["config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json"]:
        got = hashlib.sha256((commit / name).read_bytes()).hexdigest()
        assert got == hashlib.sha256((MODEL / name).read_bytes()).hexdigest(), name

    # The hub is gone; the cache serves the same repo id with downloads off.
    offline = models("--model", REPO, "--hf-home", str(home), "--hf-offline")
    assert offline.returncode == 0, offline.stderr
    assert "ModernBertModel" in offline.stdout
