#!/usr/bin/env bash
# The main job on the embedded default: sets everything up, starts a local Temporal dev
# server and a gpulane worker serving all-MiniLM-L6-v2 (on the GPUs NVML finds, else on
# the CPU lane), sends one embed request through Temporal from a Python workflow, prints
# the result, and stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
work=$(mktemp -d)
free_port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
cleanup() {
  kill "${worker_pid:-}" "${server_pid:-}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
.venv/bin/temporal server start-dev --ip 127.0.0.1 --port "$port" --headless \
  --http-port "$(free_port)" --metrics-port "$(free_port)" --log-level warn >"$work/server.log" 2>&1 &
server_pid=$!
export TEMPORAL_ADDRESS="127.0.0.1:$port"
until .venv/bin/python -c "import socket,sys; sys.exit(socket.socket().connect_ex(('127.0.0.1',$port)))"; do sleep 0.3; done
target/release/gpulane run --model "all-MiniLM-L6-v2=$(scripts/model-dir.sh)" "$@" >"$work/gpulane.log" 2>&1 &
worker_pid=$!
until grep -qs "gpulane ready" "$work/gpulane.log"; do
  kill -0 "$worker_pid" 2>/dev/null || { cat "$work/gpulane.log"; exit 1; }
  sleep 0.3
done
grep "gpulane ready" "$work/gpulane.log"
.venv/bin/python examples/embed_once.py "GPUs admit work only when VRAM is free." "Temporal keeps the rest queued."
# What an operator sees: the lanes, their backlog in Temporal, the engines.
target/release/gpulane status
