#!/usr/bin/env bash
# Starts the whole system on one machine.
#   MODEL_DIR  a Qwen3-VL checkpoint directory (default: the generated `tiny` checkpoint)
# Status: builds and prepares the model; the services are wired in as they land
# (vision, language, gateway issues).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${VLM_BUILD_DIR:-$ROOT/build}"
CACHE_DIR="${VLM_CACHE_DIR:-${HOME:-/root}/.cache/vlm}"

"$ROOT/scripts/setup.sh"
"$ROOT/scripts/build.sh"
if [[ -z "${MODEL_DIR:-}" ]]; then
  MODEL_DIR="$("$ROOT/scripts/make_checkpoint.sh" tiny)"
fi
echo "serve: model $MODEL_DIR"
missing=()
for bin in vlm-vision vlm-language vlm-gateway; do
  [[ -x "$BUILD_DIR/services/${bin#vlm-}/$bin" ]] || missing+=("$bin")
done
if (( ${#missing[@]} )); then
  echo "serve: not built yet: ${missing[*]} (their issues are still open); model is ready at $MODEL_DIR" >&2
  exit 0
fi
