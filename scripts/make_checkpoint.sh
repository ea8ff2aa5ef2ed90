#!/usr/bin/env bash
# Creates a random-weight Qwen3-VL checkpoint with vlm-make-checkpoint, once.
#
#   scripts/make_checkpoint.sh PRESET [DIR] [more vlm-make-checkpoint flags...]
#
# PRESET is tiny or 2b; DIR defaults to ${VLM_CACHE_DIR:-~/.cache/vlm}/checkpoints/PRESET.
# Builds the tool if needed (VLM_BUILD_DIR, default build/), then skips the work
# when DIR already holds config.json, the weights and a make_checkpoint.stamp
# equal to the one the tool would write for these flags (tool version, preset,
# seed, dtype, shards, ...). Prints DIR on stdout; progress goes to stderr.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 tiny|2b [DIR] [vlm-make-checkpoint flags...]" >&2
  exit 2
fi
PRESET="$1"
shift
CACHE_DIR="${VLM_CACHE_DIR:-${HOME:-/root}/.cache/vlm}"
DIR="$CACHE_DIR/checkpoints/$PRESET"
if [[ $# -gt 0 && "$1" != -* ]]; then
  DIR="$1"
  shift
fi
EXTRA=("$@")

BUILD_DIR="${VLM_BUILD_DIR:-$ROOT/build}"
TOOL="$BUILD_DIR/scripts/vlm-make-checkpoint"
VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/build.sh" vlm-make-checkpoint >&2

expected="$("$TOOL" --print_stamp --preset "$PRESET" "${EXTRA[@]}")"
if [[ -f "$DIR/config.json" && -f "$DIR/make_checkpoint.stamp" &&
      ( -f "$DIR/model.safetensors" || -f "$DIR/model.safetensors.index.json" ) &&
      "$(cat "$DIR/make_checkpoint.stamp")" == "$expected" ]]; then
  echo "make_checkpoint: $DIR is up to date ($expected)" >&2
else
  "$TOOL" --preset "$PRESET" --out "$DIR" "${EXTRA[@]}" >&2
fi
echo "$DIR"
