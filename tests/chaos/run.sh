#!/usr/bin/env bash
# The chaos suite: scripted faults (kill -9, SIGTERM, a Temporal server restart, bad
# payloads, idle-poll starvation, a same-host collision) against real `gpulane run`
# processes and a real `temporal server start-dev`, all on 127.0.0.1.
#
#   tests/chaos/run.sh            # every experiment (about 3 minutes here)
#   tests/chaos/run.sh --fast     # the quick ones only (pytest -m fast; about 90 s)
#   tests/chaos/run.sh --setup    # run scripts/setup.sh first (builds gpulane, fills .venv)
#   tests/chaos/run.sh -- -k kill9   # anything after -- goes to pytest
#
# Needs what scripts/setup.sh installs (target/release/gpulane, .venv with temporal and
# temporalio); runs setup.sh itself only when something is missing or --setup is given.
# Writes tests/chaos/out/results.json (and each experiment's logs and server database under
# tests/chaos/out/<experiment>/), prints a table of the results, and exits non-zero when
# an experiment failed.
set -uo pipefail
cd "$(dirname "$0")/../.."

fast=0
setup=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) fast=1 ;;
    --setup) setup=1 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$setup" = 1 ] || [ ! -x target/release/gpulane ] || [ ! -x .venv/bin/python ] || [ ! -x .venv/bin/temporal ]; then
  scripts/setup.sh || exit 1
fi

args=(tests/chaos -v -p no:cacheprovider -s)
bound=1200
if [ "$fast" = 1 ]; then
  args+=(-m fast)
  bound=360
fi

rm -f tests/chaos/out/results.json
start=$(date +%s)
# The experiments bound themselves; this is the last resort if something still hangs.
timeout --signal=TERM --kill-after=30 "$bound" .venv/bin/python -m pytest "${args[@]}" "${extra[@]}"
status=$?
took=$(( $(date +%s) - start ))
if [ "$status" = 124 ]; then
  echo "chaos: the suite exceeded its bound of ${bound} s and was stopped" >&2
fi

.venv/bin/python - "$took" <<'EOF'
import json, pathlib, sys, textwrap

path = pathlib.Path("tests/chaos/out/results.json")
if not path.exists():
    print("chaos: no results.json written")
    sys.exit(0)
doc = json.loads(path.read_text())
rows = doc["experiments"]
width = max([len("experiment")] + [len(r["name"]) for r in rows])
print()
print(f"chaos suite: {sum(r['passed'] for r in rows)}/{len(rows)} passed in {sys.argv[1]} s "
      f"(binary {doc['binary'].get('mtime', 'missing')})")
print(f"{'experiment':{width}}  result  seconds  saw")
print(f"{'-' * width}  ------  -------  ---")
for r in rows:
    result = "PASS" if r["passed"] else ("SKIP" if r.get("skipped") else "FAIL")
    saw = textwrap.shorten(r["saw"], 110, placeholder=" ...")
    print(f"{r['name']:{width}}  {result:6}  {r['seconds']:7.1f}  {saw}")
print(f"\nfull EXPECTED / SAW per experiment: {path}")
EOF
exit "$status"
