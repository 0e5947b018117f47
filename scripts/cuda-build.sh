#!/usr/bin/env bash
# Builds gpulane with `--features cuda` on a machine without a GPU or a CUDA install, the
# way CI does, so a change that breaks the GPU build cannot land.
#
# - The CUDA 13.0 toolkit comes from NVIDIA's PyPI wheels (nvcc, cicc, headers, cudart,
#   cuBLAS, cuRAND, NVRTC), installed once with `pip install --no-deps --target` into
#   ${GPULANE_CUDA_HOME:-~/.cache/gpulane/cuda-13.0} (about 675 MB to download). Stay on
#   13.0.x: candle's kernels ship as PTX the driver compiles at start, and a newer nvcc
#   emits PTX that older drivers (580 on our lent H200s) refuse.
# - No wheel has the driver library, libcuda.so, yet candle's cudarc links it dynamically.
#   A stub with the driver's soname (libcuda.so.1) that defines every `cu*` function of
#   cudarc's driver bindings satisfies the linker; at run time the real driver's
#   libcuda.so.1 is loaded instead. The stub returns CUDA_ERROR_NO_DEVICE from every call,
#   so the smoke test at the end runs here too.
# - Compute capability: GPULANE_CUDA_COMPUTE_CAP (default 90: H100/H200). Others: 80
#   (A100, A30), 86 (A10, A40, RTX 30xx), 89 (L4, L40S, RTX 40xx), 90 (H100, H200),
#   100 (B200), 120 (RTX 50xx); 75 (T4) is the oldest CUDA 13 supports. See README,
#   "Building for GPUs".
# - Output: target/cuda/release/gpulane (its own target directory, so it never disturbs
#   the CPU build in target/). About 10 minutes clean on 2 cores.
# - `--check` (what CI runs): instead of the release build and smoke test, clippy with
#   `-D warnings` over the whole workspace with the cuda feature on, in the CPU build's
#   target/ (crates that do not depend on candle share their checked state with the CPU
#   clippy run). It compiles the CUDA kernels (candle's, and gpulane's own to PTX, which
#   ptxas then assembles for the capability, refusing register spills) and type-checks and
#   lints every cuda-only line, without a second release build of the tree; linking
#   against the CUDA libraries is left to the full build (gpu-check.sh runs it on the card).
#
# Environment: GPULANE_CUDA_HOME (wheel cache), GPULANE_CUDA_COMPUTE_CAP,
# GPULANE_CUDA_TARGET_DIR (default target/cuda), CUDAFORGE_THREADS (kernel compile jobs),
# PYTHON (an interpreter with pip; default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=build
case "${1:-}" in
  --check) mode=check ;;
  "") ;;
  *) echo "usage: scripts/cuda-build.sh [--check]" >&2; exit 2 ;;
esac

cache="${GPULANE_CUDA_HOME:-$HOME/.cache/gpulane/cuda-13.0}"
cuda="$cache/nvidia/cu13"
wheels=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.0.19
  nvidia-curand==10.4.0.35
)
# The wheel list is the cache's identity: change it and the cache is rebuilt.
want_stamp="${wheels[*]}"

log() { printf 'cuda-build: %s\n' "$*" >&2; }

# 1. The toolkit, from wheels, once.
if [[ -f "$cache/.complete" && "$(cat "$cache/.complete")" == "$want_stamp" && -x "$cuda/bin/nvcc" ]]; then
  log "CUDA 13.0 wheels already in $cache"
