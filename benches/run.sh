#!/usr/bin/env bash
# gpulane's benchmarks against its peers (issue 5), by one command:
#
#   benches/run.sh [speed|batching|e2e|overhead|all|dataset]   (default: all; dataset is not in all)
#
# - speed:    `gpulane bench` vs sentence-transformers (benches/st_speed.py) on the CPU, same
#             corpus, same threads, batch 32, median of 5, on the short corpus (2,000
#             sentences of ~25 tokens) and the long one (200 passages truncated to 256);
#             in BENCH_SPEED_ROUNDS (3) rounds that alternate the two sides, each round's
#             ratio and their median; then gpulane's int8 once, against the peer's median.
# - batching: a Temporal dev server and `gpulane run` on `cpu-tools`; 64 concurrent
#             workflows each running one one-sentence `embed`; gpulane's default
#             --batch-wait-ms vs 0 (no cross-activity batching), in two separate runs.
# - e2e:      the same dev server and workflows against gpulane and against the Python
#             temporalio + sentence-transformers worker (benches/py_worker.py): 40
#             concurrent 32-text activities and 200 concurrent one-text activities.
# batching and e2e also run their loads against a no-op worker (benches/null_worker.py):
# the ceiling of the harness (dev server, driver, payloads) on this machine.
# - overhead: per-call overhead (issue 14): 200 concurrent workflows each running one
#             one-sentence `embed`, gpulane and the no-op worker both up on one dev server,
#             their rounds alternated (gpulane, no-op, gpulane, ...; BENCH_OVERHEAD_PAIRS
#             pairs, default 5) so that drift in the shared server and machine falls on
#             both alike; each pair's ratio and their median. GPULANE_CPU_DTYPE=int8 runs
#             gpulane's lane in int8.
# - dataset:  bulk embedding (benches/dataset_speed.py): one `embed_dataset` of a
#             BENCH_DATASET_ROWS-row (100,000) Parquet file on `cpu-tools` (file://, the dev
#             server and `gpulane run --data-root`), against sentence-transformers in a Python
#             loop reading the same file with pyarrow in chunks and writing Parquet parts; same
#             threads, parts of 1,000 rows. About 10 minutes a side on 2 cores with MiniLM,
#             so `all` leaves it out.
#
# It installs what it needs (scripts/setup.sh for .venv, the Temporal CLI, the model and
# the release build; .venv-bench from benches/requirements.txt, ~6 GB, see there why),
# writes the corpora and every JSON report under benches/out/, and prints a markdown summary
# with ratios (gpulane ÷ peer), also saved as benches/out/summary.md.
#
# Knobs (environment): BENCH_THREADS (compute threads for both sides, default 2),
# BENCH_REPEAT (timed runs per speed measurement, 5), BENCH_SPEED_ROUNDS (alternated speed
# rounds, 3), BENCH_ROUNDS (load rounds, 3), BENCH_PY_MAX_CONCURRENT (the Python worker's
# activities in flight, 4) and BENCH_PY_INFERENCES (its model.encode calls at once, 1),
# BENCH_FANOUT=1 (each round's activities from one workflow instead of one workflow each:
# see benches/load.py),
# BENCH_SKIP_BUILD=1 (use the gpulane binary as it is; do not run scripts/setup.sh),
# BENCH_MODEL=modernbert-mini (the model for all parts: a random-weight ModernBERT of
# MiniLM's width and depth, made by benches/make_modernbert.py, instead of
# all-MiniLM-L6-v2), BENCH_MODEL=qwen3-0.6b (a random-weight decoder embedder of
# Qwen3-Embedding-0.6B's shape, last-token pooling, made by benches/make_qwen3.py; the
# corpora are then sized with its tokenizer), BENCH_SPEED_DIVISOR=N (the speed part on the
# first 1/N of each corpus, e.g. 10: 200 short sentences and 20 long passages; a 0.6B model
# does ~40x MiniLM's work per token, so the full corpora take hours on 2 cores),
# BENCH_CPU_ISA=avx2 (both sides held to AVX2 on a wider CPU, what an AVX2-only CPU such as
# AMD Zen 2/3 runs: gpulane by GPULANE_CPU_ISA, PyTorch by ATEN_CPU_CAPABILITY, MKL by
# MKL_ENABLE_INSTRUCTIONS and oneDNN by ONEDNN_MAX_CPU_ISA; `gemm` under candle's matmul,
# which gpulane's f32 layers no longer call, keeps its own detection).
#
# All traffic stays on 127.0.0.1 (free ports); every command is under a time limit, and
# every process started here is stopped on exit, error or Ctrl-C.
# The whole script is one block, read before it runs: editing or checking out this file while
# a run is under way cannot change what that run does.
{
set -euo pipefail
cd "$(dirname "$0")/.."

PART=${1:-all}
case "$PART" in
  speed|batching|e2e|overhead|all|dataset) ;;
  *) echo "usage: benches/run.sh [speed|batching|e2e|overhead|all|dataset]" >&2; exit 2 ;;
