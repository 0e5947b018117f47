"""The CPU container image (deploy/build-image.sh cpu, on a Debian base made here with
mmdebstrap) under podman: it serves a Python workflow's `embed` from inside the container,
drains and exits 0 on `podman stop`, runs the rendered GPU-lane Deployment's container as
Kubernetes would (its args, env, volumes, user and probes), and fails bad start-up input
with one clear line and a non-zero exit."""

import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest
import yaml

from conftest import ROOT, free_port, load_reference, minilm_dir, assert_vectors_close
from test_embed import run_workflow
from test_deploy_manifests import render

# crun fails on cgroups and setrlimit in this sandbox; runc with explicit limits works
# (the notes on containers for these machines; nofile at most the hard limit here, 20000).
# Elsewhere `podman run` needs neither.
PODMAN_RUN = ["podman", "--runtime", "runc", "run", "--ulimit", "nofile=20000:20000",
              "--ulimit", "nproc=4096:4096", "--network", "host"]


@pytest.fixture(scope="module")
def cpu_image():
    out = subprocess.run(
        [str(ROOT / "deploy" / "build-image.sh"), "cpu"],
        # The binary these tests test, not a new build (cargo's feature unification differs
        # between `cargo test --workspace` and `-p gpulane`, and would rebuild it).
        env={**os.environ, "BASE": "local", "GPULANE_BINARY": str(ROOT / "target" / "release" / "gpulane")},
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


class Container:
    def __init__(self, name):
        self.name = name

    def logs(self) -> str:
        out = subprocess.run(["podman", "logs", self.name], capture_output=True, text=True)
        return out.stdout + out.stderr

    def state(self) -> dict:
        out = subprocess.run(["podman", "inspect", "--format", "{{json .State}}", self.name],
                             capture_output=True, text=True, check=True)
        return yaml.safe_load(out.stdout)

    def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state()
            if s["Status"] == "exited":
                return s["ExitCode"]
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} still runs after {timeout} s:\n{self.logs()}")

    def exec(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", "exec", self.name, *args], capture_output=True,
                              text=True, timeout=60)


@pytest.fixture
def podman():
    """Starts detached containers; removes them after the test, whatever happened."""
    names = []

    def start(*args) -> Container:
        name = f"gpulane-test-{uuid.uuid4().hex[:8]}"
        subprocess.run([*PODMAN_RUN, "-d", "--name", name, *args], check=True,
                       capture_output=True, text=True)
        names.append(name)
        return Container(name)

    yield start
    for name in names:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True)


def http_get(port: int, path: str) -> tuple:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_status(port: int, path: str, want: int, timeout: float, c: Container) -> str:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = http_get(port, path)
            if last[0] == want:
                return last[1]
        except OSError as e:
            last = e
        if c.state()["Status"] == "exited":
            break
        time.sleep(0.3)
    raise AssertionError(f"{path} never answered {want} (last: {last}):\n{c.logs()}")


def test_version_user_and_labels(cpu_image):
    out = subprocess.run([*PODMAN_RUN, "--rm", cpu_image, "--version"], capture_output=True,
                         text=True, check=True)
    local = subprocess.run([str(ROOT / "target" / "release" / "gpulane"), "--version"],
                           capture_output=True, text=True, check=True)
    assert out.stdout == local.stdout and "commit " in out.stdout, (out.stdout, local.stdout)
    labels = yaml.safe_load(subprocess.run(
        ["podman", "image", "inspect", "--format", "{{json .Labels}}", cpu_image],
        capture_output=True, text=True, check=True).stdout)
    commit = out.stdout.split("commit ")[1].split(",")[0]
    assert labels["org.opencontainers.image.revision"] == commit
    assert labels["org.opencontainers.image.version"] in out.stdout
    user = subprocess.run([*PODMAN_RUN, "--rm", "--entrypoint", "id", cpu_image],
                          capture_output=True, text=True, check=True).stdout
    assert user.startswith("uid=10001(gpulane)"), user
    config = yaml.safe_load(subprocess.run(
        ["podman", "image", "inspect", "--format", "{{json .Config}}", cpu_image],
        capture_output=True, text=True, check=True).stdout)
    # The binary itself is PID 1 (no shell to swallow SIGTERM).
    assert config["Entrypoint"] == ["/usr/local/bin/gpulane"], config["Entrypoint"]


