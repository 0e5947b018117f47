#!/usr/bin/env bash
# Builds the GPU image on the Debian base made here (BASE=local, CUDA 13.0 runtime
# libraries from the PyPI wheels) and checks what a machine without a card can check:
#
# - `gpulane --version` names the cuda build and the commit;
# - every library the binary needs resolves inside the image (ldd: nothing "not found");
# - `gpulane devices` runs, says there is no NVML, and exits 0;
# - the stand-in libcuda.so.1 gives way to a driver library that the NVIDIA container
#   toolkit would mount into /usr/lib/x86_64-linux-gnu and register with ldconfig.
#
# Not in every CI run: the cuda build takes about 10 minutes clean on 2 cores (the first
# run also downloads about 675 MB of wheels). Prints the image's size last.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
image=$(BASE=local deploy/build-image.sh gpu | tail -n 1)
built=$(date +%s)
# Same sandbox limits as the tests (crun fails here; runc needs explicit rlimits).
run=(podman --runtime runc run --rm --ulimit nofile=20000:20000 --ulimit nproc=4096:4096)
fail() { echo "test-gpu-image: FAILED: $*" >&2; exit 1; }

version=$("${run[@]}" "$image" --version)
[[ $version == *"cuda)"* && $version == *"commit "* ]] || fail "--version: $version"
echo "test-gpu-image: $version"

libs=$("${run[@]}" --entrypoint /usr/bin/ldd "$image" /usr/local/bin/gpulane)
if grep -q "not found" <<<"$libs"; then fail "missing libraries: $(grep 'not found' <<<"$libs")"; fi
for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcurand.so.10; do
  grep -q "$lib => /" <<<"$libs" || fail "$lib does not resolve: $libs"
done
grep -q "libcuda.so.1 => /usr/local/lib/gpulane-no-driver/" <<<"$libs" \
  || fail "without a driver, libcuda.so.1 should be the stand-in: $libs"

devices=$("${run[@]}" "$image" devices 2>&1) || fail "devices exited non-zero: $devices"
grep -q "no NVML" <<<"$devices" || fail "devices did not report the missing NVML: $devices"
grep -q "gpus: none" <<<"$devices" || fail "devices: $devices"
echo "test-gpu-image: devices without a card: ok (no NVML, CPU lane only)"

# What the toolkit does at container start: mount the host's driver library into the
# multiarch directory, then run ldconfig. A copy of the stand-in plays the driver here;
# only its path matters.
driver=$("${run[@]}" --user 0 --entrypoint /bin/sh "$image" -c '
  cp /usr/local/lib/gpulane-no-driver/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 &&
  ldconfig && ldd /usr/local/bin/gpulane | grep libcuda.so.1')
# (/lib is /usr/lib on merged-usr Debian: either spelling is the mounted file.)
[[ $driver == *"=> /usr/lib/x86_64-linux-gnu/libcuda.so.1"* || $driver == *"=> /lib/x86_64-linux-gnu/libcuda.so.1"* ]] \
  || fail "a mounted driver must win over the stand-in: $driver"
echo "test-gpu-image: a mounted driver library takes precedence over the stand-in"

size=$(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec-i --suffix=B)
echo "test-gpu-image: ok in $((built - started)) s to build, $(( $(date +%s) - built )) s to check"
echo "$image $size"
