"""`embed_dataset`, the claim-check activity: a dataset in storage (S3 through moto's
standalone server, or file://) embedded into Parquet part files under an output prefix,
through a real dev server and the real binary. Sharded over simulated cards, from every
format, resumed after a kill -9, pinned to a card, sharing a lane with interactive calls,
refusing bad input and anything outside its data roots."""

import asyncio
import json
import os
import pathlib
import random
import re
import statistics
import time
import uuid
from datetime import timedelta

from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from conftest import cosine_and_max_abs, minilm_dir, workflow_env
from datasets import PART, Dataset, Local, Output, S3Prefix, encode, make_ids, texts, write_dataset

DIMS = 384
LATENCY_REPORT = pathlib.Path(os.environ.get("GPULANE_DATASET_LATENCY_JSON", "/tmp/gpulane-dataset-latency.json"))


# --- helpers -----------------------------------------------------------------------------

def failure_chain(e: BaseException) -> str:
    parts = []
    while e is not None:
        parts.append(f"{type(e).__name__}: {getattr(e, 'type', '') or ''} {getattr(e, 'message', str(e))}")
        e = e.__cause__ or getattr(e, "cause", None)
    return " <- ".join(parts)


async def pending_report(handle) -> str:
    """Where each pending activity stands: attempt, state, last failure, last heartbeat."""
    try:
        desc = await handle.describe()
    except Exception as e:  # noqa: BLE001
        return f"(describe failed: {e!r})"
    lines = []
    for p in desc.raw_description.pending_activities:
        details = [pl.data.decode(errors="replace") for pl in p.heartbeat_details.payloads]
        lines.append(
            f"{p.activity_type.name} attempt {p.attempt} state {PendingActivityState.Name(p.state)} "
            f"last failure: {p.last_failure.message!r} heartbeat: {details}"
        )
    return "\n".join(lines) or "(no pending activity)"


def logs_of(workers) -> str:
    return "".join(f"\n--- worker {g.host} log (tail):\n{g.log()[-4000:]}" for g in workers)


async def run_handle(handle, timeout, workers=()):
    """The workflow's result; on a failure or past `timeout`, an AssertionError that says
    what failed, where its activities stand and what the workers logged."""
    try:
        return await asyncio.wait_for(handle.result(), timeout)
    except asyncio.TimeoutError:
        report = await pending_report(handle)
        try:
            await handle.terminate("test timed out")
        except Exception:  # noqa: BLE001
            pass
        raise AssertionError(f"no result after {timeout} s:\n{report}{logs_of(workers)}") from None
    except WorkflowFailureError as e:
        raise AssertionError(f"workflow failed: {failure_chain(e)}{logs_of(workers)}") from None


def run_wf(address, workflow, *args, timeout=240, workers=()):
    async def go():
        async with workflow_env(address) as (client, wf_queue):
            handle = await client.start_workflow(
                workflow, args=list(args), id=f"ds-{uuid.uuid4()}", task_queue=wf_queue,
                execution_timeout=timedelta(seconds=timeout + 60),
            )
            return await run_handle(handle, timeout, workers)

    return asyncio.run(go())


def try_dataset(address, queue, payload, timeout=45, workers=()):
    """One embed_dataset through `Try` (retries forever what is retryable, so a failure
    that should be final but is not shows as a timeout): {"ok": manifest} or {"error": ...}."""
    return run_wf(address, "Try", "embed_dataset", queue, payload, timeout=timeout, workers=workers)


async def start_dataset_job(client, wf_queue, request, heartbeat_s, tag, minutes):
    """Starts `EmbedDatasetOn` for `request` on cpu-tools with a short heartbeat timeout."""
    return await client.start_workflow(
        "EmbedDatasetOn", args=[request, "cpu-tools", None, {"heartbeat_s": heartbeat_s}],
        id=f"{tag}-{uuid.uuid4()}", task_queue=wf_queue, execution_timeout=timedelta(minutes=minutes),
    )


async def cancel_and_wait(handle, stopped, why, within=15) -> float:
    """Cancels the job's workflow, sees it end, then waits for `stopped()`: the worker
    hears of the cancel at the activity's next heartbeat. Gives the seconds from the
    cancel until then; past `within`, fails with `why()`."""
    await handle.cancel()
    cancelled_at = time.monotonic()
    try:
        await handle.result()
        raise AssertionError("the workflow was not cancelled")
    except WorkflowFailureError:
        pass
    while not stopped():
        assert time.monotonic() - cancelled_at < within, why()
        await asyncio.sleep(0.1)
    return time.monotonic() - cancelled_at


async def wait_for(handle, ready, within=60):
    """Waits until `ready()`; past `within`, fails saying where the job's activities stand."""
    deadline = time.monotonic() + within
    while not ready():
        assert time.monotonic() < deadline, await pending_report(handle)
        await asyncio.sleep(0.1)


def lanes_running(g) -> int:
    """Activities running on the worker's lanes, as `gpulane status` counts them."""
    return sum(l["running"] for l in g.status("--no-backlog")["lanes"])


def names(message: str, value: str) -> bool:
    """Whether a failure message names `value` whole (gpulane repeats URIs whole up to
    1,024 characters, so their file names show)."""
    return value in message


