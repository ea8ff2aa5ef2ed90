#!/usr/bin/env bash
# "No regression" between two commits, in one run: builds vlm-bench-language and
# vlm-bench-serving (and the services they start) of OLD and of NEW in temporary
# worktrees, then runs them interleaved -- old, new, old, new ... for --rounds
# rounds, each benchmark on the same checkpoint -- and prints one table of the
# medians over the rounds of every figure both benchmarks print, with new / old.
#
# Usage: scripts/bench/compare_commits.sh [options] OLD NEW [bench args...]
#   OLD, NEW                any commit names (e.g. main~30, HEAD, a branch)
#   bench args              passed to both benchmarks (e.g. --threads 2)
# Options:
#   --rounds N              interleaved rounds (default 3)
#   --model_dir DIR         checkpoint (default: the tiny one, written by NEW's
#                           vlm-make-checkpoint --preset tiny into the work dir)
#   --language_args "..."   extra vlm-bench-language arguments (space-separated)
#   --serving_args "..."    extra vlm-bench-serving arguments (space-separated)
#   --only language|serving run one of the two benchmarks
#   --work DIR              where worktrees, builds and outputs go (default: a new
#                           directory under ${TMPDIR:-/tmp}, removed at the end
#                           unless --keep; of a given DIR only what the script
#                           made is removed)
#   --keep                  keep the work directory (raw outputs: DIR/out/)
#   --quick                 one short configuration, to check the script works:
#                           language --runs 1 --starts 1 --paired_decode_rounds 1
#                           --configs "" --prefill_tokens 64 --decode_tokens 16;
#                           serving --rounds 1 --streams 1,2 --max_tokens 16 --turns 2
#                           --configs engine:
# Builds run under nice with the shared ccache (scripts/build.sh); the
# worktrees are removed at the end (git worktree remove), the build trees with them.
#
# Example (the official comparison, on a quiet machine, 2B-shaped checkpoint):
#   scripts/bench/compare_commits.sh --rounds 5 --model_dir ~/.cache/vlm/checkpoints/2b \
#       ac1c4c0 HEAD --threads 2
set -euo pipefail

ROUNDS=3
MODEL_DIR=""
LANGUAGE_ARGS=""
SERVING_ARGS=""
ONLY=""
WORK=""
KEEP=0
QUICK=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --model_dir) MODEL_DIR="$2"; shift 2 ;;
    --language_args) LANGUAGE_ARGS="$2"; shift 2 ;;
    --serving_args) SERVING_ARGS="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -lt 2 ]]; then
  echo "usage: $0 [options] OLD NEW [bench args...] (see --help)" >&2
  exit 2
fi
OLD_REF="$1"; NEW_REF="$2"; shift 2
BENCH_ARGS=("$@")
case "$ONLY" in ""|language|serving) ;; *) echo "--only takes language or serving" >&2; exit 2 ;; esac
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds takes a positive integer" >&2; exit 2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OLD_SHA="$(git -C "$REPO" rev-parse --verify "$OLD_REF^{commit}")"
NEW_SHA="$(git -C "$REPO" rev-parse --verify "$NEW_REF^{commit}")"
CREATED_WORK=0
if [[ -z "$WORK" ]]; then
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/vlm-compare.XXXXXX")"
  CREATED_WORK=1
fi
mkdir -p "$WORK/out"
WORK="$(cd "$WORK" && pwd)"

cleanup() {
  for side in old new; do
    if [[ -d "$WORK/$side" ]]; then
      git -C "$REPO" worktree remove --force "$WORK/$side" >/dev/null 2>&1 || true
    fi
  done
  git -C "$REPO" worktree prune >/dev/null 2>&1 || true
  if [[ "$KEEP" == 1 ]]; then
    echo "work directory kept: $WORK" >&2
  elif [[ "$CREATED_WORK" == 1 ]]; then
    rm -rf "$WORK"
  else  # a --work directory given: remove only what this script put there
    rm -rf "$WORK/out" "$WORK/tiny_checkpoint"
  fi
}
trap cleanup EXIT

