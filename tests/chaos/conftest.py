"""Harness for the chaos suite: a restartable Temporal dev server (persistent SQLite file,
fixed loopback ports), real `gpulane run` processes that tests kill, stop and start, a
Python workflow worker, and a recorder that prints `EXPECTED:` / `SAW:` per experiment and
writes `tests/chaos/out/results.json`.

Helpers are reused from tests/integration/conftest.py (loaded under another module name,
since this file is `conftest` too) and its workflows.py.
"""

import asyncio
import contextlib
import datetime
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

CHAOS = pathlib.Path(__file__).resolve().parent
ROOT = CHAOS.parents[1]
OUT = CHAOS / "out"
INTEGRATION = ROOT / "tests" / "integration"

if str(CHAOS) not in sys.path:
    sys.path.insert(0, str(CHAOS))
if str(INTEGRATION) not in sys.path:
    sys.path.append(str(INTEGRATION))  # for `workflows` (the integration tests' workflows)


def _load_integration_conftest():
    spec = importlib.util.spec_from_file_location("gpulane_integration_conftest", INTEGRATION / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_it = _load_integration_conftest()
BIN = _it.BIN
TEMPORAL = _it.TEMPORAL
FIXTURES = _it.FIXTURES
free_port = _it.free_port
wait_port = _it.wait_port
IntegrationGpulane = _it.Gpulane

# The model every experiment serves: tiny, so the CPU (2 cores here) is not the bottleneck
# and the experiments measure Temporal and gpulane, not matrix products.
EMBED_MODEL = "tiny-bert-cls"
EMBED_MODEL_DIR = FIXTURES / "tiny-bert-cls"
EMBED_DIMENSIONS = 32
RERANK_MODEL = "tiny-cross-encoder"
RERANK_MODEL_DIR = FIXTURES / "tiny-cross-encoder"

# Extra `temporal server start-dev` arguments, e.g.
# CHAOS_TEMPORAL_ARGS="--dynamic-config-value frontend.enableCancelWorkerPollsOnShutdown=true"
TEMPORAL_EXTRA_ARGS = os.environ.get("CHAOS_TEMPORAL_ARGS", "").split()

# Per-experiment hard limit (SIGALRM), on top of each experiment's own bounds.
DEFAULT_BOUND_S = 300


def _quiet_temporal_runtime():
    """The Python SDK's core logs every retried call while the server is down (hundreds of
    lines in the restart experiment): keep only its errors on the console."""
    from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

    Runtime.set_default(
        Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(
            filter=TelemetryFilter(core_level="ERROR", other_level="ERROR")))),
        error_if_already_set=False,
    )


def _interrupt_on_sigterm(signum, frame):
    # run.sh's overall `timeout` sends SIGTERM: turn it into what Ctrl-C does, so pytest
    # still tears the fixtures down (no orphaned workers or dev servers) and writes results.
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    _quiet_temporal_runtime()
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    config.addinivalue_line("markers", "fast: a quick experiment, part of `run.sh --fast`")
    config.addinivalue_line("markers", "bound(seconds): hard wall-clock limit of the experiment")
    config._chaos_results = []
    config._chaos_started = time.time()


# --------------------------------------------------------------------------------------
# The experiment recorder
# --------------------------------------------------------------------------------------


class Experiment:
    """What an experiment expects and what it saw. `see()` notes an observation as it
    happens (printed at once, so a hung or failed run still shows how far it got)."""

    def __init__(self, name: str, directory: pathlib.Path):
        self.name = name
        self.dir = directory
        self.expected = ""
        self.saw = []
        self.t0 = time.monotonic()

    def expect(self, text: str) -> None:
        self.expected = text
        print(f"\nEXPECTED: {text}", flush=True)

    def see(self, text: str) -> None:
        self.saw.append(text)
        print(f"  [{time.monotonic() - self.t0:6.1f}s] saw: {text}", flush=True)

    def saw_line(self) -> str:
        return "; ".join(self.saw) if self.saw else "(nothing recorded)"