def metric_values(text: str, name: str, **labels) -> list:
    """Values of the samples of `name` whose labels include every given one."""
    out = []
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            out.append(float(m.group(2)))
    return out


def metric_sum(text: str, name: str, **labels) -> float:
    return sum(metric_values(text, name, **labels))


def series(text: str, *prefixes) -> str:
    """The exposition lines of the named series (for assertion messages)."""
    prefixes = prefixes or ("gpulane_dataset_", "gpulane_activity_seconds_count", "gpulane_batch_rows_total")
    return "\n".join(l for l in text.splitlines() if l.startswith(prefixes))


def check_manifest(m, *, data, output_uri, start, end, part_rows, whole=False):
    """A manifest as the contract gives it, and its part list tiling [start, end)."""
    assert m["output"] == output_uri, (m["output"], output_uri)
    name = "_manifest.json" if whole else f"_manifest-{start:09d}-{end:09d}.json"
    assert m["manifest"] == output_uri + name, m["manifest"]
    assert m["source"] == data.uri, m["source"]
    assert (m["start"], m["end"], m["rows"]) == (start, end, end - start), m
    assert m["dimensions"] == DIMS, m
    assert m["model"] == "all-MiniLM-L6-v2", m["model"]
    assert m["revision"].startswith("sha256:"), m["revision"]
    assert (m["dtype"], m["family"]) == ("f32", "bert"), m
    at = start
    for p in m["parts"]:
        assert p["uri"].startswith(output_uri), p
        mm = PART.match(p["uri"][len(output_uri):])
        assert mm, p
        s, e = map(int, mm.groups())
        assert s == at and e - s == p["rows"] and 0 < p["rows"] <= part_rows, (p, at)
        at = e
    assert at == end, ("parts do not reach the end", at, end)
    assert sum(p["rows"] for p in m["parts"]) == end - start


def check_parts_metadata(out: Output, manifest: dict):
    for meta in out.metadata:
        assert meta["gpulane.model"] == manifest["model"], meta
        assert meta["gpulane.revision"] == manifest["revision"], meta
        assert meta["gpulane.dtype"] == manifest["dtype"], meta
        assert meta["gpulane.family"] == manifest["family"], meta
        assert meta["gpulane.source"] == manifest["source"], meta


def check_against_direct_embed(address, queue, data, out, rows, tag):
    """The vectors (and token counts) stored for `rows` are what `embed` gives for the
    same texts. Returns the direct call's result."""
    direct = run_wf(address, "EmbedOn", queue, {"texts": [data.texts[r] for r in rows]})
    for r, want in zip(rows, direct["embeddings"]):
        got = out.vector(data.ids[r])
        cos, max_abs = cosine_and_max_abs(got, want)
        assert cos >= 0.9999 and max_abs <= 1e-4, (tag, r, data.texts[r][:60], cos, max_abs)
    assert sum(out.tokens(data.ids[r]) for r in rows) == direct["usage"]["tokens"], tag
    return direct


def new_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}/"


# --- a. sharded, from S3, over two simulated cards ------------------------------------------

def test_a_8000_row_parquet_on_s3_in_4_shards_over_2_cards(temporal_address, gpulane, s3):
    n, shards, part_rows = 8_000, 4, 1000
    loc = S3Prefix(s3, new_prefix())
    data = write_dataset(loc, "data/corpus.parquet", n, row_group_size=3000)
    g = gpulane("--model", str(minilm_dir()), "--simulate-gpus", "2x16GiB",
                "--data-root", loc.root_uri, env=s3.env())
    output = loc.uri("out/run1/")
    request = {"source": data.uri, "id_column": "id", "text_column": "text", "output": output}
    t0 = time.monotonic()
    manifests = run_wf(temporal_address, "EmbedDatasetShards", request, shards, "gpu-tools",
                       {"heartbeat_s": 10}, timeout=400, workers=[g])
    took = time.monotonic() - t0
    print(f"\n[a] {n} rows, {shards} shards over 2 simulated cards: {took:.1f} s, {n / took:.0f} rows/s")

    out = Output(loc, "out/run1/", DIMS)
    out.check_complete(data, loc, "out/run1/")
    assert out.others == [], out.others
    assert str(out.id_type) == "int64", out.id_type
    assert len(manifests) == shards
    listed = []
    for i, m in enumerate(manifests):
        start, end = i * n // shards, (i + 1) * n // shards
        check_manifest(m, data=data, output_uri=output, start=start, end=end, part_rows=part_rows)
        assert m["skipped_parts"] == 0, m
        assert m["tokens"] == sum(out.tokens(k) for k in data.ids[start:end]), (i, m["tokens"])
        # The manifest is in storage too, the same as returned.
        assert json.loads(loc.get(m["manifest"][len(loc.root_uri):])) == m
        listed += [p["uri"][len(output):] for p in m["parts"]]
    assert sorted(listed) == out.part_names
    assert len(out.manifest_names) == shards
    assert {(m["model"], m["revision"]) for m in manifests} == {(manifests[0]["model"], manifests[0]["revision"])}
    check_parts_metadata(out, manifests[0])

    sample = sorted(random.Random(7).sample(range(n), 50))
    direct = check_against_direct_embed(temporal_address, "gpu-tools", data, out, sample, "a")
    assert (direct["model"], direct["revision"]) == (manifests[0]["model"], manifests[0]["revision"])
    text = g.metrics()
    by_card = {dev: metric_sum(text, "gpulane_batch_rows_total", device=dev) for dev in ("GPU-SIM-t-0", "GPU-SIM-t-1")}
    print(f"[a] rows per card (gpulane_batch_rows_total): {by_card}")
    assert metric_sum(text, "gpulane_dataset_parts_total", outcome="written") == len(out.part_names), series(text)
    assert metric_sum(text, "gpulane_dataset_rows_total") >= n


