#!/usr/bin/env bash
# Runs every test: Rust unit and fixture tests, then integration tests against a real
# Temporal dev server (started by the pytest harness on free ports) with Python workflows,
# then the TypeScript client package's tests (node --test, their own dev server).
# Installs what it needs first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export GPULANE_MINILM_DIR="$(scripts/model-dir.sh)"
cargo test --release --workspace
.venv/bin/python -m pytest tests/integration -v -p no:cacheprovider
# The TypeScript client package: packed, installed from its tarball, and run against its
# own dev server and workers with the node test runner.
tests/clients/typescript/run.sh
