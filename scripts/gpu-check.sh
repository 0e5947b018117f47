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
# A short table goes to stdout; every number to files in the output folder.
#
# Usage:
#   scripts/gpu-check.sh --prepare        # here: build the carry folder .gpu-check/ (binary
#                                         # xz-compressed, MiniLM with f16-stored weights)
#   scripts/gpu-check.sh [OUT_DIR]        # there: run the check (default $OUT, else gpu-check-out)
#
# The device tool carries at most 64 MiB, so `--prepare` packs target/cuda/release/gpulane
# (built by scripts/cuda-build.sh) and the MiniLM model of scripts/setup.sh into
# .gpu-check/ (ignored through .git/info/exclude); carry `.gpu-check`. GPULANE_BIN and
# GPULANE_MINILM_DIR override where the binary and the model are taken from.
# GPU_CHECK_TEXTS (default 10000) sizes the throughput corpus; GPU_CHECK_CPU=1 measures the
# CPU too.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=.gpu-check
py="${PYTHON:-python3}"
say() { printf 'gpu-check: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

if [[ "${1:-}" == "--prepare" ]]; then
  bin="${GPULANE_BIN:-target/cuda/release/gpulane}"
  [[ -x "$bin" ]] || die "no $bin: run scripts/cuda-build.sh first"
  model="${GPULANE_MINILM_DIR:-$(scripts/model-dir.sh)}"
  grep -qxF "/$pack/" .git/info/exclude 2>/dev/null || echo "/$pack/" >> .git/info/exclude
  [[ -x .venv/bin/python ]] && py=.venv/bin/python
  "$py" scripts/gpu_check.py pack --model "$model" --bin "$bin" --dest "$pack"
  say "carry '$pack' and run: scripts/gpu-check.sh \"\$OUT\""
  exit 0
fi

out="${1:-${OUT:-$PWD/gpu-check-out}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
hog_pid=""
cleanup() { [[ -n "$hog_pid" ]] && kill "$hog_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# --- the machine: a card, and the libraries the binary loads ----------------------------
command -v nvidia-smi >/dev/null || die "no nvidia-smi: this is not a GPU machine (scripts/gpu-check.sh needs one; scripts/cuda-build.sh is the check that runs anywhere)"
nvidia-smi -L >"$out/nvidia-smi.txt" 2>&1 || die "nvidia-smi sees no GPU: $(cat "$out/nvidia-smi.txt")"
"$py" -c 'import torch, sentence_transformers; assert torch.cuda.is_available(), "torch sees no GPU"' \
  || die "$py needs PyTorch with CUDA and sentence-transformers"

if [[ -n "${GPULANE_BIN:-}" ]]; then bin="$GPULANE_BIN"
elif [[ -f "$pack/gpulane.xz" ]]; then
  bin="$work/gpulane"; "$py" scripts/gpu_check.py unpack-bin --src "$pack/gpulane.xz" --dest "$bin"
else bin=target/cuda/release/gpulane; fi
[[ -x "$bin" ]] || die "no gpulane binary ($bin): carry .gpu-check (scripts/gpu-check.sh --prepare) or set GPULANE_BIN"
model="${GPULANE_MINILM_DIR:-$pack/minilm}"
[[ -f "$model/config.json" ]] || die "no MiniLM model at $model: carry .gpu-check or set GPULANE_MINILM_DIR"

# The CUDA 13 libraries: where the loader already knows them, plus PyTorch's own and the
# nvidia-* wheels beside it (the machine's PyTorch is built for CUDA 13).
libdirs=()
for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
  p=$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l { print $NF; exit }')
  [[ -n "$p" ]] && libdirs+=("$(dirname "$p")")
done
while IFS= read -r d; do libdirs+=("$d"); done < <("$py" - <<'EOF'
import glob, os, torch
base = os.path.dirname(os.path.dirname(torch.__file__))
print(os.path.join(os.path.dirname(torch.__file__), "lib"))
for d in sorted(set(os.path.dirname(p) for p in glob.glob(os.path.join(base, "nvidia", "**", "lib*.so*"), recursive=True))):
    print(d)
EOF
)
[[ -d /usr/local/nvidia/lib64 ]] && libdirs+=(/usr/local/nvidia/lib64)
LD_LIBRARY_PATH="$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
if ldd "$bin" | grep -q "not found"; then
  ldd "$bin" | grep "not found" >&2
  die "the libraries above are missing (searched: $LD_LIBRARY_PATH)"
fi
ldd "$bin" >"$out/ldd.txt"
export RUST_LOG="${RUST_LOG:-info}" RUST_BACKTRACE=0

# --- a. inventory -----------------------------------------------------------------------
say "a. inventory"
"$bin" --version | tee "$out/version.txt"
"$bin" devices 2>"$out/devices.log" | tee "$out/devices.txt"
grep -q '^gpu 0:' "$out/devices.txt" || die "gpulane sees no GPU through NVML (see $out/devices.log)"

# --- a2. gpulane's own kernels against the CPU, every dtype -------------------------------
# Shapes and masks a MiniLM embedding never reaches (bf16, heads of 8 to 256 dims, grouped
# heads, windows, causal, the relative bias, the gated GELU). A failure is reported, not
# fatal: the rest of the check still says how far the card route is from the reference.
say "a2. gpulane's kernels vs the CPU (f32, f16, bf16)"
if "$bin" kernel-check --device cuda:0 --json "$out/kernel-check.json" >"$out/kernel-check.txt" 2>>"$out/kernel-check.log"; then
  say "every kernel check within bounds"
else
  say "kernel-check: some checks failed or could not run (see $out/kernel-check.txt and kernel-check.log)"
fi

# --- b. correctness ---------------------------------------------------------------------
"$py" scripts/gpu_check.py corpus --n 1000 --out "$work/check.txt"
"$py" scripts/gpu_check.py corpus --n "${GPU_CHECK_TEXTS:-10000}" --seed 7 --out "$work/speed.txt"
# Both attention routes: gpulane's varlen kernel (the default) and the padded candle-ops
# path it replaced (`--gpu-attention padded`), so one run on a card is the before and after.
for route in varlen padded; do
  for dt in f32 f16; do
    say "b. correctness in $dt, $route attention"
    "$bin" bench --model "minilm=$model" --corpus "$work/check.txt" --device cuda:0 --dtype "$dt" \
      --attention "$route" --batch-rows 32 --repeat 1 --warmup 1 --dump "$work/gpulane-$dt-$route.jsonl" \
      --json "$out/bench-check-$dt-$route.json" 2>>"$out/bench.log"
    "$py" scripts/gpu_check.py compare --model "$model" --corpus "$work/check.txt" \
      --dump "$work/gpulane-$dt-$route.jsonl" --dtype "$dt" --out "$out/correctness-$dt-$route.json"
  done
done

# --- c. throughput ----------------------------------------------------------------------
say "c. throughput"
devices=cuda:0
[[ "${GPU_CHECK_CPU:-0}" == 1 ]] && devices=cuda:0,cpu
"$bin" bench --model "minilm=$model" --corpus "$work/speed.txt" --device "$devices" --dtype f16 \
  --attention varlen,padded --batch-rows 8,32,128 --repeat 5 --warmup 1 \
  --json "$out/gpulane-speed.json" 2>>"$out/bench.log"
"$py" scripts/gpu_check.py st-speed --model "$model" --corpus "$work/speed.txt" \
  --batch-sizes 8,32,128 --dtype f16 --repeat 5 --out "$out/st-speed.json"

# --- d. admission -----------------------------------------------------------------------
say "d. admission against NVML"
admission() { "$bin" admission --model "minilm=$model" --gpus 0 2>>"$out/admission.log" | tee "$out/admission-$1.txt"; }
admission before
"$py" scripts/gpu_check.py hog --leave $((1 << 30)) --ready "$work/hog.json" &
hog_pid=$!
for _ in $(seq 1 120); do [[ -f "$work/hog.json" ]] && break; sleep 0.5; done
[[ -f "$work/hog.json" ]] || die "the memory-holding process did not get ready"
cp "$work/hog.json" "$out/hog.json"
admission during
kill "$hog_pid"; wait "$hog_pid" 2>/dev/null || true; hog_pid=""
sleep 2
admission after

# --- report -----------------------------------------------------------------------------
"$py" scripts/gpu_check.py report --dir "$out"
say "full numbers in $out"