# --- b. JSONL and CSV from the filesystem -------------------------------------------------

def test_b_jsonl_and_csv_from_a_file_root(temporal_address, gpulane, tmp_path):
    n, part_rows = 2000, 300
    loc = Local(tmp_path / "data")
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none", "--data-root", loc.root_uri)
    # The first 24 rows are the fixture's texts uncut: unicode, tabs and newlines (quoted
    # in the CSV), an empty text, 3,600 characters (truncated to the model's limit).
    jsonl = write_dataset(loc, "in/corpus.jsonl", n, ids="str", full_first=24)
    csv_ = write_dataset(loc, "in/corpus.csv", n, ids="int", full_first=24)
    for data, name, id_type in [(jsonl, "jsonl", "string"), (csv_, "csv", "int64")]:
        out_rel = f"out/{name}/"
        request = {"source": data.uri, "id_column": "id", "text_column": "text",
                   "output": loc.uri(out_rel), "part_rows": part_rows}
        t0 = time.monotonic()
        manifests = run_wf(temporal_address, "EmbedDatasetShards", request, 2, "cpu-tools",
                           timeout=300, workers=[g])
        print(f"\n[b] {name}: {n} rows in 2 shards, {time.monotonic() - t0:.1f} s")
        out = Output(loc, out_rel, DIMS)
        out.check_complete(data, loc, out_rel)
        assert out.others == [], out.others
        want = ("string", "large_string") if id_type == "string" else ("int64",)
        assert str(out.id_type) in want, (name, out.id_type)
        for i, m in enumerate(manifests):
            start, end = i * n // 2, (i + 1) * n // 2
            check_manifest(m, data=data, output_uri=loc.uri(out_rel), start=start, end=end, part_rows=part_rows)
        check_parts_metadata(out, manifests[0])
        rows = list(range(24)) + sorted(random.Random(3).sample(range(24, n), 16))
        check_against_direct_embed(temporal_address, "cpu-tools", data, out, rows, name)

    # The format named explicitly (an extension that says nothing), the whole dataset in
    # one call (the manifest is then `_manifest.json`), an output prefix given without its
    # trailing slash, `rows` instead of a shard.
    small = write_dataset(loc, "in/corpus.data", 100, fmt="jsonl")
    m = run_wf(temporal_address, "EmbedDatasetOn",
               {"source": small.uri, "format": "jsonl", "id_column": "id", "text_column": "text",
                "output": loc.uri("out/whole"), "part_rows": 40}, "cpu-tools", workers=[g])
    check_manifest(m, data=small, output_uri=loc.uri("out/whole/"), start=0, end=100, part_rows=40, whole=True)
    assert [p["rows"] for p in m["parts"]] == [40, 40, 20], m["parts"]
    Output(loc, "out/whole/", DIMS).check_complete(small, loc, "out/whole/")
    m = run_wf(temporal_address, "EmbedDatasetOn",
               {"source": small.uri, "format": "jsonl", "id_column": "id", "text_column": "text",
                "output": loc.uri("out/range/"), "rows": {"start": 10, "end": 35}}, "cpu-tools", workers=[g])
    check_manifest(m, data=small, output_uri=loc.uri("out/range/"), start=10, end=35, part_rows=1000)
    assert Output(loc, "out/range/", DIMS).ids == small.ids[10:35]


# --- c. kill -9 mid-shard, resumed by another worker ---------------------------------------

