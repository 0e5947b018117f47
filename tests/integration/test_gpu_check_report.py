"""scripts/gpu-check.sh runs once, on a lent card, with no second try: its report must read
what today's `gpulane admission` prints. These tests feed the report the real command's
output (a simulated card, a simulated neighbour) and a steps list, so a change to either
side that the other does not follow fails here, not on the card."""

import importlib.util
import json
import subprocess

from conftest import BIN, ROOT, minilm_dir

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def admission(tmp_path, moment, free):
    mem = tmp_path / f"memory-{moment}.json"
    mem.write_text(json.dumps({} if free is None else {"0": free}))
    out = subprocess.run(
        [str(BIN), "admission", "--model", f"minilm={minilm_dir()}", "--simulate-gpus", "1x16GiB",
         "--simulated-memory", str(mem)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    (tmp_path / f"admission-{moment}.txt").write_text(out)


def test_report_reads_admission_and_steps(tmp_path):
    admission(tmp_path, "before", None)
    admission(tmp_path, "during", 1 << 30)
    admission(tmp_path, "after", None)
    (tmp_path / "hog.json").write_text(json.dumps({"held_bytes": 15 << 30, "simulated": True}))
    (tmp_path / "steps.tsv").write_text(
        "step\tstatus\trc\tseconds\n"
        "a. inventory (gpulane devices)\tok\t0\t1\n"
        "c. throughput, gpulane f16 varlen\ttimed out\t124\t120\n"
    )

    cards = gpu_check.parse_admission(tmp_path / "admission-during.txt")
    assert len(cards) == 1, cards
    (card,) = cards.values()
    # The numbers the table shows, read from the card's own lines and its model's line.
    assert int(card["free_bytes"]) == 1 << 30
    assert int(card["weights_bytes"]) > 0
    assert int(card["minilm.working_set_bytes"]) > 0
    assert int(card["embed.waiting_rows_bytes"]) > 0
    assert card["admit_embed"] == "0"

    gpu_check.cmd_report(type("Args", (), {"dir": str(tmp_path)}))
    summary = (tmp_path / "summary.md").read_text()
    assert "admission flips with the other tenant: yes" in summary, summary
    during = next(line for line in summary.splitlines() if line.startswith("| during"))
    cells = [c.strip() for c in during.strip("|").split("|")]
    assert "?" not in cells, during
    assert cells[1] == "1.0" and cells[-1] == "0", during
    assert "| c. throughput, gpulane f16 varlen | **timed out** (rc 124) | 120 |" in summary, summary
    # What did not run is said, not left out.
    assert "| f16 | varlen | missing |" in summary, summary


def test_a_nan_row_is_a_failure_not_skipped(tmp_path):
    """serde_json writes NaN as null; one such row must show, and must be the minimum."""
    dump = tmp_path / "dump.jsonl"
    dump.write_text("[1.0, 0.0]\n[null, 0.5]\n[0.0, 1.0]\n")
    res = gpu_check.agreement(gpu_check.read_vectors(dump), [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert res["non_finite_rows"] == 1, res
    assert res["worst_index"] == 1, res
    assert res["cosine_min"] != res["cosine_min"], res  # NaN
    assert res["max_abs_diff"] != res["max_abs_diff"], res


def test_pack_zeroes_only_the_unused_embedding_rows(tmp_path):
    """The carry's model keeps every kept row bit for bit (as f16) and zeroes the rest."""
    import struct

    src = ROOT / "tests" / "fixtures" / "tiny-bert-cls" / "model.safetensors"
    f16 = tmp_path / "model.safetensors"
    gpu_check.f32_safetensors_to_f16(str(src), str(f16))
    before = f16.read_bytes()
    keep = {3, 101, 102}  # (row 0, [PAD], is zero in the checkpoint already)
    rows = gpu_check.zero_unused_embedding_rows(str(f16), keep)
    after = f16.read_bytes()

    (hlen,) = struct.unpack("<Q", after[:8])
    header = json.loads(after[8:8 + hlen])
    name = next(n for n in header if n.endswith("word_embeddings.weight"))
    t = header[name]
    assert t["dtype"] == "F16" and t["shape"][0] == rows
    row_bytes = t["shape"][1] * 2
    base = 8 + hlen + t["data_offsets"][0]
    for i in (3, 5, 101, 102, rows - 1):
        row = slice(base + i * row_bytes, base + (i + 1) * row_bytes)
        if i in keep:
            assert after[row] == before[row] and any(before[row]), i
        else:
            assert after[row] == bytes(row_bytes) and any(before[row]), i
    # Nothing outside the table moved.
    assert after[:base] == before[:base]
    end = base + rows * row_bytes
    assert after[end:] == before[end:]


def test_a_corpus_reaching_a_zeroed_row_is_refused(tmp_path):
    (tmp_path / "kept_token_ids.json").write_text(json.dumps([0, 1, 2, 101, 102]))
    gpu_check.check_kept_ids(str(tmp_path), [[101, 1, 102], [101, 2, 0]])
    try:
        gpu_check.check_kept_ids(str(tmp_path), [[101, 7, 102]])
    except SystemExit as e:
        assert "token ids whose rows the pack zeroed" in str(e), e
    else:
        raise AssertionError("a zeroed row's id was not refused")
