"""Python side of scripts/gpu-check.sh: the sentence-transformers reference, the memory hog,
and the report. Standard library only, except the subcommands that run PyTorch
(`compare`, `st-speed`, `hog`), which import torch and sentence-transformers lazily so the
rest runs (and is tested) on a machine without them.

Subcommands:
  corpus   --out FILE --n N                 deterministic texts, one per line
  pack     --model DIR --bin FILE --dest DIR  the carry folder for a lent GPU machine
  unpack-bin / unpack-model --src --dest    its binary and model, decompressed
  compare  --model DIR --corpus FILE --dumps DIR --out-dir DIR [--device cuda|cpu]
  st-speed --model DIR --corpus FILE --batch-sizes 8,32,128 --dtype f16 --out FILE [--device]
  hog      --leave BYTES --ready FILE        hold all but BYTES of card 0 until killed
  report   --dir DIR                         the summary table from the files above
"""

import argparse
import json
import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will can more other its into time only some could new them these two may first "
    "then do any like my now over such our man me even most made after also did many off "
    "before must well back through years much where your way down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great "
    "old year come since against go came right used take three GPU embedding Temporal worker "
    "lane card memory batch token throughput latency naïve café Zürich 東京 données résumé "
    "2026 3.14 e=mc² #tag user@example.com https://example.org/a?b=c"
).split()


def make_corpus(n, seed=20261130):
    """Texts of 1 to ~400 words (some past MiniLM's 256-token limit), reproducible."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        r = rng.random()
        if r < 0.5:
            k = rng.randint(3, 25)
        elif r < 0.9:
            k = rng.randint(25, 120)
        else:
            k = rng.randint(120, 400)
        words = [rng.choice(WORDS) for _ in range(k)]
        words[0] = words[0].capitalize()
        texts.append(" ".join(words) + rng.choice([".", "!", "?", ""]))
    return texts


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [l.rstrip("\n").rstrip("\r") for l in f if l.strip()]


def read_vectors(path):
    """JSON lines of floats; serde_json writes a NaN or an infinity as null: read it as NaN."""
    with open(path, encoding="utf-8") as f:
        return [[math.nan if x is None else x for x in json.loads(l)] for l in f if l.strip()]


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def agreement(ours, ref):
    """Cosine and max abs difference of two lists of vectors, row by row. A row with a NaN
    or an infinity (an f16 overflow, say) is counted, and makes the minimum NaN: Python's
    min and max would skip it."""
    if len(ours) != len(ref):
        raise SystemExit(f"gpulane wrote {len(ours)} vectors, the reference has {len(ref)}")
    bad = [i for i, a in enumerate(ours) if not all(math.isfinite(x) for x in a)]
    cos = [cosine(a, b) for a, b in zip(ours, ref)]
    worst = min(range(len(cos)), key=lambda i: -math.inf if math.isnan(cos[i]) else cos[i])
    diff = max((abs(x - y) for a, b in zip(ours, ref) for x, y in zip(a, b)),
               key=lambda d: math.inf if math.isnan(d) else d)
    return {
        "texts": len(cos),
        "non_finite_rows": len(bad),
        "cosine_min": cos[worst],
        "cosine_mean": sum(cos) / len(cos),
        "max_abs_diff": diff,
        "worst_index": worst,
    }


# ---------------------------------------------------------------- pack (runs here)


def f32_safetensors_to_f16(src, dst):
    """Rewrites a safetensors file with every F32 tensor stored as F16 (pure Python)."""
    with open(src, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        data = f.read()
    meta = header.pop("__metadata__", None)
    out_header, chunks, offset = {}, [], 0
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = t["data_offsets"]
        raw = data[begin:end]
        dtype = t["dtype"]
        if dtype == "F32":
            n = len(raw) // 4
            floats = struct.unpack(f"<{n}f", raw)
            # Out-of-range values would not fit f16; MiniLM has none, but say so if one does.
            raw = struct.pack(f"<{n}e", *floats)
            dtype = "F16"
        out_header[name] = {"dtype": dtype, "shape": t["shape"],
                            "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if meta is not None:
        out_header["__metadata__"] = meta
    hbytes = json.dumps(out_header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for c in chunks:
            f.write(c)


# Token ids kept in the packed model's word-embedding table besides the corpora's own:
# [PAD], [unused*], [UNK], [CLS], [SEP], [MASK] and the rest of the first thousand.
KEEP_FIRST_IDS = 1000


def corpus_token_ids(tokenizer_json):
    """Every token id a make_corpus() text can produce, whatever its size or seed: the
    texts are WORDS joined by spaces (the first capitalised) with one of four endings, and
    WordPiece splits each word on its own, so tokenizing each word in each form covers
    them. A large generated corpus is tokenized too, to check that argument here rather
    than on the card (where check_kept_ids would refuse the corpus)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    tok.no_truncation()
    tok.no_padding()
    forms = []
    for w in WORDS:
        for v in (w, w.capitalize()):
            forms += [v] + [v + end for end in (".", "!", "?")]
    ids = {i for enc in tok.encode_batch(forms) for i in enc.ids}
    seen = {i for enc in tok.encode_batch(make_corpus(20000, seed=1)) for i in enc.ids}
    if seen - ids:
        raise SystemExit(f"a generated corpus reaches {len(seen - ids)} token ids that the word "
                         "forms do not: corpus_token_ids no longer covers make_corpus")
    return ids