def test_c_a_killed_worker_s_job_resumes_on_another_skipping_the_parts_written(temporal_address, gpulane, s3):
    # Long enough that the job outlives a heartbeat listing two parts: 5,000 rows once
    # finished before the server held one, on a faster host.
    n, part_rows = 12000, 500
    loc = S3Prefix(s3, new_prefix())
    data = write_dataset(loc, "data/corpus.parquet", n)
    flags = ("--model", str(minilm_dir()), "--gpus", "none", "--data-root", loc.root_uri)
    first = gpulane(*flags, env=s3.env())
    first.expected_exit = None  # killed
    output = loc.uri("out/")
    request = {"source": data.uri, "id_column": "id", "text_column": "text", "output": output,
               "part_rows": part_rows}

    async def go():
        async with workflow_env(temporal_address) as (client, wf_queue):
            handle = await start_dataset_job(client, wf_queue, request, 5, "kill", 6)
            # Kill once the server holds a heartbeat that lists at least two written parts
            # (what a retried attempt resumes from).
            deadline = time.monotonic() + 120
            details = None
            while time.monotonic() < deadline:
                desc = await handle.describe()
                pending = desc.raw_description.pending_activities
                if pending and pending[0].heartbeat_details.payloads:
                    details = json.loads(pending[0].heartbeat_details.payloads[0].data)
                    if len(details.get("parts_done", [])) >= 2:
                        break
                if not pending and desc.status != WorkflowExecutionStatus.RUNNING:
                    raise AssertionError(f"the job ended before the kill: {desc.status}")
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"no heartbeat with 2 parts: {await pending_report(handle)}{logs_of([first])}")
            written_before = loc.list("out/")
            first.proc.kill()
            first.proc.wait(10)
            killed_at = time.monotonic()
            second = await asyncio.to_thread(gpulane, *flags, env=s3.env())
            manifest = await run_handle(handle, 240, [first, second])
            return details, written_before, second, manifest, time.monotonic() - killed_at

    details, written_before, second, m, resume_took = asyncio.run(go())
    print(f"\n[c] killed after heartbeat {details}; {len(written_before)} files in storage then; "
          f"resumed and finished {resume_took:.1f} s after the kill; skipped {m['skipped_parts']}")
    assert set(details) >= {"done", "parts_done", "rows_done", "rows_per_s"}, details
    assert details["rows_done"] == part_rows * len(details["parts_done"]), details
    for name in details["parts_done"]:
        assert PART.match(name), name

    check_manifest(m, data=data, output_uri=output, start=0, end=n, part_rows=part_rows, whole=True)
    assert m["skipped_parts"] >= len(details["parts_done"]), (m["skipped_parts"], details)
    assert set(details["parts_done"]) <= {p["uri"][len(output):] for p in m["parts"]}
    log = second.log()
    resuming = [l for l in log.splitlines() if "resuming" in l]
    assert resuming, log[-4000:]
    assert str(m["skipped_parts"]) in resuming[0], resuming
    text = second.metrics()
    assert metric_sum(text, "gpulane_dataset_parts_total", outcome="skipped") == m["skipped_parts"], series(text)
    assert metric_sum(text, "gpulane_dataset_parts_total", outcome="written") == len(m["parts"]) - m["skipped_parts"], series(text)
    assert metric_sum(text, "gpulane_dataset_rows_total") > 0, series(text)

    out = Output(loc, "out/", DIMS)
    out.check_complete(data, loc, "out/")
    assert out.others == [], out.others
    assert len(out.part_names) == n // part_rows
    check_parts_metadata(out, m)
    sample = sorted(random.Random(5).sample(range(n), 20))
    check_against_direct_embed(temporal_address, "cpu-tools", data, out, sample, "c")


# --- d. pinned to one card's private queue -----------------------------------------------

def test_d_a_job_sent_to_a_cards_private_queue_runs_there(temporal_address, gpulane, tmp_path):
    n = 1000
    loc = Local(tmp_path / "data")
    data = write_dataset(loc, "corpus.parquet", n)
    g = gpulane("--model", str(minilm_dir()), "--simulate-gpus", "2x16GiB", "--data-root", loc.root_uri)
    request = {"source": data.uri, "id_column": "id", "text_column": "text",
               "output": loc.uri("out/"), "part_rows": 250}
    r = run_wf(temporal_address, "PinnedDataset", request, {"heartbeat_s": 10}, workers=[g])
    private = r["first"]["host_task_queue"]
    card = r["first"]["device"]["uuid"]
    other = {"GPU-SIM-t-0": "GPU-SIM-t-1", "GPU-SIM-t-1": "GPU-SIM-t-0"}[card]
    assert private == f"gpu-tools.{g.host}.{card.lower()}", private
    check_manifest(r["manifest"], data=data, output_uri=loc.uri("out/"), start=0, end=n, part_rows=250, whole=True)
    Output(loc, "out/", DIMS).check_complete(data, loc, "out/")

    text = g.metrics()
    ran = {q: metric_sum(text, "gpulane_activity_seconds_count", activity_type="embed_dataset", task_queue=q)
           for q in ("gpu-tools", private, f"gpu-tools.{g.host}.{other.lower()}")}
    assert ran == {"gpu-tools": 0, private: 1, f"gpu-tools.{g.host}.{other.lower()}": 0}, (ran, series(text))
    assert metric_sum(text, "gpulane_activity_seconds_count", activity_type="embed_dataset",
                      outcome="completed", task_queue=private) == 1, series(text)
    # Its rows went through that card's engine, none through the other's.
    assert metric_sum(text, "gpulane_batch_rows_total", device=card) >= n, series(text)
    assert metric_sum(text, "gpulane_batch_rows_total", device=other) == 0, series(text)


# --- e. interactive calls beside a long job ------------------------------------------------

