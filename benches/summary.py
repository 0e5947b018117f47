"""Reads the JSON reports benches/run.sh left in benches/out/ and prints one markdown
summary with the ratios issue 5 asks about (gpulane over its peer; > 1 means gpulane is
faster). A part that did not run shows as "not run". Standard library only.

Usage: summary.py [OUT_DIR]   (writes OUT_DIR/summary.md and prints it)
"""

import datetime
import json
import os
import pathlib
import platform
import statistics
import sys


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(x):
    """Numbers as people read them: 3 significant digits, at least the units."""
    if not isinstance(x, (int, float)):
        return "–" if x is None else str(x)
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def ratio(a, b):
    return f"**{a / b:.2f}×**" if a and b else "–"


def mode(report):
    if report.get("mode") == "fanout":
        return "all from one workflow (--fanout)"
    return "one workflow each"


def measured_at(out, pattern):
    """When a section's reports were written, since parts can be run separately."""
    times = [p.stat().st_mtime for p in out.glob(pattern)]
    if not times:
        return ""
    at = datetime.datetime.fromtimestamp(max(times), datetime.timezone.utc)
    return f" (measured {at:%Y-%m-%d %H:%M} UTC)"


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def speed_rounds(out, side, corpus, rounds):
    """A side's f32 reports on a corpus, round by round as run.sh names them (round 1
    `speed-SIDE-CORPUS.json`, round r `…-r.json`); None where a run failed and wrote none."""
    return {
        r: load(out / f"speed-{side}-{corpus}{'' if r == 1 else f'-{r}'}.json")
        for r in range(1, rounds + 1)
    }


def first_result(report):
    """A report's one result, or {} for anything else (a missing or malformed report)."""
    results = report.get("results") if isinstance(report, dict) else None
    first = results[0] if isinstance(results, list) and results else None
    return first if isinstance(first, dict) else {}


def median_of(results, key):
    xs = [r[key] for r in results if r.get(key)]
    return statistics.median(xs) if xs else None


def speed_section(out):
    # How many rounds run.sh ran (a folder from before the rounds has one).
    rounds = (load(out / "speed-info.json") or {}).get("rounds", 1)
    rows, peer_rate, reports = [], {}, []
    for corpus in ("short", "long"):
        g_by = speed_rounds(out, "gpulane", corpus, rounds)
        s_by = speed_rounds(out, "st", corpus, rounds)
        gs = {r: first_result(v) for r, v in g_by.items()}
        ss = {r: first_result(v) for r, v in s_by.items()}
        if not any(gs.values()) and not any(ss.values()):
            continue
        reports += [v for v in (*g_by.values(), *s_by.values()) if isinstance(v, dict)]
        gr = next((g for g in gs.values() if g), {})
        sr = next((s for s in ss.values() if s), {})
        peer_rate[corpus] = median_of(ss.values(), "texts_per_s")
        # Each round's ratio, gpulane's run against the peer's run of the same round.
        pairs = {
            r: g["texts_per_s"] / ss[r]["texts_per_s"]
            for r, g in gs.items()
            if g.get("texts_per_s") and ss.get(r, {}).get("texts_per_s")
        }
        if pairs:
            each = ", ".join(f"r{r} {x:.2f}" for r, x in pairs.items())
            verdict = f"**{statistics.median(pairs.values()):.2f}×** ({each})"
        else:
            verdict = "–"
        note = ""
        if gr.get("tokens") and sr.get("tokens") and gr["tokens"] != sr["tokens"]:
            note = f" (token counts differ: {gr['tokens']} vs {sr['tokens']})"
        rows.append(
            f"| {corpus}: {gr.get('texts') or sr.get('texts')} texts, "
            f"{gr.get('tokens') or sr.get('tokens')} tokens{note} "
            f"| {fmt(median_of(gs.values(), 'texts_per_s'))} / {fmt(median_of(gs.values(), 'tokens_per_s'))} "
            f"| {fmt(peer_rate[corpus])} / {fmt(median_of(ss.values(), 'tokens_per_s'))} "
            f"| {verdict} |"
        )
    int8 = []
    for corpus in ("short", "long"):
        q = load(out / f"speed-gpulane-int8-{corpus}.json")
        if not q:
            continue
        qr = first_result(q)
        cos = cosines(out / f"speed-vectors-int8-{corpus}.jsonl", out / f"speed-vectors-st-{corpus}.jsonl")
        agree = f"min {min(cos):.4f}, mean {sum(cos) / len(cos):.4f}" if cos else "–"
        int8.append(
            f"| {corpus} | {fmt(qr.get('texts_per_s'))} / {fmt(qr.get('tokens_per_s'))} "
            f"| {ratio(qr.get('texts_per_s'), peer_rate.get(corpus))} | {agree} |"
        )
    if not rows:
        return ["## Model speed", "", "not run", ""]
    g = next((v for v in reports if v.get("gpulane_version")), {})
    s = next((v for v in reports if v.get("peer")), {})
    runs = len(first_result(g or s).get("seconds", []))
    if rounds > 1:
        order = (
            f"The two sides ran in {rounds} rounds that alternate them (odd rounds gpulane "
            "first): rates are the rounds' medians, the ratio is the median of the rounds' "
            "ratios, each round's (r1, r2, …) in brackets."
        )
    else:
        order = "One run of each side."
    head = [
        "## Model speed (one process, no Temporal)" + measured_at(out, "speed-*.json"),
        "",
        f"float32 on the CPU, {g.get('threads', s.get('threads', '?'))} threads (gpulane) / "
        f"{s.get('threads', '?')} (peer), vector ISA {g.get('cpu_isa', '?')} (gpulane) / "
        f"{s.get('cpu_isa', '?')} (peer), batch 32, length-sorted, median of {runs} runs after "
        f"a warm-up. Peer: {s.get('peer', '?')}. {order}",
        "",
        "| corpus | gpulane texts/s / tokens/s | sentence-transformers texts/s / tokens/s | gpulane ÷ peer (rounds) |",
        "|---|---|---|---|",
    ]
    if int8:
        rows += [
            "",
            "`--dtype int8` (dense layers in dynamic int8, the CPU's opt-in `--cpu-dtype int8`), "
            "one run, against the peer's median f32 rate; cosine of each text's vector against sentence-transformers' f32 one:",
            "",
            "| corpus | gpulane int8 texts/s / tokens/s | int8 ÷ peer f32 | cosine to peer f32 |",
            "|---|---|---|---|",
        ] + int8
    return head + rows + [""]