def test_cpu_image_serves_embed_and_drains_on_stop(cpu_image, temporal_address, podman):
    host = f"img-{uuid.uuid4().hex[:8]}"
    metrics = free_port()
    c = podman(
        "-v", f"{minilm_dir()}:/models/minilm:ro",
        "-e", "GPULANE_MODEL=all-MiniLM-L6-v2=/models/minilm",
        "-e", f"TEMPORAL_ADDRESS={temporal_address}",
        "-e", f"GPULANE_HOST={host}",
        "-e", f"GPULANE_METRICS_ADDRESS=127.0.0.1:{metrics}",
        "-e", f"GPULANE_ADMIN_ADDRESS=127.0.0.1:{free_port()}",
        cpu_image,
    )
    wait_status(metrics, "/readyz", 200, 120, c)
    ref = load_reference("minilm")
    out = run_workflow(temporal_address, "EmbedOn", "cpu-tools", {"texts": ref["texts"]})
    # Served from inside the container: its host names the private queue.
    assert out["host_task_queue"] == f"cpu-tools.{host}"
    assert out["model"] == "all-MiniLM-L6-v2"
    assert_vectors_close(out["embeddings"], ref["embeddings"], "minilm")

    started = time.monotonic()
    subprocess.run(["podman", "stop", "-t", "60", c.name], check=True, capture_output=True)
    assert c.wait_exit(60) == 0, c.logs()
    # Well inside the stop timeout: SIGTERM was handled, not answered by SIGKILL.
    assert time.monotonic() - started < 30, c.logs()
    assert "gpulane stopped" in c.logs(), c.logs()


def gpu_lane_container():
    """The GPU lane's container and its ConfigMap, as rendered for one card per pod."""
    docs = render("gpu-per-pod")
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gpulane-gpu"]
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    return dep["spec"]["template"]["spec"], maps