def test_e_small_calls_complete_while_a_long_job_runs_and_priority_is_reported(temporal_address, gpulane, tmp_path):
    # Knobs for measuring by hand: the job's rows, and shards (n activities of it at once,
    # so the engine holds several of the job's chunks at a time and a priority key has
    # queued rows to go ahead of).
    n, calls = int(os.environ.get("GPULANE_TEST_SHARING_ROWS", "15000")), 20
    shards = int(os.environ.get("GPULANE_TEST_SHARING_SHARDS", "1"))
    loc = Local(tmp_path / "data")
    data = write_dataset(loc, "corpus.parquet", n)
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none", "--data-root", loc.root_uri)
    phase = {"calls": calls}  # one after another, as a user waiting for each answer
    # Baseline: the same calls with nothing else running.
    idle = run_wf(temporal_address, "SmallCallsDuringJob", "cpu-tools", None,
                  [{**phase, "priority_key": None}], workers=[g])
    request = {"source": data.uri, "id_column": "id", "text_column": "text",
               "output": loc.uri("out/"), "part_rows": 1000}
    t0 = time.monotonic()
    r = run_wf(temporal_address, "SmallCallsDuringJob", "cpu-tools", request,
               [{**phase, "priority_key": None}, {**phase, "priority_key": 1}],
               {"delay_s": 3, "heartbeat_s": 10, "job_shards": shards}, timeout=400, workers=[g])
    took = time.monotonic() - t0
    job_done = r["job"]["done_at"]
    for i, m in enumerate(r["job"]["manifests"]):
        check_manifest(m, data=data, output_uri=loc.uri("out/"), start=i * n // shards,
                       end=(i + 1) * n // shards, part_rows=1000, whole=shards == 1)
    Output(loc, "out/", DIMS).check_complete(data)

    def stats(calls_):
        lat = sorted(c["latency_s"] for c in calls_)
        return {"calls": len(lat), "p50_s": statistics.median(lat),
                "p90_s": lat[int(0.9 * (len(lat) - 1))], "max_s": lat[-1], "mean_s": statistics.fmean(lat)}

    report = {
        "what": f"{calls} one-text embed calls one after another on cpu-tools (latency as the "
                f"workflow sees it), beside an embed_dataset job of {n} rows (part_rows 1000; "
                f"{shards} shard activit{'y' if shards == 1 else 'ies'} at once) at the default "
                f"priority; MiniLM f32 on the CPU lane",
        "machine": f"{os.cpu_count()} cores",
        "job_rows": n, "job_shards": shards, "job_seconds_in_workflow": job_done, "job_rows_per_s": n / job_done,
        "idle": stats(idle["phases"][0]["calls"]),
        "during_job_default_priority": stats(r["phases"][0]["calls"]),
        "during_job_priority_key_1": stats(r["phases"][1]["calls"]),
        "wall_s": took,
    }
    LATENCY_REPORT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n[e] small-call latency (s), written to {LATENCY_REPORT}:")
    for k in ("idle", "during_job_default_priority", "during_job_priority_key_1"):
        s = report[k]
        print(f"    {k:32s} p50 {s['p50_s']:.3f}  p90 {s['p90_s']:.3f}  max {s['max_s']:.3f}")
    print(f"    job: {n} rows in {shards} shard(s), {job_done:.1f} s ({n / job_done:.0f} rows/s)")

    for ph in r["phases"]:
        last = max(c["end"] for c in ph["calls"])
        assert last < job_done, (f"priority {ph['priority_key']}: the small calls ended at {last:.1f} s, "
                                 f"the job at {job_done:.1f} s: make the job longer (GPULANE_TEST_SHARING_ROWS)")


# --- f. bad input --------------------------------------------------------------------------

def test_f_bad_input_fails_once_non_retryably_naming_what_is_wrong(temporal_address, gpulane, s3):
    root = S3Prefix(s3, new_prefix())
    elsewhere = S3Prefix(s3, new_prefix())  # in the bucket, outside the worker's roots
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none", "--data-root", root.root_uri, env=s3.env())
    good = write_dataset(root, "data/good.parquet", 100)
    outside = write_dataset(elsewhere, "data/corpus.parquet", 100)
    garbage = root.put("data/garbage.parquet", b"PAR1 this is not a parquet file at all " * 50)
    bad_json = root.put("data/bad.jsonl", b'{"id": 0, "text": "fine"}\nthis line is not JSON\n')
    dup_ids = make_ids(100, [*range(50), 987654, *range(51, 70), 987654, *range(71, 100)])
    dups = root.put("data/dups.parquet", encode("parquet", dup_ids, texts(100)))
    # Row 1 fits the per-text limit (100,000 characters) alone, not with a prompt.
    long_row = root.put("data/long.parquet", encode("parquet", [0, 1], ["short", "x" * 99_998]))
    # 20 rows of 60,000 characters: one call of the job over embed's per-call total
    # (1,000,000), which a dataset caller cannot split; with a prompt, it must still run.
    wide = root.put("data/wide.parquet", encode("parquet", list(range(20)), ["y" * 60_000] * 20))

    def req(source, k, **kw):
        return {"source": source, "id_column": "id", "text_column": "text",
                "output": root.uri(f"out/case{k}/"), **kw}

    cases = [
        (req(good.uri, 0, text_column="body"), ["body"]),
        (req(good.uri, 1, id_column="doc_id"), ["doc_id"]),
        (req(root.uri("data/nope.parquet"), 2), [root.uri("data/nope.parquet")]),
        (req(outside.uri, 3), [outside.uri]),
        ({**req(good.uri, 4), "output": elsewhere.uri("out/")}, [elsewhere.uri("out/")]),
        (req(garbage, 5), [garbage]),
        (req(bad_json, 6), [bad_json]),
        (req(dups, 7), ["987654"]),
        # Options are checked against the model even where the range holds no rows.
        (req(good.uri, 8, rows={"start": 5, "end": 5}, dimensions=9999), ["dimensions", "384"]),
        (req(good.uri, 9, rows={"start": 5, "end": 5}, prompt_name="nope"), ["prompt_name", "nope"]),
        (req(good.uri, 10, prompt="query: ", prompt_name="query"), ["prompt", "prompt_name"]),
        # A wrong type names its field (serde's message named none).
        (req(good.uri, 11, part_rows="10"), ['field "part_rows" must be']),
        (req(good.uri, 12, shard={"index": -1, "count": 2}), ["shard.index"]),
        # The prompt counts with each row, and the failure names the source row.
        (req(long_row, 13, prompt="query: "), ["row 1 of", long_row, "prompt"]),
    ]
    before = s3.keys()
    for payload, fragments in cases:
        t0 = time.monotonic()
        out = try_dataset(temporal_address, "cpu-tools", payload, workers=[g])
        assert "error" in out, (payload, out)
        err = out["error"]
        assert err["type"] == "InvalidInput" and err["non_retryable"] is True, (payload, err)
        print(f"\n[f] {err['message']}")
        for f in fragments:
            assert names(err["message"], f), (payload, f, err["message"])
        assert time.monotonic() - t0 < 30, "a final failure is final at once"
    after = s3.keys()
    new = sorted(set(after) - set(before))
    outputs = [root.prefix + f"out/case{k}/" for k in range(len(cases))]
    stray = [k for k in new if not any(k.startswith(o) for o in outputs)]
    assert not stray, stray
    print(f"\n[f] files written under the failed jobs' output prefixes: {new}")
    # The worker serves on.
    ok = try_dataset(temporal_address, "cpu-tools", req(good.uri, 99), workers=[g])
    assert ok["ok"]["rows"] == 100, ok
    ok = try_dataset(temporal_address, "cpu-tools", req(wide, 98, prompt="q: "), workers=[g])
    assert ok.get("ok", {}).get("rows") == 20, ok


def test_f_a_jsonl_source_over_the_limit_is_refused_whole_and_runs_in_shards(temporal_address, gpulane, tmp_path):
    """JSON Lines is read in two passes: every id and where each row starts, then only the
    job's rows. The limit bounds what a job holds, so the file refused whole runs in
    shards that each fit, and a refused job writes nothing."""
    root = Local(tmp_path / "root")
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none", "--data-root", root.root_uri,
                "--max-dataset-bytes", "100000")
    small = write_dataset(root, "small.jsonl", 10)
    rows = [f"{i} " + "z" * 20_000 for i in range(10)]
    big = root.put("big.jsonl", encode("jsonl", list(range(10)), rows))

    def req(source, out):
        return {"source": source, "id_column": "id", "text_column": "text",
                "output": root.uri(f"out/{out}/")}

    out = try_dataset(temporal_address, "cpu-tools", req(big, "big"), workers=[g])
    assert "error" in out, out
    err = out["error"]
    assert err["type"] == "InvalidInput" and err["non_retryable"] is True, err
    print(f"\n[f] {err['message']}")
    for fragment in (big, "rows 0 to 10 of its 10", "over the limit of 100000 bytes", "--max-dataset-bytes",
                     "more shards"):
        assert names(err["message"], fragment), (fragment, err["message"])
    assert not root.list("out/big/"), "a refused job wrote nothing"
    ok = try_dataset(temporal_address, "cpu-tools", req(small.uri, "small"), workers=[g])
    assert ok["ok"]["rows"] == 10, ok
    manifests = run_wf(temporal_address, "EmbedDatasetShards", req(big, "shards"), 5, "cpu-tools",
                       timeout=300, workers=[g])
    assert sum(m["rows"] for m in manifests) == 10, manifests
    Output(root, "out/shards/", DIMS).check_complete(Dataset(big, list(range(10)), rows), root, "out/shards/")


