#!/usr/bin/env bash
# Builds a gpulane container image with podman: `deploy/build-image.sh cpu|gpu`.
#
# - cpu: the release binary (`cargo build --release`), on debian:bookworm-slim.
# - gpu: the `--features cuda` binary (scripts/cuda-build.sh: about 10 minutes clean on 2
#   cores), on NVIDIA's CUDA 13.0 runtime base.
#
# Environment:
# - BASE: the base image. `local` builds a Debian bookworm base here with mmdebstrap (once;
#   kept as localhost/gpulane-debian:bookworm) for machines that reach Debian's mirrors but
#   no container registry. On that base the gpu image also gets the CUDA 13.0 runtime
#   libraries, copied from the PyPI wheels scripts/cuda-build.sh installs.
# - IMAGE: the name to tag (default localhost/gpulane:VERSION-KIND).
# - GPULANE_BINARY: use this binary instead of building one (it must match the kind).
# - CARGO_PROFILE_RELEASE_DEBUG etc. pass through to cargo as usual; the image gets a copy
#   of the binary without debug info either way.
#
# Prints the image name last, alone on its line.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
kind="${1:-}"
case "$kind" in
  cpu | gpu) ;;
  *) echo "usage: deploy/build-image.sh cpu|gpu   (env: BASE=IMAGE|local, IMAGE=NAME)" >&2; exit 2 ;;
esac
log() { printf 'build-image: %s\n' "$*" >&2; }
command -v podman >/dev/null || { log "podman is not installed (Debian: apt-get install podman runc)"; exit 1; }

# 1. The binary. Its --version names the commit, which labels the image.
if [[ -n ${GPULANE_BINARY:-} ]]; then
  # A binary built already (the tests pass the one they test); no cargo run.
  binary=$GPULANE_BINARY
elif [[ $kind == cpu ]]; then
  # The same command as scripts/setup.sh.
  cargo build --release --quiet -p gpulane >&2
  binary=target/release/gpulane
else
  scripts/cuda-build.sh >&2
  binary="${GPULANE_CUDA_TARGET_DIR:-target/cuda}/release/gpulane"
fi
# `gpulane 0.1.0 (commit 0123456789ab, cpu)`; the cuda binary starts without a card too.
cuda_lib="${GPULANE_CUDA_HOME:-$HOME/.cache/gpulane/cuda-13.0}/nvidia/cu13/lib"
version_line=$(LD_LIBRARY_PATH="$cuda_lib:$cuda_lib/stubs" "$binary" --version)
version=$(sed -E 's/^gpulane ([^ ]+) .*/\1/' <<<"$version_line")
commit=$(sed -E 's/.*commit ([^,]+),.*/\1/' <<<"$version_line")
log "$version_line"

# 2. The base.
local_base=localhost/gpulane-debian:bookworm
base="${BASE:-}"
if [[ -z $base ]]; then
  if [[ $kind == cpu ]]; then base=docker.io/library/debian:bookworm-slim
  else base=docker.io/nvidia/cuda:13.0.1-runtime-ubuntu24.04; fi
elif [[ $base == local ]]; then
  base=$local_base
  if ! podman image exists "$base"; then
    command -v mmdebstrap >/dev/null || { log "BASE=local needs mmdebstrap (Debian: apt-get install mmdebstrap)"; exit 1; }
    tmp=$(mktemp -d)
    log "making $base with mmdebstrap (about 25 s here)"
    mmdebstrap --quiet --variant=apt --include=ca-certificates bookworm "$tmp/rootfs.tar"
    podman import --quiet "$tmp/rootfs.tar" "$base" >/dev/null
    rm -rf "$tmp"
  fi
fi

# 3. The context: only what the image holds.
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
# Debug info stays out of the image (hundreds of MB); symbols stay, for backtraces.
strip --strip-debug -o "$ctx/gpulane" "$binary"
if [[ $kind == gpu ]]; then
  mkdir -p "$ctx/cuda-libs" "$ctx/no-driver"
  cp "$cuda_lib/stubs/libcuda.so.1" "$ctx/no-driver/"
  if [[ $base == "$local_base" ]]; then
    # What the binary loads (ldd) and NVRTC loads in turn; NVIDIA's runtime base has them.
    for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 \
               libnvrtc.so.13 libnvrtc-builtins.so.13.0; do
      cp -L "$cuda_lib/$lib" "$ctx/cuda-libs/"
    done
  fi
fi

image="${IMAGE:-localhost/gpulane:$version-$kind}"
log "building $image on $base"
podman build --quiet --file "$root/deploy/images/Containerfile.$kind" \
  --build-arg BASE="$base" --build-arg VERSION="$version" --build-arg COMMIT="$commit" \
  --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  --tag "$image" "$ctx" >&2
log "size: $(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec-i --suffix=B)"
echo "$image"