echo "old: $OLD_REF = $(git -C "$REPO" log -1 --format='%h %s' "$OLD_SHA")" >&2
echo "new: $NEW_REF = $(git -C "$REPO" log -1 --format='%h %s' "$NEW_SHA")" >&2

TARGETS=()
[[ "$ONLY" != serving ]] && TARGETS+=(vlm-bench-language)
[[ "$ONLY" != language ]] && TARGETS+=(vlm-bench-serving)
for side in old new; do
  sha="$OLD_SHA"; [[ "$side" == new ]] && sha="$NEW_SHA"
  git -C "$REPO" worktree add --detach "$WORK/$side" "$sha" >/dev/null
  targets=("${TARGETS[@]}")
  [[ "$side" == new && -z "$MODEL_DIR" ]] && targets+=(vlm-make-checkpoint)
  echo "building $side (${targets[*]}) in $WORK/$side/build" >&2
  if ! VLM_BUILD_DIR="$WORK/$side/build" nice -n 10 "$WORK/$side/scripts/build.sh" "${targets[@]}" \
      >"$WORK/out/build_$side.log" 2>&1; then
    echo "the $side build failed; last lines of $WORK/out/build_$side.log:" >&2
    tail -20 "$WORK/out/build_$side.log" >&2
    KEEP=1
    exit 1
  fi
done

if [[ -z "$MODEL_DIR" ]]; then
  MODEL_DIR="$WORK/tiny_checkpoint"
  maker="$(find "$WORK/new/build" -name vlm-make-checkpoint -type f -perm -u+x | head -1)"
  "$maker" --preset tiny --out "$MODEL_DIR" >"$WORK/out/checkpoint.log" 2>&1
fi
echo "checkpoint: $MODEL_DIR" >&2

QUICK_LANGUAGE=()
QUICK_SERVING=()
if [[ "$QUICK" == 1 ]]; then
  QUICK_LANGUAGE=(--runs 1 --starts 1 --paired_decode_rounds 1 --configs= --prefill_tokens 64
                  --decode_tokens 16)
  QUICK_SERVING=(--rounds 1 --streams 1,2 --max_tokens 16 --turns 2 --configs engine:)
fi
read -r -a EXTRA_LANGUAGE <<<"$LANGUAGE_ARGS"
read -r -a EXTRA_SERVING <<<"$SERVING_ARGS"

run() {  # side bench round
  local side="$1" bench="$2" round="$3" bin args=()
  bin="$(find "$WORK/$side/build/scripts" -name "vlm-bench-$bench" -type f | head -1)"
  if [[ "$bench" == language ]]; then
    args=("${QUICK_LANGUAGE[@]}" "${EXTRA_LANGUAGE[@]}")
  else
    args=("${QUICK_SERVING[@]}" "${EXTRA_SERVING[@]}")
  fi
  local out="$WORK/out/${bench}_${side}_$round.txt"
  echo "round $round/$ROUNDS: $bench, $side" >&2
  if ! "$bin" --model_dir="$MODEL_DIR" "${args[@]}" "${BENCH_ARGS[@]}" >"$out" 2>"$out.stderr"; then
    echo "  $bench ($side) failed; see $out.stderr" >&2
    KEEP=1
  fi
}

for ((r = 1; r <= ROUNDS; r++)); do
  for bench in language serving; do
    [[ -n "$ONLY" && "$ONLY" != "$bench" ]] && continue
    # Alternate which side goes first, so a drift of the machine within a
    # round does not always favour the same side.
    if ((r % 2)); then run old "$bench" "$r"; run new "$bench" "$r"
    else run new "$bench" "$r"; run old "$bench" "$r"; fi
  done
done

echo
echo "old: $(git -C "$REPO" log -1 --format='%h %s' "$OLD_SHA")"
echo "new: $(git -C "$REPO" log -1 --format='%h %s' "$NEW_SHA")"
echo "checkpoint: $MODEL_DIR; $ROUNDS rounds, interleaved; medians over the rounds"
/usr/bin/python3 "$REPO/scripts/bench/compare_tables.py" "$WORK/out"