def _experiment_name(item) -> str:
    name = item.name
    if name.startswith("test_"):
        name = name[len("test_"):]
    return name


@pytest.fixture
def exp(request):
    """The experiment's recorder and its output folder tests/chaos/out/<name>/ (emptied
    first): the dev server's database and log, every worker's log."""
    name = _experiment_name(request.node)
    directory = OUT / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    e = Experiment(name, directory)
    request.node._chaos_exp = e
    yield e
    print(f"\nSAW: {e.saw_line()}", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    marker = item.get_closest_marker("bound")
    bound = int(marker.args[0]) if marker else DEFAULT_BOUND_S

    def expire(signum, frame):
        raise TimeoutError(f"experiment exceeded its hard bound of {bound} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(bound)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _short_error(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    text = " ".join(text.split())
    return text[:240]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    state = item.__dict__.setdefault("_chaos_state", {"seconds": 0.0, "failed": [], "skipped": False})
    state["seconds"] += report.duration
    exp = getattr(item, "_chaos_exp", None)
    if report.failed:
        state["failed"].append(report.when)
        if exp is not None and report.when != "teardown":
            exp.saw.append(f"FAILED ({report.when}): {_short_error(report)}")
    if report.skipped:
        state["skipped"] = True
    if report.when == "teardown":
        if report.failed and exp is not None:
            msg = f"FAILED (teardown): {_short_error(report)}"
            exp.saw.append(msg)
            print(f"SAW (teardown): {msg}", flush=True)
        item.config._chaos_results.append({
            "name": exp.name if exp else _experiment_name(item),
            "test": item.nodeid,
            "fast": item.get_closest_marker("fast") is not None,
            "expected": exp.expected if exp else "",
            "saw": exp.saw_line() if exp else ("skipped" if state["skipped"] else ""),
            "passed": not state["failed"] and not state["skipped"],
            "skipped": state["skipped"],
            "seconds": round(state["seconds"], 1),
        })


def pytest_sessionfinish(session, exitstatus):
    results = getattr(session.config, "_chaos_results", None)
    if results is None:
        return
    OUT.mkdir(parents=True, exist_ok=True)
    binary = {"path": str(BIN)}
    if BIN.exists():
        binary["mtime"] = datetime.datetime.fromtimestamp(BIN.stat().st_mtime, datetime.timezone.utc).isoformat()
    doc = {
        "suite": "gpulane chaos",
        "started": datetime.datetime.fromtimestamp(session.config._chaos_started, datetime.timezone.utc).isoformat(),
        "seconds": round(time.time() - session.config._chaos_started, 1),
        "binary": binary,
        "experiments": results,
    }
    (OUT / "results.json").write_text(json.dumps(doc, indent=2) + "\n")


# --------------------------------------------------------------------------------------
# The Temporal dev server, restartable on the same ports and database
# --------------------------------------------------------------------------------------


class DevServer:
    """`temporal server start-dev` on fixed loopback ports with a SQLite file, so it can be
    killed and started again with its workflows intact."""

    def __init__(self, directory: pathlib.Path):
        self.dir = directory
        self.db = directory / "temporal.db"
        self.log_path = directory / "temporal.log"
        self.port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc = None
        self.starts = 0

    def command(self) -> list:
        return [
            str(TEMPORAL), "server", "start-dev", "--ip", "127.0.0.1",
            "--port", str(self.port), "--headless",
            "--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port),
            "--db-filename", str(self.db), "--log-level", "warn", *TEMPORAL_EXTRA_ARGS,
        ]

    def start(self, timeout: float = 60) -> float:
        """Starts the server and waits until it answers; returns the seconds it took."""
        assert TEMPORAL.exists(), f"{TEMPORAL} missing: run scripts/setup.sh"
        assert self.proc is None or self.proc.poll() is not None, "already running"
        t0 = time.monotonic()
        log = open(self.log_path, "a")
        log.write(f"\n=== start {self.starts} at {datetime.datetime.now().isoformat()}\n")
        log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.starts += 1
        deadline = t0 + timeout
        wait_port(self.port, deadline)
        asyncio.run(self._wait_answers(deadline))
        return time.monotonic() - t0

    async def _wait_answers(self, deadline: float) -> None:
        from temporalio.client import Client

        while True:
            try:
                client = await Client.connect(self.address)
                await client.workflow_service.get_system_info(
                    __import__("temporalio.api.workflowservice.v1", fromlist=["x"]).GetSystemInfoRequest()
                )
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the dev server does not answer on {self.address}:\n{self.log()[-3000:]}")
                await asyncio.sleep(0.2)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, sig=signal.SIGKILL, down_s: float = 0) -> dict:
        """Stops the server with `sig`, leaves it down `down_s` seconds, and starts it again
        on the same ports and database; returns {"stop_s", "start_s"}."""
        t0 = time.monotonic()
        self.stop(sig)
        stop_s = time.monotonic() - t0
        time.sleep(down_s)
        return {"stop_s": stop_s, "start_s": self.start()}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def server(exp):
    """A fresh dev server per experiment (nothing left from another experiment polls or
    waits on `gpu-tools`)."""
    s = DevServer(exp.dir)
    took = s.start()
    print(f"  dev server on {s.address} ({took:.1f} s to answer), db {s.db}", flush=True)
    try:
        yield s
    finally:
        s.stop(signal.SIGTERM)


# --------------------------------------------------------------------------------------
# gpulane workers
# --------------------------------------------------------------------------------------


class Worker(IntegrationGpulane):
    """A `gpulane run` process (the integration harness's Gpulane, plus signals and the
    lookups the experiments need)."""

    def __init__(self, proc, log_path, host, name):
        super().__init__(proc, log_path, host)
        self.name = name
        self.started_at = time.monotonic()

    def wait_ready(self, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while "gpulane ready" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        return time.monotonic() - self.started_at

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.expected_exit = None
        self.proc.kill()

    def wait_exit(self, timeout: float):
        """The exit status, or None if it still runs after `timeout`."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def readyz(self):
        try:
            return self.get("/readyz")[0]
        except Exception:
            return None

    def gauge(self, name: str, **labels):
        """A sample of /metrics by exact label set (as Prometheus text writes it, sorted)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        pattern = rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
        m = re.search(pattern, self.metrics(), re.M)
        return float(m.group(1)) if m else None

    def identity(self) -> str:
        """The worker's identity prefix (lanes append /<device>/<queue>)."""
        m = re.search(r"gpulane ready .* identity=(\S+)", self.log())
        if m:
            return m.group(1)
        return self.status("--no-backlog")["identity"]

    def private_queues(self) -> dict:
        """{device id: private queue} of its GPU lanes, from `gpulane status --json`."""
        status = self.status("--no-backlog")
        return {l["device"]: l["task_queue"] for l in status["lanes"] if l["kind"] == "private"}

    def devices(self) -> list:
        return [d["id"] for d in self.status("--no-backlog")["devices"] if d["kind"] == "gpu"]


@pytest.fixture
def workers(server, exp):
    """start(*args, host=..., env=..., name=..., wait_ready=True) runs `gpulane run ARGS`
    against this experiment's server. At the end every worker still running gets SIGTERM
    and must exit 0 (unless the experiment set `expected_exit` to something else or None)."""
    started = []

    def start(*args, host=None, env=None, name=None, wait_ready=True, ready_timeout=120):
        assert BIN.exists(), f"{BIN} missing: run scripts/setup.sh (or the binary is being rebuilt)"
        name = name or f"w{len(started)}"
        host = host or f"chaos-{name}-{uuid.uuid4().hex[:6]}"
        log_path = exp.dir / f"gpulane-{name}.log"
        # The caller's own GPULANE_* / TEMPORAL_* settings stay out: each experiment says
        # exactly how its workers run.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("GPULANE_", "TEMPORAL_"))}
        full_env = {
            **inherited,
            "TEMPORAL_ADDRESS": server.address,
            "GPULANE_HOST": host,
            "RUST_LOG": "info",
            "GPULANE_METRICS_ADDRESS": "127.0.0.1:0",
            "GPULANE_ADMIN_ADDRESS": "127.0.0.1:0",
            "GPULANE_DRAIN_PRIVATE_SECS": "1",
            **(env or {}),
        }
        for k, v in (env or {}).items():
            if v is None:
                full_env.pop(k, None)
        proc = subprocess.Popen(
            [str(BIN), "run", *args], stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=full_env,
        )
        w = Worker(proc, log_path, host, name)
        started.append(w)
        if wait_ready:
            w.wait_ready(ready_timeout)
        return w

    yield start
    problems = []
    for w in started:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in started:
        try:
            w.proc.wait(60)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
            problems.append(f"{w.name} did not exit within 60 s of SIGTERM")
            continue
        if w.expected_exit is not None and w.proc.returncode != w.expected_exit:
            problems.append(f"{w.name} exited {w.proc.returncode} after SIGTERM, expected {w.expected_exit}")
    assert not problems, "; ".join(problems)


def model_args(*, rerank: bool = False) -> list:
    args = ["--model", f"{EMBED_MODEL}={EMBED_MODEL_DIR}"]
    if rerank:
        args += ["--model", f"{RERANK_MODEL}={RERANK_MODEL_DIR}"]
    return args


# --------------------------------------------------------------------------------------
# Temporal client side
# --------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def workflow_env(address):
    """A Temporal client and a Python worker for the chaos and integration workflows on a
    fresh workflow queue."""
    from temporalio.client import Client
    from temporalio.worker import Worker as PyWorker

    import chaos_workflows
    import workflows

    client = await Client.connect(address)
    queue = f"chaos-wf-{uuid.uuid4().hex[:8]}"
    async with PyWorker(client, task_queue=queue, workflows=chaos_workflows.ALL + workflows.ALL,
                        max_concurrent_workflow_tasks=64):
        yield client, queue


def ts(event_time) -> float:
    """A history event's protobuf timestamp as epoch seconds."""
    return event_time.seconds + event_time.nanos / 1e9


async def history_summary(handle) -> dict:
    """What the history of a one-activity workflow says about its activity: counts of
    scheduled / started / completed / failed / timed out events, the attempt and identity
    of the (last) start, and the scheduled->started delay."""
    from temporalio.api.enums.v1 import EventType

    history = await handle.fetch_history()
    s = {"scheduled": 0, "started": 0, "completed": 0, "failed": 0, "timed_out": 0,
         "attempt": None, "identity": None, "scheduled_at": None, "started_at": None, "wait_s": None,
         "inputs": []}
    for e in history.events:
        t = e.event_type
        if t == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            s["scheduled"] += 1
            s["scheduled_at"] = ts(e.event_time)
            s["inputs"] = [p.data for p in e.activity_task_scheduled_event_attributes.input.payloads]
        elif t == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            s["started"] += 1
            a = e.activity_task_started_event_attributes
            s["attempt"] = a.attempt
            s["identity"] = a.identity
            s["started_at"] = ts(e.event_time)
        elif t == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            s["completed"] += 1
        elif t == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            s["failed"] += 1
        elif t == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            s["timed_out"] += 1
    if s["scheduled_at"] is not None and s["started_at"] is not None:
        s["wait_s"] = s["started_at"] - s["scheduled_at"]
    return s


async def result_retrying(handle, deadline: float):
    """handle.result(), riding out a dev server that is down or restarting (the client
    gives up on an unreachable server after about 10 s)."""
    from temporalio.service import RPCError

    while True:
        try:
            return await handle.result()
        except RPCError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


class ReadyzWatcher:
    """Polls a worker's /readyz every `period` s in a thread: [(monotonic, status|None)]."""

    def __init__(self, worker: Worker, period: float = 0.2):
        self.worker = worker
        self.period = period
        self.seen = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.seen.append((time.monotonic(), self.worker.readyz()))
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
