#!/usr/bin/env bash
# Configures (Ninja + ccache) and builds. Usage: scripts/build.sh [ninja targets...]
#   VLM_BUILD_DIR  build directory (default: build)
#   VLM_JOBS       parallel jobs (default: nproc)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${VLM_BUILD_DIR:-$ROOT/build}"
JOBS="${VLM_JOBS:-$(nproc)}"
export CCACHE_DIR="${CCACHE_DIR:-${HOME:-/root}/.cache/ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# Paths relative to the checkout and no working directory in the hash: clones and
# worktrees at other paths share one cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "$BUILD_DIR" -j "$JOBS" -- "$@"