esac
THREADS=${BENCH_THREADS:-2}
REPEAT=${BENCH_REPEAT:-5}
ROUNDS=${BENCH_ROUNDS:-3}
PY_MAX_CONCURRENT=${BENCH_PY_MAX_CONCURRENT:-4}
PY_INFERENCES=${BENCH_PY_INFERENCES:-1}
SPEED_DIVISOR=${BENCH_SPEED_DIVISOR:-1}
SPEED_ROUNDS=${BENCH_SPEED_ROUNDS:-3}
[[ "$SPEED_ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "BENCH_SPEED_ROUNDS is a whole number >= 1" >&2; exit 2; }
[[ "$SPEED_DIVISOR" =~ ^[1-9][0-9]*$ ]] || { echo "BENCH_SPEED_DIVISOR is a whole number >= 1" >&2; exit 2; }
case "${BENCH_CPU_ISA:-}" in
  "") ;;
  avx2) export GPULANE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  *) echo "BENCH_CPU_ISA is avx2 or unset" >&2; exit 2 ;;
esac
LOAD_FLAGS=()
[ "${BENCH_FANOUT:-0}" = 1 ] && LOAD_FLAGS=(--fanout)
OUT=benches/out
LOGS=$OUT/logs
PY=.venv-bench/bin/python
BIN=target/release/gpulane
TEMPORAL=.venv/bin/temporal
mkdir -p "$LOGS"

say() { echo "== $*" >&2; }

# --- processes we start, stopped on any exit --------------------------------------------
PIDS=()
stop() {  # stop PID: SIGTERM, up to 40 s to finish, then SIGKILL
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 400); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
cleanup() {  # newest first: the load before the worker, the worker before the server
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do stop "${PIDS[i]}"; done
  PIDS=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
forget() { local p keep=(); for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done; PIDS=("${keep[@]}"); }

# bounded SECONDS CMD...: CMD under a time limit, in the background and waited for, so that
# Ctrl-C or SIGTERM stops it at once (bash runs a trap only after a foreground command
# ends, and `timeout` puts its command out of reach of the terminal's Ctrl-C).
bounded() {
  local limit=$1 pid rc=0; shift
  timeout "$limit" "$@" &
  pid=$!; PIDS+=("$pid")
  wait "$pid" || rc=$?
  forget "$pid"
  return "$rc"
}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# --- setup ------------------------------------------------------------------------------
if [ "${BENCH_SKIP_BUILD:-0}" = 1 ]; then
  [ -x "$BIN" ] && [ -x "$TEMPORAL" ] || { echo "BENCH_SKIP_BUILD=1 but $BIN or $TEMPORAL is missing: run scripts/setup.sh" >&2; exit 1; }
else
  say "setup: scripts/setup.sh (.venv, Temporal CLI, model, cargo build --release)"
  bounded 3600 scripts/setup.sh >&2
fi
REQ_SHA=$(sha256sum benches/requirements.txt | cut -d' ' -f1)
if [ ! -x "$PY" ] || [ "$(cat .venv-bench/.requirements.sha256 2>/dev/null)" != "$REQ_SHA" ]; then
  say "setup: .venv-bench from benches/requirements.txt (torch from PyPI is large: minutes)"
  [ -x "$PY" ] || python3 -m venv .venv-bench
  bounded 1800 "$PY" -m pip install -q --disable-pip-version-check -r benches/requirements.txt >&2
  echo "$REQ_SHA" > .venv-bench/.requirements.sha256
fi
MODEL=$(scripts/model-dir.sh)
case "${BENCH_MODEL:-minilm}" in
  minilm) ;;
  modernbert-mini)
    if [ ! -f "$OUT/modernbert-mini/model.safetensors" ]; then
      say "setup: a random-weight ModernBERT of MiniLM's size (benches/make_modernbert.py)"
      bounded 600 "$PY" benches/make_modernbert.py --minilm "$MODEL" --out "$OUT/modernbert-mini" >&2
    fi
    MODEL=$OUT/modernbert-mini ;;
  qwen3-0.6b)
    if [ ! -f "$OUT/qwen3-0.6b/model.safetensors" ]; then
      say "setup: a random-weight decoder embedder of Qwen3-Embedding-0.6B's shape (benches/make_qwen3.py, ~1.8 GB)"
      # Into a temporary folder first: a run stopped halfway leaves no half-written model.
      bounded 900 "$PY" benches/make_qwen3.py --out "$OUT/qwen3-0.6b.tmp" >&2
      rm -rf "$OUT/qwen3-0.6b"; mv "$OUT/qwen3-0.6b.tmp" "$OUT/qwen3-0.6b"
    fi
    MODEL=$OUT/qwen3-0.6b ;;
  *) echo "BENCH_MODEL is minilm, modernbert-mini or qwen3-0.6b" >&2; exit 2 ;;
