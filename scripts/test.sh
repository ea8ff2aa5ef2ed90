#!/usr/bin/env bash
# From nothing to a full test run: install packages, build, run every test.
#   VLM_BUILD_DIR  build directory (default: build)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${VLM_BUILD_DIR:-$ROOT/build}"
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh"
cd "$BUILD_DIR"
ctest --output-on-failure -j "${VLM_TEST_JOBS:-2}" "$@"
