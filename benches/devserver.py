"""What the benchmark scripts that drive their own Temporal share: a dev server for one run
(free ports, a throwaway database, a connected client; stopped on exit), the model
directory, free ports and a process's RSS."""

import asyncio
import contextlib
import pathlib
import socket
import subprocess
import tempfile

from temporalio.client import Client

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """A process's resident memory now (VmRSS), in MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.asynccontextmanager
async def dev_server():
    """Yields (client, address, scratch directory)."""
    tmp = tempfile.mkdtemp()
    port = free_port()
    server = subprocess.Popen(
        [str(ROOT / ".venv/bin/temporal"), "server", "start-dev", "--ip", "127.0.0.1",
         "--port", str(port), "--headless", "--db-filename", f"{tmp}/t.db",
         "--http-port", str(free_port()), "--metrics-port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        for attempt in range(150):
            try:
                client = await Client.connect(address)
                break
            except Exception:
                if attempt == 149:
                    raise
                await asyncio.sleep(0.2)
        yield client, address, tmp
    finally:
        server.terminate()
        server.wait(30)


def model_dir() -> str:
    return subprocess.run([str(ROOT / "scripts/model-dir.sh")], capture_output=True,
                          text=True, check=True).stdout.strip()