def test_f_a_parquet_source_over_the_limit_runs_in_shards_that_each_fit(temporal_address, gpulane, tmp_path):
    """A Parquet shard reads its own rows' texts (and every id), so the limit bounds a
    shard, not the file; and it counts the texts decoded, not the file's compressed size."""
    root = Local(tmp_path / "root")
    # The host's memory is declared so that the CPU lane admits several shards at once
    # whatever this machine has free: the turns asserted below need two jobs to meet.
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none", "--data-root", root.root_uri,
                "--max-dataset-bytes", "100000", "--simulated-host-memory", "8GiB")
    n, shards = 400, 8
    ids = make_ids(n)
    rows = [f"passage {i}: " + "the lane keeps its cards busy " * 34 for i in range(n)]
    uri = root.put("big.parquet", encode("parquet", ids, rows, row_group_size=50))
    data = Dataset(uri, ids, rows)
    stored = len(root.get("big.parquet"))
    print(f"\n[f] {n} rows of ~{len(rows[0])} characters: {stored} bytes stored, "
          f"{sum(map(len, rows))} of text")
    assert stored < 100_000 < sum(map(len, rows)), "compressed under the limit, decoded over it"

    def req(out):
        return {"source": uri, "id_column": "id", "text_column": "text", "output": root.uri(f"out/{out}/")}

    whole = try_dataset(temporal_address, "cpu-tools", req("whole"), workers=[g])
    assert "error" in whole, whole
    err = whole["error"]
    assert err["type"] == "InvalidInput" and err["non_retryable"] is True, err
    print(f"[f] {err['message']}")
    for fragment in (uri, "rows 0 to 400", "over the limit of 100000 bytes", "--max-dataset-bytes",
                     "more shards"):
        assert names(err["message"], fragment), (fragment, err["message"])
    assert not root.list("out/whole/"), "a refused job wrote nothing"

    manifests = run_wf(temporal_address, "EmbedDatasetShards", req("shards"), shards, "cpu-tools",
                       timeout=300, workers=[g])
    assert [(m["start"], m["end"]) for m in manifests] == [(i * 50, i * 50 + 50) for i in range(shards)]
    out = Output(root, "out/shards/", DIMS)
    out.check_complete(data, root, "out/shards/")
    # The limit is the worker's, not each job's: two shards' texts do not fit in it at once,
    # so the shards sent together took turns, each waiting for the one before to end.
    waits = g.log().count("waiting for memory other embed_dataset jobs hold")
    print(f"[f] shard reads that waited for another shard's memory: {waits}")
    assert waits >= 1, "the shards ran at once, each holding its own limit"
    text = g.metrics()
    assert metric_sum(text, "gpulane_dataset_memory_limit_bytes") == 100_000, series(text, "gpulane_dataset")
    assert metric_sum(text, "gpulane_dataset_memory_wait_seconds_total", device="cpu") > 0, series(text, "gpulane_dataset")
    # Every job ended, so none holds any.
    assert metric_sum(text, "gpulane_dataset_memory_held_bytes") == 0, series(text, "gpulane_dataset")


