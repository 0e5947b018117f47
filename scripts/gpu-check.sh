#!/usr/bin/env bash
# Proves the CUDA build on a real card, in one run on a lent GPU machine (CUDA, PyTorch and
# sentence-transformers there; no crates registry, no network, no Temporal). It reports:
#   a. the NVML inventory as gpulane sees it (`gpulane devices`), and gpulane's own CUDA
#      kernels against the CPU kernels in f32, f16 and bf16 (`gpulane kernel-check`);
#   b. `embed` correctness against sentence-transformers on the same card, in float32 and
#      float16 (cosine min / mean, max abs difference), via `gpulane bench --dump`, on both
#      attention routes (the varlen kernel, and the padded path it replaced);
#   c. throughput in tokens/s at batch sizes 8, 32, 128, gpulane f16 on both routes beside
#      sentence-transformers fp16 on the same card, and the ratio;
#   d. VRAM admission against real NVML readings: `gpulane admission` before, while a second
#      process (PyTorch) holds all but 1 GiB of the card, and after it lets go.
# Each step runs under a timeout inside one budget (GPU_CHECK_BUDGET_S, default 480 s, so
# one device call of at most 600 s holds it with the machine's start to spare); a failed or
# timed-out step is recorded and the check goes on. The summary table goes to stdout and
# OUT/summary.md, the steps' outcomes to OUT/steps.tsv, and every other file to
# OUT/gpu-check-files.tar.gz (the device tool brings back at most 8 files).
#
# Usage:
#   scripts/gpu-check.sh --prepare        # here: build the carry folder .gpu-check/ (binary
#                                         # xz-compressed, MiniLM with f16-stored weights)
#   scripts/gpu-check.sh [OUT_DIR]        # there: run the check (default $OUT, else gpu-check-out)
#   GPU_CHECK_DEVICE=cpu scripts/gpu-check.sh OUT_DIR
#                                         # here: a rehearsal of every step on the CPU build,
#                                         # with small corpora, sentence-transformers from
#                                         # .venv-bench and a simulated card for admission
#
# The device tool carries at most 64 MiB, so `--prepare` packs target/cuda/release/gpulane
# (built by scripts/cuda-build.sh) and the MiniLM model of scripts/setup.sh into
# .gpu-check/ (ignored through .git/info/exclude); carry `.gpu-check`. GPULANE_BIN and
# GPULANE_MINILM_DIR override where the binary and the model are taken from.
# GPU_CHECK_TEXTS (default 10000) sizes the throughput corpus; GPU_CHECK_CPU=1 measures the
# CPU too.
set -euo pipefail
caller_dir=$PWD   # a relative OUT_DIR is the caller's, not the repository's
cd "$(dirname "$0")/.."
pack=.gpu-check
py="${PYTHON:-python3}"
# The check's own messages go to fd 3, a copy of its stderr, so a step's redirections
# (which apply inside `step`) never swallow them.
exec 3>&2
say() { printf 'gpu-check: %s\n' "$*" >&3; }
die() { say "$*"; exit 1; }