else
  python="${PYTHON:-}"
  if [[ -z "$python" ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
  fi
  log "installing CUDA 13.0 wheels into $cache (about 675 MB to download)"
  tmp="$cache.partial.$$"
  rm -rf "$tmp"
  mkdir -p "$(dirname "$cache")"
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$tmp" "${wheels[@]}"
  [[ -x "$tmp/nvidia/cu13/bin/nvcc" ]] || { log "no nvcc in the wheels ($tmp/nvidia/cu13/bin)"; exit 1; }
  rm -rf "$cache"
  mv "$tmp" "$cache"
  echo "$want_stamp" > "$cache/.complete"
fi

# 2. Unversioned names for the linker (the wheels ship libcublas.so.13 and the like).
for lib in "$cuda"/lib/lib*.so.*; do
  base="${lib##*/}"
  name="${base%%.so.*}.so"
  [[ -e "$cuda/lib/$name" ]] || ln -s "$base" "$cuda/lib/$name"
done

# 3. The driver stub: every cu* function of the cudarc version in Cargo.lock.
cudarc_version=$(awk '/^name = "cudarc"$/ { getline; gsub(/[^0-9.]/, "", $0); print; exit }' Cargo.lock)
[[ -n "$cudarc_version" ]] || { log "cudarc is not in Cargo.lock; does the cuda feature still use candle?"; exit 1; }
cargo fetch --locked >/dev/null 2>&1 || cargo fetch >/dev/null
cargo_home="${CARGO_HOME:-$HOME/.cargo}"
bindings=$(ls -d "$cargo_home"/registry/src/*/"cudarc-$cudarc_version"/src/driver/sys/mod.rs 2>/dev/null | head -n1 || true)
if [[ -z "$bindings" ]]; then
  # `cargo fetch` downloads crates but may not unpack them: read the archive.
  crate=$(ls "$cargo_home"/registry/cache/*/"cudarc-$cudarc_version.crate" 2>/dev/null | head -n1 || true)
  [[ -n "$crate" ]] || { log "cudarc $cudarc_version is neither unpacked nor cached under $cargo_home/registry"; exit 1; }
  mkdir -p "$cache/cudarc-src"
  tar -xzf "$crate" -C "$cache/cudarc-src" "cudarc-$cudarc_version/src/driver/sys/mod.rs"
  bindings="$cache/cudarc-src/cudarc-$cudarc_version/src/driver/sys/mod.rs"
fi
stubs="$cuda/lib/stubs"
mkdir -p "$stubs"
{
  echo "/* Generated by scripts/cuda-build.sh from cudarc $cudarc_version's driver bindings."
  echo "   Link-time stand-in for the NVIDIA driver: every call reports CUDA_ERROR_NO_DEVICE. */"
  grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$bindings" | sed 's/^pub unsafe fn //' | sort -u |
    sed 's/.*/int &(void) { return 100; }/'
} > "$stubs/libcuda-stub.c"
count=$(grep -c 'return 100' "$stubs/libcuda-stub.c")
[[ "$count" -gt 100 ]] || { log "found only $count driver functions in $bindings; the bindings' layout changed"; exit 1; }
cc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so.1" "$stubs/libcuda-stub.c"
ln -sf libcuda.so.1 "$stubs/libcuda.so"
log "driver stub: $count functions from cudarc $cudarc_version in $stubs/libcuda.so.1"

# 4. The build.
export CUDA_HOME="$cuda" CUDA_PATH="$cuda" CUDA_ROOT="$cuda"
export PATH="$cuda/bin:$PATH"
export CUDARC_CUDA_VERSION=13000
export CUDA_COMPUTE_CAP="${GPULANE_CUDA_COMPUTE_CAP:-90}"
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
log "nvcc: $(nvcc --version | tail -n 2 | head -n 1)"
if [[ "$mode" == check ]]; then
  log "checking and linting the workspace with the cuda feature, for compute capability $CUDA_COMPUTE_CAP"
  start=$(date +%s)
  nice -n 19 cargo clippy --release --workspace --all-targets --features gpulane/cuda -- -D warnings
  # gpulane's own kernels ship as PTX that the driver compiles at first use: assemble it
  # here with ptxas for the same capability, so PTX the card would refuse fails CI, and
  # refuse register spills (a kernel that spills runs from local memory, far slower).
  ptx=$(ls -t target/release/build/gpulane-models-*/out/gpulane.ptx 2>/dev/null | head -n1)
  [[ -n "$ptx" ]] || { log "no gpulane.ptx under target/release/build: models/build.rs made none"; exit 1; }
  report=$(ptxas -arch="sm_$CUDA_COMPUTE_CAP" -v "$ptx" -o /dev/null 2>&1) || { printf '%s\n' "$report" >&2; log "ptxas refused $ptx"; exit 1; }
  if grep -E '[1-9][0-9]* bytes spill (stores|loads)' <<<"$report" >&2; then
    log "a kernel of models/cuda/kernels.cu spills registers (above)"; exit 1
  fi
  log "ptxas: $(grep -c 'Compiling entry' <<<"$report") kernels assemble for sm_$CUDA_COMPUTE_CAP without spills"
  log "check took $(( $(date +%s) - start )) s"
  exit 0
fi
export CARGO_TARGET_DIR="${GPULANE_CUDA_TARGET_DIR:-$root/target/cuda}"
log "building for compute capability $CUDA_COMPUTE_CAP into $CARGO_TARGET_DIR"
start=$(date +%s)
nice -n 19 cargo build --release -p gpulane --features cuda --bin gpulane
log "build took $(( $(date +%s) - start )) s"

# 5. Smoke test: the binary starts, finds no NVML or no card, and says so cleanly. The
# stub stands in for the driver here; on a GPU machine the real libcuda.so.1 is used.
bin="$CARGO_TARGET_DIR/release/gpulane"
export LD_LIBRARY_PATH="$cuda/lib:$stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$bin" --version
"$bin" devices
log "built $bin"
log "at run time it needs the driver's libcuda.so.1 and libcudart.so.13, libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13 on the loader path (scripts/gpu-check.sh finds them)"
