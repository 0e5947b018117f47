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