# --- g. the data roots hold --------------------------------------------------------------

def test_g_nothing_outside_the_data_roots_is_read_or_written(temporal_address, gpulane, tmp_path, s3):
    root = Local(tmp_path / "root")
    outside = Local(tmp_path / "outside")
    s3root = S3Prefix(s3, new_prefix())
    s3other = S3Prefix(s3, new_prefix())
    ok = write_dataset(root, "ok.jsonl", 10)
    secret = write_dataset(outside, "secret.jsonl", 10)
    write_dataset(s3other, "secret.parquet", 10)
    (root.root / "link.jsonl").symlink_to(outside.root / "secret.jsonl")
    (root.root / "linkdir").symlink_to(outside.root, target_is_directory=True)
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none",
                "--data-root", root.root_uri, "--data-root", s3root.root_uri, env=s3.env())

    def req(source, output=None):
        return {"source": source, "id_column": "id", "text_column": "text",
                "output": output or root.uri(f"out/{uuid.uuid4().hex[:6]}/")}

    def normalized(uri):
        scheme, rest = uri.split("://", 1)
        head, _, path = rest.partition("/")
        return f"{scheme}://{head}{os.path.normpath('/' + path)}"

    cases = [
        (req("file:///etc/passwd"), "file:///etc/passwd"),
        (req(root.uri("../outside/secret.jsonl")), root.uri("../outside/secret.jsonl")),
        (req(root.uri("sub/../../outside/secret.jsonl")), root.uri("sub/../../outside/secret.jsonl")),
        (req(root.uri("link.jsonl")), root.uri("link.jsonl")),
        (req(root.uri("linkdir/secret.jsonl")), root.uri("linkdir/secret.jsonl")),
        (req(ok.uri, root.uri("../outside/out/")), root.uri("../outside/out/")),
        (req(ok.uri, root.uri("linkdir/out/")), root.uri("linkdir/out/")),
        (req(s3root.uri("../" + s3other.prefix + "secret.parquet")), s3root.uri("../" + s3other.prefix + "secret.parquet")),
        (req(ok.uri, s3root.uri("../" + s3other.prefix + "out/")), s3root.uri("../" + s3other.prefix + "out/")),
    ]
    outside_before = outside.list()
    s3_before = s3.keys()
    for payload, uri in cases:
        out = try_dataset(temporal_address, "cpu-tools", payload, workers=[g])
        assert "error" in out, (payload, "was served", out)
        err = out["error"]
        assert err["type"] == "InvalidInput" and err["non_retryable"] is True, (payload, err)
        print(f"\n[g] {err['message']}")
        assert names(err["message"], uri) or names(err["message"], normalized(uri)), (uri, err["message"])
    # Percent-encoded dots: refused too (whatever the message names).
    for source in (root.uri("%2e%2e/outside/secret.jsonl"), root.uri("%2E%2E/outside/secret.jsonl")):
        out = try_dataset(temporal_address, "cpu-tools", req(source), workers=[g])
        assert "error" in out and out["error"]["type"] == "InvalidInput" and out["error"]["non_retryable"], (source, out)
    assert outside.list() == outside_before, "written outside the root"
    new_s3 = [k for k in s3.keys() if k not in s3_before]
    assert not any(k.startswith(s3other.prefix) for k in new_s3), new_s3
    # Inside the root all is well.
    good = try_dataset(temporal_address, "cpu-tools", req(ok.uri), workers=[g])
    assert good["ok"]["rows"] == 10, good