def zero_unused_embedding_rows(path, keep):
    """Zeroes the word-embedding rows (F16) whose ids are not in `keep`, in place: rows no
    text of the check reaches, zeroed so that xz shrinks the carry under the tool's limit."""
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        names = [n for n in header if n.endswith("word_embeddings.weight")]
        if len(names) != 1:
            raise SystemExit(f"expected one word_embeddings.weight in {path}, found {names}")
        t = header[names[0]]
        if t["dtype"] != "F16":
            raise SystemExit(f"{names[0]} is {t['dtype']}, expected F16 after the conversion")
        rows, dim = t["shape"]
        row_bytes = dim * 2
        base = 8 + hlen + t["data_offsets"][0]
        zero = bytes(row_bytes)
        for i in range(rows):
            if i not in keep:
                f.seek(base + i * row_bytes)
                f.write(zero)
    return rows


def cmd_pack(a):
    """The binary (xz) and the model (xz) with f16-stored weights, the word-embedding rows
    no text of the check uses zeroed: the device tool carries at most 64 MiB together with
    the repository's tracked files, and MiniLM's f32 weights alone are 87 MiB. Both gpulane
    and sentence-transformers then load the same weights (upcast exactly for the f32
    comparison), so the check compares the computations, not the copies."""
    import lzma  # here, so a Python without _lzma still reports

    dest = a.dest
    os.makedirs(dest, exist_ok=True)
    mdest = os.path.join(dest, "minilm")
    if os.path.exists(mdest):
        shutil.rmtree(mdest)
    shutil.copytree(a.model, mdest, ignore=shutil.ignore_patterns(
        "model.safetensors", "*.bin", "*.onnx", "onnx", "openvino", "*.h5", "*.ot", "README.md",
        ".gitattributes", "data_config.json", "train_script.py"))
    weights = os.path.join(mdest, "model.safetensors")
    f32_safetensors_to_f16(os.path.join(a.model, "model.safetensors"), weights)
    keep = corpus_token_ids(os.path.join(a.model, "tokenizer.json")) | set(range(KEEP_FIRST_IDS))
    rows = zero_unused_embedding_rows(weights, keep)
    write_json(os.path.join(mdest, "kept_token_ids.json"), sorted(keep))
    with open(weights, "rb") as f, lzma.open(weights + ".xz", "wb", preset=6) as g:
        shutil.copyfileobj(f, g, 1 << 20)
    os.remove(weights)
    print(f"model: {len(keep)} of {rows} word-embedding rows kept, the rest zeroed")
    # The release profile keeps line tables (debug = 1): hundreds of MB that the check
    # does not need. Strip them from a copy, then compress.
    stripped = os.path.join(dest, "gpulane.stripped")
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-all", "-o", stripped, a.bin], check=True)
    else:
        shutil.copyfile(a.bin, stripped)
    with open(stripped, "rb") as f, lzma.open(os.path.join(dest, "gpulane.xz"), "wb", preset=6) as g:
        shutil.copyfileobj(f, g, 1 << 20)
    os.remove(stripped)
    total = 0
    for root, _, files in os.walk(dest):
        total += sum(os.path.getsize(os.path.join(root, x)) for x in files)
    tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout
    tracked = sum(os.path.getsize(p) for p in tracked.decode().split("\0") if p and os.path.isfile(p))
    together = (total + tracked) / 2**20
    print(f"packed {dest}: {total / 2**20:.1f} MiB; with the tracked files {together:.1f} MiB "
          "(the device tool carries at most 64 MiB in all)")
    if together > 63:
        raise SystemExit(f"the carry and the tracked files come to {together:.1f} MiB, over the device tool's 64 MiB")