if [[ "${1:-}" == "--prepare" ]]; then
  bin="${GPULANE_BIN:-target/cuda/release/gpulane}"
  [[ -x "$bin" ]] || die "no $bin: run scripts/cuda-build.sh first"
  model="${GPULANE_MINILM_DIR:-$(scripts/model-dir.sh)}"
  grep -qxF "/$pack/" .git/info/exclude 2>/dev/null || echo "/$pack/" >> .git/info/exclude
  # A binary older than the sources would spend the card's time on code that is gone.
  stamp=$(grep -aoE 'commit [0-9a-f]{12}, [a-z,]+\)' "$bin" | head -n1 || true)
  [[ -n "$stamp" ]] || die "$bin carries no commit stamp: rebuild with scripts/cuda-build.sh"
  [[ "$stamp" == *cuda* ]] || die "$bin is not a cuda build (${stamp%)}): run scripts/cuda-build.sh"
  built=$(awk '{ print $2 }' <<<"$stamp" | tr -d ,)
  sources=(':(glob)**/*.rs' ':(glob)**/*.cu' ':(glob)**/Cargo.toml' Cargo.lock ':(glob)**/build.rs' ':(glob)proto/**')
  git cat-file -e "$built^{commit}" 2>/dev/null || die "$bin was built at $built, a commit this checkout does not have: run scripts/cuda-build.sh"
  if ! git diff --quiet "$built" HEAD -- "${sources[@]}"; then
    die "$bin was built at $built and the Rust, CUDA or proto sources changed since: run scripts/cuda-build.sh again"
  fi
  git diff --quiet HEAD -- "${sources[@]}" || say "warning: uncommitted source changes; the binary may not hold them"
  # The pack tokenizes the corpora (the `tokenizers` package, in .venv-bench).
  [[ -z "${PYTHON:-}" && -x .venv-bench/bin/python ]] && py=.venv-bench/bin/python
  "$py" -c 'import tokenizers' 2>/dev/null || die "$py lacks the tokenizers package: python3 -m venv .venv-bench && .venv-bench/bin/pip install -r benches/requirements.txt, or set PYTHON"
  "$py" scripts/gpu_check.py pack --model "$model" --bin "$bin" --dest "$pack"
  say "packed the binary of commit $built"
  say "carry '$pack' and run: scripts/gpu-check.sh \"\$OUT\""
  exit 0
fi

rehearse=0
case "${GPU_CHECK_DEVICE:-cuda}" in
  cuda) ;;
  cpu) rehearse=1 ;;
  *) die "GPU_CHECK_DEVICE is cuda (the check) or cpu (a rehearsal of its plumbing)" ;;