def cosines(a, b):
    """Per-text cosine between two vector dumps (JSON list per line); [] if either is missing."""
    try:
        xs = [json.loads(line) for line in a.read_text().splitlines() if line]
        ys = [json.loads(line) for line in b.read_text().splitlines() if line]
    except (OSError, ValueError):
        return []
    out = []
    for x, y in zip(xs, ys):
        dot = sum(p * q for p, q in zip(x, y))
        nx, ny = sum(p * p for p in x) ** 0.5, sum(q * q for q in y) ** 0.5
        out.append(dot / (nx * ny) if nx and ny else 0.0)
    return out if len(xs) == len(ys) else []


def batching_section(out):
    d, z = load(out / "batching-default.json"), load(out / "batching-wait0.json")
    skipped = (out / "batching-skipped.txt")
    if not d and not z:
        why = skipped.read_text().strip() if skipped.exists() else "not run"
        return ["## Cross-activity batching", "", why, ""]
    d, z = d or {}, z or {}
    n = load(out / "batching-null.json") or {}
    w = d.get("workflows") or z.get("workflows")
    return [
        "## Cross-activity batching (gpulane on `cpu-tools`, real dev server)"
        + measured_at(out, "batching-*.json"),
        "",
        f"{w} concurrent `embed` activities of {d.get('texts_per_activity') or z.get('texts_per_activity')} "
        f"text, {mode(d or z)}; median of {d.get('rounds') or z.get('rounds')} rounds.",
        "",
        "| batch wait | activities/s | p50 latency s | p95 latency s |",
        "|---|---|---|---|",
        f"| {d.get('label', 'default')} | {fmt(d.get('activities_per_s'))} | {fmt(d.get('latency_p50_s'))} | {fmt(d.get('latency_p95_s'))} |",
        f"| {z.get('label', '0 ms (off)')} | {fmt(z.get('activities_per_s'))} | {fmt(z.get('latency_p50_s'))} | {fmt(z.get('latency_p95_s'))} |",
        f"| **batched ÷ unbatched** | {ratio(d.get('activities_per_s'), z.get('activities_per_s'))} | | |",
        f"| no-op worker (harness ceiling) | {fmt(n.get('activities_per_s'))} | {fmt(n.get('latency_p50_s'))} | {fmt(n.get('latency_p95_s'))} |",
        "",
    ]