# --- h. cancellation -----------------------------------------------------------------------

def test_h_a_cancelled_job_stops_and_keeps_the_parts_it_wrote(temporal_address, gpulane, tmp_path):
    n, part_rows = 4000, 250
    loc = Local(tmp_path / "data")
    data = write_dataset(loc, "corpus.parquet", n)
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none", "--data-root", loc.root_uri)
    request = {"source": data.uri, "id_column": "id", "text_column": "text",
               "output": loc.uri("out/"), "part_rows": part_rows}

    async def go():
        async with workflow_env(temporal_address) as (client, wf_queue):
            handle = await start_dataset_job(client, wf_queue, request, 2, "cancel", 3)
            await wait_for(handle, lambda: any(PART.match(n[4:]) for n in loc.list("out/")))
            return await cancel_and_wait(handle, lambda: lanes_running(g) == 0,
                                         lambda: f"still running{logs_of([g])}")

    stopped_after = asyncio.run(go())
    parts = [n for n in loc.list("out/") if PART.match(n[4:])]
    time.sleep(2)
    assert [n for n in loc.list("out/") if PART.match(n[4:])] == parts, "parts written after the job stopped"
    print(f"\n[h] the worker stopped the job {stopped_after:.1f} s after the cancel; {len(parts)} of "
          f"{n // part_rows} parts kept")
    assert 1 <= len(parts) < n // part_rows, parts
    out = Output(loc, "out/", DIMS)  # the parts kept are whole and readable
    assert out.others == [], out.others
    assert len(out) == part_rows * len(parts)
    # The worker serves on.
    assert run_wf(temporal_address, "EmbedOn", "cpu-tools", {"texts": ["after the cancel"]})["embeddings"]


def test_h_a_job_cancelled_while_it_reads_its_source_stops_reading(temporal_address, gpulane, s3):
    """The read runs on the blocking pool, which the cancelled activity's drop does not
    stop: it must stop itself at its next claim of dataset memory, not read on to the end
    of the source holding its share of --max-dataset-bytes. A Parquet file of many small
    row groups on S3 makes the read long (one fetch a row group's ids, then one a row
    group's texts), and moto's request log shows how far it went."""
    row_groups, per_group = 3000, 10
    root = S3Prefix(s3, new_prefix())
    n = row_groups * per_group
    uri = root.put("data/many-groups.parquet",
                   encode("parquet", list(range(n)), texts(n), row_group_size=per_group))
    key = root.prefix + "data/many-groups.parquet"
    g = gpulane("--model", str(minilm_dir()), "--gpus", "none", "--data-root", root.root_uri, env=s3.env())
    request = {"source": uri, "id_column": "id", "text_column": "text", "output": root.uri("out/")}

    def held():
        return metric_sum(g.metrics(), "gpulane_dataset_memory_held_bytes")

    async def go():
        async with workflow_env(temporal_address) as (client, wf_queue):
            handle = await start_dataset_job(client, wf_queue, request, 2, "cancel-read", 3)
            # Under way: past the footer, into the row groups, and holding memory.
            await wait_for(handle, lambda: s3.requests("GET", key) >= 20 and held() > 0)
            at_cancel = s3.requests("GET", key)
            # The read stops at its next claim and gives back what it held.
            stopped_after = await cancel_and_wait(
                handle, lambda: lanes_running(g) == 0 and held() == 0,
                lambda: f"still running or holding {held()} bytes, {s3.requests('GET', key)} "
                        f"fetches{logs_of([g])}")
            return at_cancel, stopped_after

    at_cancel, stopped_after = asyncio.run(go())
    stopped_at = s3.requests("GET", key)
    time.sleep(3)
    after = s3.requests("GET", key)
    print(f"\n[h] fetches of the source: {at_cancel} at the cancel, {stopped_at} when the job had "
          f"stopped ({stopped_after:.1f} s later), {after} 3 s after; a whole read takes over "
          f"{2 * row_groups}")
    assert after == stopped_at, "the read went on after the job stopped"
    # Had the read gone on to the end, it would have fetched every row group's ids and
    # texts before giving its memory back.
    assert stopped_at < row_groups, (
        f"{stopped_at} fetches: the read got through the ids of {row_groups} row groups "
        f"(over {2 * row_groups} fetches in all) before it stopped"
        + ("" if at_cancel < row_groups // 2 else
           f"; it had made {at_cancel} at the cancel: make the source longer (row_groups)"))
    assert not root.list("out/"), root.list("out/")
    # The worker serves on.
    assert run_wf(temporal_address, "EmbedOn", "cpu-tools", {"texts": ["after the cancel"]})["embeddings"]