def kubelet_env(container: dict, maps: dict, pod_name: str) -> dict:
    """The environment the kubelet gives the container: ConfigMaps, then `env` in order,
    with `$(VAR)` expanded from what came before and the pod's name from the downward API."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for e in container.get("env", []):
        if "value" in e:
            value = e["value"]
            for k, v in env.items():
                value = value.replace(f"$({k})", v)
            env[e["name"]] = value
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", e
            env[e["name"]] = pod_name
    return env


def test_gpu_lane_deployment_runs_with_its_probes(cpu_image, temporal_address, podman):
    """The rendered GPU-lane container, run with its own args, env, user, volumes and probe
    paths. Two stand-ins, since this machine has no card and no cluster: the CPU image (the
    same binary without CUDA; set GPULANE_TEST_IMAGE to try another) with a simulated
    16 GiB card where the device plugin would grant nvidia.com/gpu, and the test's dev
    server where the Service name would resolve."""
    image = os.environ.get("GPULANE_TEST_IMAGE", cpu_image)
    pod, maps = gpu_lane_container()
    (c,) = pod["containers"]
    pod_name = f"gpulane-gpu-{uuid.uuid4().hex[:10]}-x7k2p"
    env = kubelet_env(c, maps, pod_name)
    env["TEMPORAL_ADDRESS"] = temporal_address
    env["GPULANE_SIMULATE_GPUS"] = "1x16GiB"
    env["GPULANE_SIMULATED_ID"] = pod_name
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}

    def port_of(probe):
        p = probe["httpGet"]["port"]
        return ports[p] if isinstance(p, str) else p

    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        port = port_of(c[probe])
        with __import__("socket").socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is taken on this host"

    # Volumes as the kubelet mounts them: the models PVC holds the model under the name
    # the ConfigMap gives; emptyDirs are writable scratch.
    volumes = {v["name"]: v for v in pod["volumes"]}
    model_path = env["GPULANE_MODEL"].split("=", 1)[1]
    args = []
    for m in c["volumeMounts"]:
        v = volumes[m["name"]]
        if "persistentVolumeClaim" in v:
            assert model_path.startswith(m["mountPath"] + "/")
            args += ["-v", f"{minilm_dir()}:{model_path}:ro"]
        else:
            assert "emptyDir" in v, v
            args += ["--tmpfs", f"{m['mountPath']}:mode=1777"]
    sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
    args += ["--user", f"{sc['runAsUser']}:{sc['runAsGroup']}"]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("capabilities", {}).get("drop") == ["ALL"]:
        args += ["--cap-drop", "ALL"]
    if not sc.get("allowPrivilegeEscalation", True):
        args += ["--security-opt", "no-new-privileges"]
    for k, v in env.items():
        args += ["-e", f"{k}={v}"]
    args += ["--stop-timeout", str(pod["terminationGracePeriodSeconds"])]
    container = podman(*args, image, *c["args"])

    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    wait_status(port_of(startup), startup["httpGet"]["path"], 200, min(budget, 120), container)
    live = c["livenessProbe"]
    assert http_get(port_of(live), live["httpGet"]["path"])[0] == 200
    ready = c["readinessProbe"]
    wait_status(port_of(ready), ready["httpGet"]["path"], 200, 60, container)

    # The pod's name is in the private queue and the poller identity.
    status = yaml.safe_load(container.exec("gpulane", "status", "--json").stdout)
    queues = [lane["task_queue"] for lane in status["lanes"]]
    assert "gpu-tools" in queues, queues
    assert any(q.startswith(f"gpu-tools.{pod_name}.") for q in queues), queues
    assert "cpu-tools" not in queues, queues

    # Draining: not ready (503), still live (200).
    drained = container.exec("gpulane", "drain", "--card", "all")
    assert drained.returncode == 0, drained
    wait_status(port_of(ready), ready["httpGet"]["path"], 503, 10, container)
    assert http_get(port_of(live), live["httpGet"]["path"])[0] == 200

    subprocess.run(["podman", "stop", container.name], check=True, capture_output=True)
    assert container.wait_exit(pod["terminationGracePeriodSeconds"]) == 0, container.logs()


@pytest.mark.parametrize(
    "case, env, expect",
    [
        ("no model mount", {"GPULANE_MODEL": "m=/models/all-MiniLM-L6-v2",
                            "TEMPORAL_ADDRESS": "127.0.0.1:1"},
         'model source "/models/all-MiniLM-L6-v2" is not a directory'),
        ("Temporal refuses", {"TEMPORAL_ADDRESS": "127.0.0.1:1"},
         "error: connecting to Temporal at 127.0.0.1:1"),
        ("Temporal's name does not resolve", {"TEMPORAL_ADDRESS": "temporal.invalid:7233"},
         "error: connecting to Temporal at temporal.invalid:7233"),
    ],
)
def test_bad_start_up_input_exits_non_zero_with_one_clear_line(cpu_image, podman, case, env,
                                                                 expect):
    args = ["-e", "GPULANE_METRICS_ADDRESS=127.0.0.1:0", "-e", "GPULANE_ADMIN_ADDRESS=off",
            "-e", "GPULANE_MODEL=all-MiniLM-L6-v2=/models/minilm"]
    if "GPULANE_MODEL" not in env:
        args += ["-v", f"{minilm_dir()}:/models/minilm:ro"]
    for k, v in env.items():
        args += ["-e", f"{k}={v}"]
    c = podman(*args, cpu_image)
    # A non-zero exit is what Kubernetes shows as CrashLoopBackOff; nothing ever
    # answered a probe, so the pod was never Ready.
    assert c.wait_exit(60) == 1, c.logs()
    # The worker's last word, and its only error (INFO lines before it may quote a library's
    # error text, such as NVML's absence).
    lines = c.logs().splitlines()
    errors = [line for line in lines if line.startswith("error:") or " ERROR " in line]
    assert errors == [lines[-1]] and expect in errors[0], (case, c.logs())
    # The cause, said once and with the fix.
    assert errors[0].count(expect.removeprefix("error: ")) == 1, errors[0]
    if "Temporal" in case:
        assert "TEMPORAL_ADDRESS" in errors[0], errors[0]