esac
say "corpora"
bounded 300 "$PY" benches/corpus.py --tokenizer "$MODEL/tokenizer.json" --out-dir "$OUT" >&2
"$PY" - "$OUT/env.json" "$BIN" <<'EOF'
import json, os, subprocess, sys, importlib.metadata as md
gl = subprocess.run([sys.argv[2], "--version"], capture_output=True, text=True).stdout.strip()
peer = ", ".join(f"{p} {md.version(p)}" for p in ("sentence-transformers", "torch", "temporalio"))
json.dump({"gpulane": gl, "peer": peer, "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg())},
          open(sys.argv[1], "w"))
EOF

# --- speed ------------------------------------------------------------------------------
# speed_gpulane TAG CORPUS_FILE [bench flags]: one `gpulane bench` run, its report in
# speed-gpulane-TAG.json.
speed_gpulane() {
  local tag=$1 file=$2; shift 2
  say "speed: gpulane bench $tag, $THREADS threads"
  bounded 1800 env RAYON_NUM_THREADS="$THREADS" "$BIN" bench --model "$MODEL" --corpus "$file" \
    --device cpu --batch-rows 32 --repeat "$REPEAT" --warmup 1 "$@" \
    --json "$OUT/speed-gpulane-$tag.json" > "$LOGS/speed-gpulane-$tag.log" 2>&1 \
    || { say "gpulane bench failed: see $LOGS/speed-gpulane-$tag.log"; tail -5 "$LOGS/speed-gpulane-$tag.log" >&2; }
}

# speed_st TAG CORPUS_FILE [st_speed.py flags]: the same for the peer, in speed-st-TAG.json.
speed_st() {
  local tag=$1 file=$2; shift 2
  say "speed: sentence-transformers $tag, $THREADS threads"
  bounded 1800 "$PY" benches/st_speed.py --model "$MODEL" --corpus "$file" \
    --threads "$THREADS" --batch-rows 32 --repeat "$REPEAT" --warmup 1 "$@" \
    --json "$OUT/speed-st-$tag.json" > "$LOGS/speed-st-$tag.log" 2>&1 \
    || { say "st_speed.py failed: see $LOGS/speed-st-$tag.log"; tail -5 "$LOGS/speed-st-$tag.log" >&2; }
}

run_speed() {
  rm -f "$OUT"/speed-*.json "$OUT"/speed-corpus-*.txt "$OUT"/speed-vectors-*.jsonl
  echo "{\"rounds\": $SPEED_ROUNDS}" > "$OUT/speed-info.json"
  local corpus file n r tag vectors
  for corpus in short long; do
    file=$OUT/corpus-$corpus.txt
    if [ "$SPEED_DIVISOR" != 1 ]; then  # the first 1/N of the corpus, for both sides
      n=$(( ($(grep -c . "$file") + SPEED_DIVISOR - 1) / SPEED_DIVISOR ))
      file=$OUT/speed-corpus-$corpus.txt
      head -n "$n" "$OUT/corpus-$corpus.txt" > "$file"
      say "speed: the first $n texts of the $corpus corpus (BENCH_SPEED_DIVISOR=$SPEED_DIVISOR)"
    fi
    # f32 against the peer in alternated rounds: the host's own speed drifts by 10% and more
    # over minutes, which one run of each side a few minutes apart reads as a ratio. Odd
    # rounds start with gpulane, even ones with the peer, so a steady drift falls on both.
    # Round 1's reports are speed-*-CORPUS.json, round r's speed-*-CORPUS-r.json.
    vectors=$OUT/speed-vectors-st-$corpus.jsonl
    for ((r = 1; r <= SPEED_ROUNDS; r++)); do
      tag=$corpus; [ "$r" = 1 ] || tag=$corpus-$r
      # The peer's vectors once (from the first round that writes them), for int8's cosines.
      local dump=()
      [ -s "$vectors" ] || dump=(--dump "$vectors")
      if ((r % 2)); then
        speed_gpulane "$tag" "$file"; speed_st "$tag" "$file" "${dump[@]}"
      else
        speed_st "$tag" "$file" "${dump[@]}"; speed_gpulane "$tag" "$file"
      fi
    done
    speed_gpulane "int8-$corpus" "$file" --dtype int8 --dump "$OUT/speed-vectors-int8-$corpus.jsonl"
  done
}

# --- a dev server and the workers -------------------------------------------------------
ADDRESS=""
SERVER_PID=""
start_server() {
  [ -n "$SERVER_PID" ] && return 0
  local port i
  port=$(free_port)
  "$TEMPORAL" server start-dev --ip 127.0.0.1 --port "$port" --headless \
    --http-port "$(free_port)" --metrics-port "$(free_port)" --log-level warn \
    > "$LOGS/temporal.log" 2>&1 &
  SERVER_PID=$!; PIDS+=("$SERVER_PID")
  for i in $(seq 600); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && { ADDRESS=127.0.0.1:$port; say "dev server on $ADDRESS"; return 0; }
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "the Temporal dev server did not start: see $LOGS/temporal.log" >&2; return 1
}

WORKER_PID=""
# start_gpulane LABEL ARGS...: `gpulane run` on cpu-tools only, until it logs "gpulane ready".
start_gpulane() {
  local label=$1 log="$LOGS/gpulane-$1.log" i; shift
  : > "$log"
  TEMPORAL_ADDRESS=$ADDRESS GPULANE_HOST=bench GPULANE_METRICS_ADDRESS=127.0.0.1:0 GPULANE_ADMIN_ADDRESS=127.0.0.1:0 RUST_LOG=info \
    RAYON_NUM_THREADS=$THREADS "$BIN" run --model "$MODEL" --gpus none --cpu-lane on "$@" > "$log" 2>&1 &
  WORKER_PID=$!; PIDS+=("$WORKER_PID")
  for i in $(seq 1200); do
    grep -q "gpulane ready" "$log" && { say "gpulane ($label) ready: $*"; return 0; }
    kill -0 "$WORKER_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "gpulane ($label) did not become ready: see $log" >&2; tail -5 "$log" >&2; stop_worker; return 1
}
# start_python LABEL READY_MARKER SCRIPT ARGS...: a Python worker, until it prints its marker.
start_python() {
  local label=$1 marker=$2 log="$LOGS/$1.log" i; shift 2
  : > "$log"
  "$PY" "$@" --address "$ADDRESS" > "$log" 2>&1 &
  WORKER_PID=$!; PIDS+=("$WORKER_PID")
  for i in $(seq 1200); do
    grep -q "$marker" "$log" && { say "$(grep -m1 "$marker" "$log")"; return 0; }
    kill -0 "$WORKER_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "$label did not become ready: see $log" >&2; tail -5 "$log" >&2; stop_worker; return 1
}
start_py_worker() {
  start_python py-worker "py_worker ready" benches/py_worker.py --model "$MODEL" --task-queue py-embed \
    --threads "$THREADS" --max-concurrent "$PY_MAX_CONCURRENT" --inferences "$PY_INFERENCES"
}
start_null_worker() { start_python null-worker "null_worker ready" benches/null_worker.py --task-queue null-embed; }
stop_worker() { stop "$WORKER_PID"; forget "$WORKER_PID"; WORKER_PID=""; }

# load QUEUE WORKFLOWS TEXTS CORPUS LABEL OUTFILE
load() {
  say "load: $2 workflows × $3 texts on $1 ($5)"
  local log="$LOGS/load-$(basename "$6" .json).log"
  bounded 1200 "$PY" benches/load.py --address "$ADDRESS" --task-queue "$1" --workflows "$2" \
    --texts "$3" --corpus "$OUT/corpus-$4.txt" --rounds "$ROUNDS" --label "$5" --json "$6" \
    ${LOAD_FLAGS[@]+"${LOAD_FLAGS[@]}"} >&2 2> "$log" \
    || { say "load failed or timed out: $2 × $3 on $1 ($5); see $log"; tail -5 "$log" >&2; }
}

# --- batching ---------------------------------------------------------------------------
run_batching() {
  rm -f "$OUT"/batching-*.json "$OUT/batching-skipped.txt"
  if ! "$BIN" run --help | grep -q -- "--batch-wait-ms"; then
    echo "not run: this gpulane has no --batch-wait-ms" | tee "$OUT/batching-skipped.txt" >&2
    return 0
  fi
  start_server || return 0
  if start_gpulane batching-default --max-concurrent-cpu 64; then
    load cpu-tools 64 1 short "default wait" "$OUT/batching-default.json"
    stop_worker
  fi
  if start_gpulane batching-wait0 --max-concurrent-cpu 64 --batch-wait-ms 0; then
    load cpu-tools 64 1 short "0 ms (off)" "$OUT/batching-wait0.json"
    stop_worker
  fi
  if start_null_worker; then
    load null-embed 64 1 short "no-op worker" "$OUT/batching-null.json"
    stop_worker
  fi
}

# --- end to end -------------------------------------------------------------------------
run_e2e() {
  rm -f "$OUT"/e2e-*.json
  start_server || return 0
  local gl_flags=(--max-concurrent-cpu 256)
  "$PY" - "$OUT/e2e-info.json" "${gl_flags[*]} (RAYON_NUM_THREADS=$THREADS)" \
    "py_worker.py --threads $THREADS --max-concurrent $PY_MAX_CONCURRENT --inferences $PY_INFERENCES" "$ROUNDS" <<'EOF'
import json, sys
json.dump({"gpulane": sys.argv[2], "py_worker": sys.argv[3], "rounds": int(sys.argv[4])}, open(sys.argv[1], "w"))
EOF
  if start_gpulane e2e "${gl_flags[@]}"; then
    load cpu-tools 40 32 short gpulane "$OUT/e2e-gpulane-40x32.json"
    load cpu-tools 200 1 short gpulane "$OUT/e2e-gpulane-200x1.json"
    stop_worker
  fi
  if start_py_worker; then
    load py-embed 40 32 short py_worker "$OUT/e2e-py-40x32.json"
    load py-embed 200 1 short py_worker "$OUT/e2e-py-200x1.json"
    stop_worker
  fi
  if start_null_worker; then
    load null-embed 40 32 short "no-op worker" "$OUT/e2e-null-40x32.json"
    load null-embed 200 1 short "no-op worker" "$OUT/e2e-null-200x1.json"
    stop_worker
  fi
}

# --- per-call overhead: gpulane and the no-op worker, rounds alternated -------------------
run_overhead() {
  rm -f "$OUT"/overhead-*.json
  local pairs=${BENCH_OVERHEAD_PAIRS:-5} r gl_pid null_pid side queue label
  # One round a load, one workflow per activity, whatever BENCH_ROUNDS / BENCH_FANOUT say.
  local ROUNDS=1 LOAD_FLAGS=()
  start_server || return 0
  start_gpulane overhead --max-concurrent-cpu 256 || return 0
  gl_pid=$WORKER_PID; WORKER_PID=""
  if ! start_null_worker; then stop "$gl_pid"; forget "$gl_pid"; return 0; fi
  null_pid=$WORKER_PID; WORKER_PID=""
  "$PY" - "$OUT/overhead-info.json" "$pairs" "${GPULANE_CPU_DTYPE:-f32}" <<'EOF'
import json, sys
json.dump({"pairs": int(sys.argv[2]), "cpu_dtype": sys.argv[3]}, open(sys.argv[1], "w"))
EOF
  for r in $(seq "$pairs"); do
    for side in gpulane null; do
      if [ "$side" = gpulane ]; then queue=cpu-tools; label=gpulane; else queue=null-embed; label="no-op worker"; fi
      say "overhead: pair $r/$pairs"
      load "$queue" 200 1 short "$label" "$OUT/overhead-$side-$r.json"
    done
  done
  stop "$gl_pid"; forget "$gl_pid"; stop "$null_pid"; forget "$null_pid"
}

# --- dataset ----------------------------------------------------------------------------
run_dataset() {
  rm -f "$OUT"/dataset-*.json "$OUT/dataset-skipped.txt" "$OUT/dataset-summary.md"
  if ! "$BIN" run --help | grep -q -- "--data-root"; then
    echo "not run: this gpulane has no --data-root (embed_dataset)" | tee "$OUT/dataset-skipped.txt" >&2
    return 0
  fi
  local rows=${BENCH_DATASET_ROWS:-100000} dir
  dir=$(cd "$OUT" && pwd)/dataset
  rm -rf "$dir"; mkdir -p "$dir"
  say "dataset: $rows rows of the short corpus as Parquet"
  bounded 300 "$PY" benches/dataset_speed.py make --corpus "$OUT/corpus-short.txt" --rows "$rows" \
    --out "$dir/corpus.parquet" >&2
  start_server || return 0
  if start_gpulane dataset --data-root "file://$dir/"; then
    say "dataset: gpulane embed_dataset, $THREADS threads"
    bounded 3600 "$PY" benches/dataset_speed.py gpulane --address "$ADDRESS" --queue cpu-tools \
      --source "file://$dir/corpus.parquet" --output "file://$dir/gpulane/" --part-rows 1000 \
      --json "$OUT/dataset-gpulane.json" > "$LOGS/dataset-gpulane.log" 2>&1 \
      || { say "dataset (gpulane) failed: see $LOGS/dataset-gpulane.log"; tail -5 "$LOGS/dataset-gpulane.log" >&2; }
    stop_worker
  fi
  say "dataset: sentence-transformers loop, $THREADS threads"
  bounded 3600 "$PY" benches/dataset_speed.py st --model "$MODEL" --source "$dir/corpus.parquet" \
    --output-dir "$dir/st" --part-rows 1000 --threads "$THREADS" --batch-rows 32 \
    --json "$OUT/dataset-st.json" > "$LOGS/dataset-st.log" 2>&1 \
    || { say "dataset (sentence-transformers) failed: see $LOGS/dataset-st.log"; tail -5 "$LOGS/dataset-st.log" >&2; }
  rm -rf "$dir/gpulane" "$dir/st"  # ~150 MB of vectors a side
}

case "$PART" in
  speed) run_speed ;;
  batching) run_batching ;;
  e2e) run_e2e ;;
  overhead) run_overhead ;;
  all) run_speed; run_batching; run_e2e; run_overhead ;;
  dataset) run_dataset ;;
esac
cleanup
if [ "$PART" = dataset ]; then
  "$PY" benches/dataset_speed.py summary "$OUT"
  exit
fi
"$PY" benches/summary.py "$OUT"
exit
}