def cmd_unpack_bin(a):
    import lzma  # here, so a Python without _lzma still reports

    with lzma.open(a.src, "rb") as f, open(a.dest, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)
    os.chmod(a.dest, 0o755)


def cmd_unpack_model(a):
    """The packed model into `dest`: its files, and model.safetensors from its .xz."""
    import lzma  # here, so a Python without _lzma still reports

    if os.path.exists(a.dest):
        shutil.rmtree(a.dest)
    shutil.copytree(a.src, a.dest, ignore=shutil.ignore_patterns("*.xz"))
    with lzma.open(os.path.join(a.src, "model.safetensors.xz"), "rb") as f, \
            open(os.path.join(a.dest, "model.safetensors"), "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)


# ---------------------------------------------------------------- PyTorch parts (GPU machine)


def load_st(model_dir, dtype, device):
    import torch
    from sentence_transformers import SentenceTransformer

    m = SentenceTransformer(model_dir, device=device)
    # Whatever dtype the loader chose from the stored weights, compute in the one asked.
    m = m.to(torch.float16 if dtype == "f16" else torch.float32)
    m.eval()
    return m


def sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_name(device):
    import torch

    return torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"


def check_kept_ids(model_dir, input_ids):
    """A packed model zeroes the word-embedding rows the check's corpora never use; a text
    that reaches one would be embedded from a zeroed row, so refuse it."""
    path = os.path.join(model_dir, "kept_token_ids.json")
    if not os.path.exists(path):
        return
    kept = set(load(path) or [])
    missing = {i for ids in input_ids for i in ids} - kept
    if missing:
        raise SystemExit(f"the corpus uses {len(missing)} token ids whose rows the pack zeroed "
                         f"(e.g. {sorted(missing)[:5]}): repack with scripts/gpu-check.sh --prepare")


def cmd_compare(a):
    """Every `gpulane-<dtype>-<route>.jsonl` dump in --dumps against sentence-transformers
    in that dtype, one model load per dtype; writes correctness-<dtype>-<route>.json."""
    import torch

    texts = read_lines(a.corpus)
    dumps = {}
    for name in sorted(os.listdir(a.dumps)):
        if name.startswith("gpulane-") and name.endswith(".jsonl"):
            dt, route = name[len("gpulane-"):-len(".jsonl")].split("-", 1)
            dumps.setdefault(dt, []).append((route, os.path.join(a.dumps, name)))
    if not dumps:
        raise SystemExit(f"no gpulane-<dtype>-<route>.jsonl dumps in {a.dumps}: every embed step failed")
    failed = 0
    for dt, cases in sorted(dumps.items()):
        m = load_st(a.model, dt, a.device)
        check_kept_ids(a.model, m.tokenizer(texts)["input_ids"])
        with torch.inference_mode():
            ref = m.encode(texts, batch_size=32, convert_to_numpy=True).astype("float32").tolist()
        del m
        for route, path in cases:
            try:
                res = agreement(read_vectors(path), ref)
            except (SystemExit, ValueError, TypeError) as e:
                print(f"{dt} {route}: {e}", file=sys.stderr)
                failed += 1
                continue
            res.update(dtype=dt, attention=route, model=a.model, reference="sentence-transformers",
                       torch=torch.__version__, gpu=device_name(a.device))
            write_json(os.path.join(a.out_dir, f"correctness-{dt}-{route}.json"), res)
            print(json.dumps(res), flush=True)
    if failed:
        raise SystemExit(f"{failed} dumps could not be compared")


def cmd_st_speed(a):
    import torch

    texts = read_lines(a.corpus)
    m = load_st(a.model, a.dtype, a.device)
    tok = m.tokenizer
    enc = tok(texts, truncation=True, max_length=m.max_seq_length)
    tokens = sum(len(ids) for ids in enc["input_ids"])
    check_kept_ids(a.model, enc["input_ids"])
    results = []
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        with torch.inference_mode():
            for _ in range(a.warmup):
                m.encode(texts, batch_size=bs, convert_to_numpy=True)
            sync(a.device)
            secs = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                m.encode(texts, batch_size=bs, convert_to_numpy=True)
                sync(a.device)
                secs.append(time.perf_counter() - t)
        med = sorted(secs)[len(secs) // 2] if len(secs) % 2 else sum(sorted(secs)[len(secs) // 2 - 1:len(secs) // 2 + 1]) / 2
        results.append({"device": a.device, "dtype": a.dtype, "batch_rows": bs,
                        "texts": len(texts), "tokens": tokens, "seconds": secs,
                        "seconds_median": med, "texts_per_s": len(texts) / med,
                        "tokens_per_s": tokens / med})
        print(f"sentence-transformers {a.dtype} batch {bs}: {tokens / med:,.0f} tokens/s", flush=True)
        # Each batch size is written as it ends, so a step cut short keeps what it measured.
        write_json(a.out, {"model": a.model, "torch": torch.__version__,
                           "gpu": device_name(a.device), "results": results})


def cmd_hog(a):
    """Takes all but `leave` bytes of card 0's free memory, writes `ready`, holds it until
    SIGTERM/SIGINT: another tenant, as NVML will see it."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    want = max(0, free - a.leave)
    blocks, got, step = [], 0, 1 << 30
    while got < want:
        n = min(step, want - got)
        try:
            blocks.append(torch.empty(n, dtype=torch.uint8, device="cuda:0"))
            got += n
        except RuntimeError:
            if step <= (64 << 20):
                break
            step //= 2
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info(0)
    # Written whole, then renamed: the script polls for the file and copies it.
    write_json(a.ready + ".tmp", {"held_bytes": got, "free_before": free,
                                  "free_after": free_after, "total": total})
    os.replace(a.ready + ".tmp", a.ready)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass


# ---------------------------------------------------------------- report


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def parse_admission(path):
    """`gpulane admission` lines -> {uuid: {key: value}}; a card's indented `model` and
    `activity` lines add `<name>.<key>` entries to it (the host's are left out)."""
    cards, card = {}, None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 3 and parts[0] == "gpu":
                    card = cards[parts[2]] = dict(p.split("=", 1) for p in parts[3:] if "=" in p)
                elif line.startswith(" ") and card is not None and len(parts) > 2:
                    for p in parts[2:]:
                        if "=" in p:
                            k, v = p.split("=", 1)
                            card[f"{parts[1]}.{k}"] = v
                elif not line.startswith(" "):
                    card = None
    except OSError:
        pass
    return cards


def cmd_report(a):
    d = a.dir
    lines = ["# gpulane GPU check", ""]
    for name in ("version.txt", "python.txt"):
        try:
            with open(os.path.join(d, name), encoding="utf-8", errors="replace") as f:
                lines.append(f.read().strip())
        except OSError:
            pass
    try:
        with open(os.path.join(d, "nvidia-smi.txt"), encoding="utf-8", errors="replace") as f:
            lines += ["", "```", f.read().rstrip(), "```"]
    except OSError:
        lines += ["", "no nvidia-smi.txt: a rehearsal on the CPU, or the check stopped before the card was read"]
    lines += ["", "## Steps", "", "| step | status | seconds |", "|---|---|---|"]
    try:
        with open(os.path.join(d, "steps.tsv"), encoding="utf-8") as f:
            for row in list(f)[1:]:
                name, status, rc, secs = row.rstrip("\n").split("\t")
                if status not in ("ok", "skipped"):
                    status = f"**{status}** (rc {rc})"
                lines.append(f"| {name} | {status} | {secs} |")
    except (OSError, ValueError):
        lines.append("| steps.tsv missing or malformed | | |")
    lines.append("")
    if os.path.exists(os.path.join(d, "devices.txt")):
        with open(os.path.join(d, "devices.txt"), encoding="utf-8", errors="replace") as f:
            lines += ["## Inventory (gpulane devices)", "", "```", f.read().rstrip(), "```", ""]
    kc = load(os.path.join(d, "kernel-check.json"))
    if kc:
        bad = [c for c in kc["checks"] if not c["ok"]]
        lines += ["## gpulane's kernels vs the CPU (gpulane kernel-check)", "",
                  f"{len(kc['checks']) - len(bad)} of {len(kc['checks'])} checks within bounds.", ""]
        if bad:
            lines += ["| op | dtype | case | max abs diff | max scaled diff | bound |", "|---|---|---|---|---|---|"]
            lines += [f"| {c['op']} | {c['dtype']} | {c['case']} | {c['max_abs_diff']} | {c.get('max_scaled_diff', '')} | {c['bound']} |" for c in bad]
            lines.append("")
    else:
        lines += ["## gpulane's kernels vs the CPU (gpulane kernel-check)", "", "missing (see kernel-check.log)", ""]
    lines += ["## embed vs sentence-transformers (same card, same weights)", "",
              "| dtype | attention | texts | non-finite rows | cosine min | cosine mean | max abs diff |",
              "|---|---|---|---|---|---|---|"]
    for route in ("varlen", "padded"):
        for dt in ("f32", "f16"):
            c = load(os.path.join(d, f"correctness-{dt}-{route}.json"))
            if c:
                nf = c.get("non_finite_rows", "?")
                nf = f"**{nf}**" if nf not in (0, "?") else nf
                lines.append(f"| {dt} | {route} | {c['texts']} | {nf} | {c['cosine_min']:.6f} | {c['cosine_mean']:.6f} | {c['max_abs_diff']:.2e} |")
            else:
                lines.append(f"| {dt} | {route} | missing | | | | |")
    lines += ["", "## Throughput, tokens/s (median)", "",
              "| device | dtype | attention | batch rows | gpulane | sentence-transformers fp16 | gpulane / ST |",
              "|---|---|---|---|---|---|---|"]
    ours = {"results": []}
    for name in sorted(os.listdir(d)):
        if name.startswith("gpulane-speed") and name.endswith(".json"):
            ours["results"] += (load(os.path.join(d, name)) or {"results": []})["results"]
    ours["results"].sort(key=lambda r: (r["device"], r.get("attention", ""), -r["batch_rows"]))
    st = load(os.path.join(d, "st-speed.json")) or {"results": []}
    # sentence-transformers ran on one device: compare it with gpulane's rows on the same kind.
    st_by = {(r["device"].split(":")[0], r["batch_rows"]): r for r in st["results"]}
    for r in ours["results"]:
        s = st_by.get((r["device"].split(":")[0], r["batch_rows"]))
        ratio = f"{r['tokens_per_s'] / s['tokens_per_s']:.2f}" if s else "-"
        st_tps = f"{s['tokens_per_s']:,.0f}" if s else "-"
        lines.append(f"| {r['device']} | {r['dtype']} | {r.get('attention', '-')} | {r['batch_rows']} | {r['tokens_per_s']:,.0f} | {st_tps} | {ratio} |")
    lines += ["", "## VRAM admission against NVML (MiniLM embed)", "",
              "| moment | free GiB | others GiB | weights MiB | working set MiB | a waiting embed KiB | headroom MiB | admits |",
              "|---|---|---|---|---|---|---|---|"]
    flips = []

    def gib(kv, key, unit=2**30, fmt="{:.1f}"):
        try:
            return fmt.format(int(kv[key]) / unit)
        except (KeyError, ValueError):
            return kv.get(key, "?")

    for moment in ("before", "during", "after"):
        for uuid, kv in parse_admission(os.path.join(d, f"admission-{moment}.txt")).items():
            mib = dict(unit=2**20, fmt="{:.0f}")
            lines.append(f"| {moment} ({uuid[:12]}) | {gib(kv, 'free_bytes')} | {gib(kv, 'others_bytes')} "
                         f"| {gib(kv, 'weights_bytes', **mib)} | {gib(kv, 'minilm.working_set_bytes', **mib)} "
                         f"| {gib(kv, 'embed.waiting_rows_bytes', unit=2**10, fmt='{:.0f}')} "
                         f"| {gib(kv, 'headroom_bytes', **mib)} | {kv.get('admit_embed')} |")
            flips.append(kv.get("admit_embed"))
    hog = load(os.path.join(d, "hog.json"))
    if hog:
        who = "A simulated neighbour (the memory file)" if hog.get("simulated") else "A second process (PyTorch)"
        lines.append(f"\n{who} held {hog['held_bytes'] / 2**30:.1f} GiB during `during`.")
    if len(flips) == 3:
        ok = flips[0] not in ("0", None) and flips[1] == "0" and flips[2] not in ("0", None)
        lines.append("admission flips with the other tenant: " + ("yes" if ok else "NO"))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(d, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--out", required=True)
    c.add_argument("--n", type=int, default=1000)
    c.add_argument("--seed", type=int, default=20261130)
    k = sub.add_parser("pack")
    k.add_argument("--model", required=True)
    k.add_argument("--bin", required=True)
    k.add_argument("--dest", required=True)
    u = sub.add_parser("unpack-bin")
    u.add_argument("--src", required=True)
    u.add_argument("--dest", required=True)
    um = sub.add_parser("unpack-model")
    um.add_argument("--src", required=True)
    um.add_argument("--dest", required=True)
    m = sub.add_parser("compare")
    m.add_argument("--model", required=True)
    m.add_argument("--corpus", required=True)
    m.add_argument("--dumps", required=True)
    m.add_argument("--out-dir", required=True)
    m.add_argument("--device", default="cuda")
    s = sub.add_parser("st-speed")
    s.add_argument("--model", required=True)
    s.add_argument("--corpus", required=True)
    s.add_argument("--batch-sizes", default="8,32,128")
    s.add_argument("--dtype", choices=["f32", "f16"], default="f16")
    s.add_argument("--repeat", type=int, default=5)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--device", default="cuda")
    s.add_argument("--out", required=True)
    h = sub.add_parser("hog")
    h.add_argument("--leave", type=int, default=1 << 30)
    h.add_argument("--ready", required=True)
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    a = p.parse_args()
    if a.cmd == "corpus":
        with open(a.out, "w", encoding="utf-8") as f:
            for t in make_corpus(a.n, a.seed):
                f.write(t + "\n")
    else:
        {"pack": cmd_pack, "unpack-bin": cmd_unpack_bin, "unpack-model": cmd_unpack_model, "compare": cmd_compare,
         "st-speed": cmd_st_speed, "hog": cmd_hog, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    main()