esac
out="${1:-${OUT:-$caller_dir/gpu-check-out}}"
[[ "$out" == /* ]] || out="$caller_dir/$out"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
res="$work/res"   # every file of the check; archived into $out at the end
mkdir -p "$res" "$work/dumps"
# The device tool's call runs at most 600 s, and a session has 15 minutes of device time in
# all (the machine's start included): the steps share this budget, each capped at what is
# left, so a slow or hung step costs its own numbers and never the report.
budget="${GPU_CHECK_BUDGET_S:-480}"
hog_pid=""
step_pid=""
# The device tool brings back at most 8 files from $OUT: the summary, the step list and one
# archive of everything else. Written after every step, so a run cut short (the call's
# limit, a kill) still brings back what it measured.
snapshot() {
  (cd "$root" && "$py" scripts/gpu_check.py report --dir "$res" >/dev/null 2>>"$res/report.log") \
    || cp "$res/steps.tsv" "$res/summary.md" 2>/dev/null || true
  cp "$res/summary.md" "$res/steps.tsv" "$out/" 2>/dev/null || true
  tar -czf "$out/gpu-check-files.tar.gz.tmp" -C "$res" . 2>/dev/null \
    && mv "$out/gpu-check-files.tar.gz.tmp" "$out/gpu-check-files.tar.gz" || true
}
stop_hog() {
  [[ -n "$hog_pid" ]] || return 0
  kill "$hog_pid" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$hog_pid" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$hog_pid" 2>/dev/null || true
  wait "$hog_pid" 2>/dev/null || true
  hog_pid=""
}
finish() {
  local rc=$?
  trap - EXIT
  # A step still running (the check was signalled): its process group, then the hog.
  [[ -n "$step_pid" ]] && { kill -- -"$step_pid" 2>/dev/null || kill "$step_pid" 2>/dev/null || true; }
  stop_hog
  snapshot
  cat "$out/summary.md" 2>/dev/null || say "no summary could be written (see report.log in the archive)"
  rm -rf "$work"
  say "summary in $out/summary.md; every file in $out/gpu-check-files.tar.gz ($SECONDS s)"
  exit "$rc"
}
root=$PWD
trap finish EXIT
trap 'exit 143' TERM INT
printf 'step\tstatus\trc\tseconds\n' >"$res/steps.tsv"
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$res/steps.tsv"; }
# step NAME SECONDS COMMAND...: COMMAND under a timeout (capped by the budget left); its
# outcome goes to steps.tsv and a failure never stops the check. Redirections written
# after the call apply to COMMAND; `say` writes to the check's own stderr (fd 3).
step() {
  local name=$1 want=$2
  shift 2
  local left=$(( budget - SECONDS - 15 ))
  if (( left < 5 )); then say "$name: skipped, out of time"; record "$name" skipped - 0; return 0; fi
  local secs=$(( want < left ? want : left )) t0=$SECONDS rc=0 status=ok
  say "$name (at most ${secs} s)"
  # In the background and waited for, so a signal to the check reaches `finish`, which
  # stops it (timeout leads its own process group).
  timeout -k 5 "$secs" "$@" &
  step_pid=$!
  wait "$step_pid" || rc=$?
  step_pid=""
  if (( rc == 124 || (rc == 137 && SECONDS - t0 >= secs) )); then status="timed out"
  elif (( rc != 0 )); then status=failed; fi
  [[ "$status" == ok ]] || say "$name: $status (rc $rc)"
  record "$name" "$status" "$rc" $(( SECONDS - t0 ))
  snapshot
  return 0
}

# --- the machine: a card, and the libraries the binary loads ----------------------------
if (( rehearse )); then
  say "rehearsal on the CPU: the steps and the report, not a card's numbers"
  dev=cpu
  bin="${GPULANE_BIN:-target/release/gpulane}"
  [[ -x .venv-bench/bin/python && -z "${PYTHON:-}" ]] && py=.venv-bench/bin/python
else
  dev=cuda:0
  command -v nvidia-smi >/dev/null || die "no nvidia-smi: this is not a GPU machine (scripts/gpu-check.sh needs one; GPU_CHECK_DEVICE=cpu rehearses it anywhere, scripts/cuda-build.sh is the build check)"
  nvidia-smi -L >"$res/nvidia-smi.txt" 2>&1 || die "nvidia-smi sees no GPU: $(cat "$res/nvidia-smi.txt")"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv >>"$res/nvidia-smi.txt" 2>&1 || true
  if [[ -n "${GPULANE_BIN:-}" ]]; then bin="$GPULANE_BIN"
  elif [[ -f "$pack/gpulane.xz" ]]; then
    bin="$work/gpulane"; "$py" scripts/gpu_check.py unpack-bin --src "$pack/gpulane.xz" --dest "$bin"
  else bin=target/cuda/release/gpulane; fi
fi
# The packed model when there is one (a rehearsal then tries the card's own files too).
if [[ -n "${GPULANE_MINILM_DIR:-}" ]]; then model="$GPULANE_MINILM_DIR"
elif [[ -f "$pack/minilm/model.safetensors.xz" ]]; then
  model="$work/minilm"; "$py" scripts/gpu_check.py unpack-model --src "$pack/minilm" --dest "$model"
elif (( rehearse )); then model="$(scripts/model-dir.sh)"
else model="$pack/minilm"; fi
[[ -x "$bin" ]] || die "no gpulane binary ($bin): carry .gpu-check (scripts/gpu-check.sh --prepare) or set GPULANE_BIN"
[[ -f "$model/config.json" ]] || die "no MiniLM model at $model: carry .gpu-check or set GPULANE_MINILM_DIR"
step "python: torch and sentence-transformers" 60 "$py" -c "
import torch, sentence_transformers
assert '$dev' == 'cpu' or torch.cuda.is_available(), 'torch sees no GPU'
print('torch', torch.__version__, 'sentence-transformers', sentence_transformers.__version__)" \
  >"$res/python.txt" 2>&1

if (( ! rehearse )); then
  # The CUDA 13 libraries: where the loader already knows them, plus PyTorch's own and the
  # nvidia-* wheels beside it (the machine's PyTorch is built for CUDA 13).
  libdirs=()
  cache=$(ldconfig -p 2>/dev/null || true)
  for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
    p=$(awk -v l="$lib" '$1 == l { print $NF; exit }' <<<"$cache")
    [[ -n "$p" ]] && libdirs+=("$(dirname "$p")")
  done
  # Found without importing torch (seconds of the budget).
  while IFS= read -r d; do libdirs+=("$d"); done < <("$py" - <<'PY' || true
import glob, importlib.util, os
spec = importlib.util.find_spec("torch")
if spec and spec.submodule_search_locations:
    torch_dir = list(spec.submodule_search_locations)[0]
    base = os.path.dirname(torch_dir)
    print(os.path.join(torch_dir, "lib"))
    for d in sorted(set(os.path.dirname(p) for p in glob.glob(os.path.join(base, "nvidia", "**", "lib*.so*"), recursive=True))):
        print(d)
PY
)
  [[ -d /usr/local/nvidia/lib64 ]] && libdirs+=(/usr/local/nvidia/lib64)
  gl_path="$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  LD_LIBRARY_PATH="$gl_path" ldd "$bin" >"$res/ldd.txt" 2>&1 || true
  if grep -q "not found" "$res/ldd.txt"; then
    grep "not found" "$res/ldd.txt" >&2
    die "the libraries above are missing (searched: $gl_path)"
  fi
  # The search path for gpulane alone (the Python steps keep their own), and one JIT cache
  # for its processes: the driver compiles candle's PTX once, not in each of them.
  mkdir -p "$work/nv-cache"
  cat >"$work/gpulane-env" <<SH
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$gl_path" CUDA_CACHE_PATH="$work/nv-cache" CUDA_CACHE_MAXSIZE=4294967296
exec "$bin" "\$@"
SH
  chmod +x "$work/gpulane-env"
  bin="$work/gpulane-env"
fi
export RUST_LOG="${RUST_LOG:-info}" RUST_BACKTRACE=0

# --- a. inventory -----------------------------------------------------------------------
"$bin" --version >"$res/version.txt" 2>&1 || die "$bin does not start: $(cat "$res/version.txt")"
say "$(cat "$res/version.txt")"
step "a. inventory (gpulane devices)" 60 "$bin" devices >"$res/devices.txt" 2>"$res/devices.log"
if (( ! rehearse )) && ! grep -q '^gpu 0:' "$res/devices.txt"; then
  say "gpulane sees no GPU through NVML (see devices.log); the CUDA steps still run on ordinal 0"
fi

# --- a2. gpulane's own kernels against the CPU, every dtype -------------------------------
# Shapes and masks a MiniLM embedding never reaches (bf16, heads of 8 to 256 dims, grouped
# heads, windows, causal, the relative bias, the gated GELU). It exits non-zero when a
# check is out of bounds; summary.md lists which.
step "a2. kernels vs the CPU (kernel-check)" 120 \
  "$bin" kernel-check --device "$dev" --json "$res/kernel-check.json" >"$res/kernel-check.txt" 2>"$res/kernel-check.log"

# --- b. correctness ---------------------------------------------------------------------
check_n=1000 speed_n="${GPU_CHECK_TEXTS:-10000}" repeat=5
(( rehearse )) && { check_n=60; speed_n="${GPU_CHECK_TEXTS:-200}"; repeat=1; }
"$py" scripts/gpu_check.py corpus --n "$check_n" --out "$res/check.txt"
"$py" scripts/gpu_check.py corpus --n "$speed_n" --seed 7 --out "$work/speed.txt"
# Both attention routes: gpulane's varlen kernel (the default) and the padded candle-ops
# path it replaced (`--attention padded`), so one run on a card is the before and after.
for route in varlen padded; do
  for dt in f16 f32; do
    step "b. embed $dt, $route attention" 90 "$bin" bench --model "minilm=$model" \
      --corpus "$res/check.txt" --device "$dev" --dtype "$dt" --attention "$route" \
      --batch-rows 32 --repeat 1 --warmup 1 --dump "$work/dumps/gpulane-$dt-$route.jsonl" \
      --json "$res/bench-check-$dt-$route.json" 2>>"$res/bench.log"
  done
done
# One Python process for every comparison: PyTorch's import and the model's load once.
step "b. compare with sentence-transformers" 180 "$py" scripts/gpu_check.py compare \
  --model "$model" --corpus "$res/check.txt" --dumps "$work/dumps" --out-dir "$res" \
  --device "$dev" >"$res/compare.log" 2>&1

# --- d. admission -----------------------------------------------------------------------
# Before throughput: it is short, and it is what proves the VRAM budget against NVML.
admission() {
  if (( rehearse )); then
    step "d. admission, $1" 30 "$bin" admission --model "minilm=$model" --simulate-gpus 1x16GiB \
      --simulated-memory "$work/memory.json" >"$res/admission-$1.txt" 2>>"$res/admission.log"
  else
    step "d. admission, $1" 30 "$bin" admission --model "minilm=$model" --gpus 0 \
      >"$res/admission-$1.txt" 2>>"$res/admission.log"
  fi
}
echo '{}' >"$work/memory.json"
admission before
if (( rehearse )); then
  # A simulated neighbour: the card's other tenants leave 1 GiB free.
  echo '{"0": 1073741824}' >"$work/memory.json"
  echo '{"held_bytes": 16106127360, "simulated": true}' >"$res/hog.json"
  admission during
  echo '{}' >"$work/memory.json"
  admission after
elif (( budget - SECONDS < 60 )); then
  say "d. admission with a neighbour: skipped, out of time"; record "d. hog" skipped - 0
else
  "$py" scripts/gpu_check.py hog --leave $((1 << 30)) --ready "$work/hog.json" 2>"$res/hog.log" &
  hog_pid=$!
  t0=$SECONDS
  for _ in $(seq 1 120); do
    [[ -f "$work/hog.json" ]] && break
    kill -0 "$hog_pid" 2>/dev/null || break   # it died: hog.log says why
    sleep 0.5
  done
  if [[ -f "$work/hog.json" ]]; then
    cp "$work/hog.json" "$res/hog.json"
    admission during
  else
    say "the memory-holding process did not get ready (see hog.log)"; record "d. hog" failed - $(( SECONDS - t0 ))
  fi
  stop_hog
  # The driver frees a dead process's memory shortly after it exits: wait until NVML shows it.
  for _ in $(seq 1 20); do
    used=$(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | awk -F', *' '{ print ($1 * 4 < $2) ? "low" : "high" }' || true)
    [[ "$used" == low ]] && break
    sleep 0.5
  done
  admission after
fi

# --- c. throughput ----------------------------------------------------------------------
devices=$dev
[[ "${GPU_CHECK_CPU:-0}" == 1 && "$dev" != cpu ]] && devices=$dev,cpu
# One step a route, so a fault on one route leaves the other's numbers; the varlen route (the
# default) and the reference first, the padded route (the before) last; one step a batch
# size too, largest first (the goals are at 128 and 32), since bench writes its JSON at
# its end.
for rows in 128 32 8; do
  step "c. throughput, gpulane f16 varlen, batch $rows" 60 "$bin" bench --model "minilm=$model" \
    --corpus "$work/speed.txt" --device "$devices" --dtype f16 --attention varlen --batch-rows "$rows" \
    --repeat "$repeat" --warmup 1 --json "$res/gpulane-speed-varlen-$rows.json" 2>>"$res/bench.log"
done
step "c. throughput, sentence-transformers fp16" 200 "$py" scripts/gpu_check.py st-speed \
  --model "$model" --corpus "$work/speed.txt" --batch-sizes 128,32,8 --dtype f16 \
  --repeat "$repeat" --device "$dev" --out "$res/st-speed.json" >"$res/st-speed.log" 2>&1
for rows in 128 32 8; do
  step "c. throughput, gpulane f16 padded, batch $rows" 60 "$bin" bench --model "minilm=$model" \
    --corpus "$work/speed.txt" --device "$dev" --dtype f16 --attention padded --batch-rows "$rows" \
    --repeat "$repeat" --warmup 1 --json "$res/gpulane-speed-padded-$rows.json" 2>>"$res/bench.log"
done