def e2e_section(out):
    rows = []
    tags = {p.name.split("-")[2].rsplit(".", 1)[0] for p in out.glob("e2e-*-*.json")}
    # Big activities first, as in the issue; then any other load someone added.
    for tag in sorted(tags, key=lambda t: (t != "40x32", t != "200x1", t)):
        g, p = load(out / f"e2e-gpulane-{tag}.json") or {}, load(out / f"e2e-py-{tag}.json") or {}
        n = load(out / f"e2e-null-{tag}.json") or {}
        any_ = g or p or n
        rows.append(
            f"| {any_.get('workflows')} × {any_.get('texts_per_activity')} texts "
            f"| {fmt(g.get('activities_per_s'))} / {fmt(g.get('sentences_per_s'))} "
            f"| {fmt(p.get('activities_per_s'))} / {fmt(p.get('sentences_per_s'))} "
            f"| {ratio(g.get('sentences_per_s'), p.get('sentences_per_s'))} "
            f"| {fmt(g.get('latency_p50_s'))} / {fmt(p.get('latency_p50_s'))} "
            f"| {fmt(n.get('activities_per_s'))} / {fmt(n.get('sentences_per_s'))} |"
        )
    if not rows:
        return ["## End to end", "", "not run", ""]
    info = load(out / "e2e-info.json") or {}
    first = load(sorted(out.glob("e2e-*-*.json"))[0]) or {}
    return [
        "## End to end through Temporal (same dev server, same workflows)"
        + measured_at(out, "e2e-*-*.json"),
        "",
        f"gpulane: {info.get('gpulane', '?')}. Python worker: {info.get('py_worker', '?')}. "
        f"Activities {mode(first)}. "
        f"Median of {info.get('rounds', '?')} rounds; the load driver (also the workflow worker) "
        "shares the machine. The no-op worker answers at once: no worker can beat it on this load.",
        "",
        "| load (concurrent workflows × texts) | gpulane activities/s / sentences/s | Python worker activities/s / sentences/s | gpulane ÷ Python | p50 latency s (gpulane / Python) | no-op worker (harness ceiling) activities/s / sentences/s |",
        "|---|---|---|---|---|---|",
    ] + rows + [""]



def overhead_section(out):
    """gpulane against the no-op worker, one workflow per one-sentence call, rounds
    alternated: each pair's ratio, and the median of the pairs."""
    info = load(out / "overhead-info.json")
    if not info:
        return ["## Per-call overhead", "", "not run", ""]
    pairs = []
    for r in range(1, info["pairs"] + 1):
        g, n = load(out / f"overhead-gpulane-{r}.json"), load(out / f"overhead-null-{r}.json")
        if g and n:
            pairs.append((g["activities_per_s"], n["activities_per_s"]))
    if not pairs:
        return ["## Per-call overhead", "", "no pair completed", ""]
    rows = [f"| {i} | {fmt(g)} | {fmt(n)} | {100 * g / n:.0f}% |" for i, (g, n) in enumerate(pairs, 1)]
    med = statistics.median(g / n for g, n in pairs)
    return [
        "## Per-call overhead: gpulane against the no-op worker" + measured_at(out, "overhead-*.json"),
        "",
        f"200 concurrent workflows, each one `embed` of 1 text; gpulane (CPU lane, "
        f"{info.get('cpu_dtype', 'f32')}, --max-concurrent-cpu 256) and the no-op worker up at "
        f"once on one dev server, rounds alternated ({len(pairs)} pairs).",
        "",
        "| pair | gpulane activities/s | no-op activities/s | gpulane ÷ no-op |",
        "|---|---|---|---|",
        *rows,
        f"| **median of the pairs** | | | **{100 * med:.0f}%** |",
        "",
    ]

def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "benches/out")
    env = load(out / "env.json") or {}
    lines = [
        "# gpulane benchmarks",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu_name()}, "
        f"{os.cpu_count()} cores; {env.get('gpulane', 'gpulane ?')}; {env.get('peer', '')}; "
        f"load average before: {env.get('loadavg', '?')}.",
        "",
    ]
    lines += speed_section(out) + batching_section(out) + e2e_section(out) + overhead_section(out)
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
