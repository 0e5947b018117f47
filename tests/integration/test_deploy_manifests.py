"""deploy/: every rendered Kubernetes manifest against its schema, the scaling rules the
manifests must keep, and the systemd unit through `systemd-analyze verify`."""

import pathlib
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import BIN, ROOT

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
# The oldest Kubernetes these manifests promise to work on (native sidecars and friends
# are not used, so older would validate too).
KUBERNETES_VERSION = "1.30"
# Custom resources, checked against the CRDs kept in the repo (see schemas/SOURCES.md).
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
}
# KEDA v2.20.2's Temporal scaler reads these trigger keys (pkg/scalers/temporal_scaler.go);
# the CRD types metadata as a free map, so a misspelt key would pass the schema and be
# ignored by KEDA.
TEMPORAL_TRIGGER_KEYS = {
    "endpoint", "namespace", "activationTargetQueueSize", "targetQueueSize", "taskQueue",
    "queueTypes", "buildId", "workerDeploymentName", "workerDeploymentBuildId",
    "selectAllActive", "selectUnversioned", "includeRunningWorkflowCount",
    "workflowTaskQueueForCount", "minConnectTimeout", "unsafeSsl", "tlsServerName",
    # KEDA 2.21+ (TLS on by default there); the README tells plaintext servers to set it.
    "enableTLS",
}
SHARED_QUEUES = {"gpu-tools", "cpu-tools"}


def render(overlay: str) -> list:
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUBE / "overlays" / overlay)],
        capture_output=True, text=True, check=True,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def strict(schema):
    """The CRD's schema, with unknown fields rejected where the CRD lists its fields: the
    API server would prune a misspelt field silently, so a typo must fail here."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schema(file: str) -> dict:
    docs = [d for d in yaml.safe_load_all((KUBE / "schemas" / file).read_text()) if d]
    (crd,) = docs
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
    return strict(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_passes_its_schema(overlay):
    docs = render(overlay)
    kinds = set()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        kinds.add(doc["kind"])
        name = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
        if key in CRDS:
            jsonschema.validate(doc, crd_schema(CRDS[key]))
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {e.message} at {list(e.path)}")
    assert {"Deployment", "ScaledObject", "PodMonitor", "ConfigMap"} <= kinds, kinds


def test_the_schema_check_catches_a_misspelt_field():
    (so,) = [d for d in render("gpu-per-pod") if d["kind"] == "ScaledObject"
             and d["metadata"]["name"] == "gpulane-gpu"]
    so["spec"]["minReplicasCount"] = so["spec"].pop("minReplicaCount")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(so, crd_schema(CRDS[("keda.sh/v1alpha1", "ScaledObject")]))
    (dep,) = [d for d in render("gpu-per-pod") if d["metadata"]["name"] == "gpulane-gpu"
              and d["kind"] == "Deployment"]
    dep["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_lane_scales_on_its_own_shared_queue(overlay):
    docs = render(overlay)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    targets = {}
    for so in scaled:
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "temporal"
        meta = trigger["metadata"]
        plain = {k.removesuffix("FromEnv") for k in meta}
        assert plain <= TEMPORAL_TRIGGER_KEYS, plain - TEMPORAL_TRIGGER_KEYS
        # Only a shared queue drives scaling: a private queue's backlog is pinned to a pod.
        assert meta["taskQueue"] in SHARED_QUEUES, meta["taskQueue"]
        assert meta["queueTypes"] == "activity"
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in deployments, target
        targets[meta["taskQueue"]] = deployments[target]
        # endpoint and namespace come from the target container's environment.
        env = container_env(deployments[target], docs)
        for key in ("endpoint", "namespace"):
            assert meta[f"{key}FromEnv"] in env, (key, meta)
    assert set(targets) == SHARED_QUEUES

    gpu = targets["gpu-tools"]["spec"]["template"]["spec"]
    (c,) = gpu["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    env = container_env(targets["gpu-tools"], docs)
    assert env["GPULANE_HOST"] == "$(POD_NAME)"
    pod_name = [e for e in c["env"] if e["name"] == "POD_NAME"][0]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Longer than the worker's whole stop deadline: the private queues' drain window
    # (GPULANE_DRAIN_PRIVATE_SECS, 5 s unless set), the activities' grace, and 15 s.
    drain_window = int(env.get("GPULANE_DRAIN_PRIVATE_SECS", "5"))
    deadline = drain_window + int(env["GPULANE_GRACEFUL_SHUTDOWN_SECS"]) + 15
    assert gpu["terminationGracePeriodSeconds"] > deadline
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "nvidia.com/gpu" not in str(targets["cpu-tools"]["spec"]["template"])


def test_the_two_gpu_overlays_differ_in_cards_per_pod():
    def cards(overlay):
        (dep,) = [d for d in render(overlay) if d["kind"] == "Deployment"
                  and d["metadata"]["name"] == "gpulane-gpu"]
        return int(dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
                   ["nvidia.com/gpu"])

    assert cards("gpu-per-pod") == 1
    assert cards("node-per-pod") > 1


def container_env(deployment: dict, docs: list) -> dict:
    """The container's environment as the kubelet builds it (ConfigMaps, then `env`), with
    values left unexpanded."""
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = {}
    for source in c.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", "<from " + str(e.get("valueFrom")) + ">")
    return env


def test_systemd_unit_verifies(tmp_path):
    unit = (ROOT / "deploy" / "systemd" / "gpulane.service").read_text()
    # verify checks that ExecStart's binary exists: point it at the one just built.
    assert "ExecStart=/usr/local/bin/gpulane run" in unit
    (tmp_path / "gpulane.service").write_text(
        unit.replace("ExecStart=/usr/local/bin/gpulane", f"ExecStart={BIN}")
    )
    out = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "gpulane.service")],
        capture_output=True, text=True,
    )
    # verify exits 0 on unknown keys and only warns: any word from it is a failure.
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out
    settings = {line.strip() for line in unit.splitlines() if not line.startswith("#")}
    for must in ("KillSignal=SIGTERM", "Restart=on-failure",
                 "EnvironmentFile=/etc/gpulane/gpulane.env", "TimeoutStopSec=60"):
        assert must in settings, must
    # PrivateDevices would hide /dev/nvidia* from NVML; W^X would break the PTX JIT.
    for never in ("PrivateDevices=yes", "MemoryDenyWriteExecute=yes"):
        assert never not in settings, never
