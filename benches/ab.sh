#!/usr/bin/env bash
# Two gpulane binaries against each other on one corpus, for a change to the model code:
#
#   benches/ab.sh BIN_A BIN_B [-- extra `gpulane bench` flags, e.g. --dtype int8]
#
# Each round runs `gpulane bench` once with each binary and prints both rates and B ÷ A;
# the last line is the median of the rounds' ratios. Odd rounds run A first and even ones
# B first, so that neither binary always runs second: a softmax change read 0.99-1.16x
# with B always second and 0.99-1.02x with it first (benches/RESULTS.md), and a fixed
# order cannot tell such an effect from the change.
# Keep other work off the machine while it runs.
#
# Knobs (environment): AB_CORPUS (long; a file benches/out/corpus-$AB_CORPUS.txt, which
# `benches/run.sh speed` or benches/corpus.py writes), AB_ROUNDS (4), AB_THREADS (2),
# AB_REPEAT (3 timed passes a run, after 1 warm-up), AB_BATCH (32 rows a pass), AB_MODEL
# (a model folder; all-MiniLM-L6-v2 by default, e.g. benches/out/modernbert-mini, which
# `BENCH_MODEL=modernbert-mini benches/run.sh speed` writes).
# A typical use: copy target/release/gpulane to /tmp/gl-before, make the change, build,
# then `benches/ab.sh /tmp/gl-before target/release/gpulane`.
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -ge 2 ] || { echo "usage: benches/ab.sh BIN_A BIN_B [-- gpulane bench flags]" >&2; exit 2; }
A=$1 B=$2
shift 2
[ "${1:-}" = -- ] && shift
for bin in "$A" "$B"; do
  [ -x "$bin" ] || { echo "$bin is not an executable" >&2; exit 2; }
done
CORPUS=benches/out/corpus-${AB_CORPUS:-long}.txt
ROUNDS=${AB_ROUNDS:-4}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "AB_ROUNDS is a whole number >= 1" >&2; exit 2; }
[ -f "$CORPUS" ] || { echo "$CORPUS is missing: run benches/run.sh speed once (it writes the corpora)" >&2; exit 1; }
MODEL=${AB_MODEL:-$(scripts/model-dir.sh)}
[ -d "$MODEL" ] || { echo "AB_MODEL $MODEL is not a folder" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# rate BIN: tokens/s of one `gpulane bench` run.
rate() {
  RAYON_NUM_THREADS=${AB_THREADS:-2} "$1" bench --model "$MODEL" --corpus "$CORPUS" --device cpu \
    --batch-rows "${AB_BATCH:-32}" --repeat "${AB_REPEAT:-3}" --warmup 1 "${EXTRA[@]}" \
    --json "$TMP/run.json" > "$TMP/run.log" 2>&1 \
    || { echo "gpulane bench failed with $1:" >&2; tail -5 "$TMP/run.log" >&2; exit 1; }
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["results"][0]["tokens_per_s"])' "$TMP/run.json"
}

EXTRA=("$@")
echo "A: $A"
echo "B: $B"
echo "model $MODEL, corpus $CORPUS, ${AB_THREADS:-2} threads, batch ${AB_BATCH:-32}, flags: ${EXTRA[*]:-none}"
ratios=()
for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then a=$(rate "$A"); b=$(rate "$B"); first=A; else b=$(rate "$B"); a=$(rate "$A"); first=B; fi
  ratio=$(python3 -c 'import sys; print(f"{float(sys.argv[2]) / float(sys.argv[1]):.3f}")' "$a" "$b")
  ratios+=("$ratio")
  printf 'round %d (%s first): A %.0f, B %.0f tokens/s, B / A %s\n' "$r" "$first" "$a" "$b" "$ratio"
done
python3 -c 'import statistics, sys; print(f"median B / A over {len(sys.argv) - 1} rounds: {statistics.median(map(float, sys.argv[1:])):.3f}")' "${ratios[@]}"
