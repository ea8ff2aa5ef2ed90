#!/usr/bin/env bash
# Builds and runs one libFuzzer target (tests/fuzz) under ASan + UBSan.
#
#   scripts/fuzz.sh TARGET [SECONDS] [-- LIBFUZZER_ARGS...]
#   scripts/fuzz.sh --list
#   scripts/fuzz.sh --ci      build every target, run each for a few seconds
#                             on its seeds and regressions (ctest -L fuzz)
#
# TARGET is image, safetensors, model_config, tensor_codec, tokenizer,
# chat_template, gateway_validation or grammar (a trailing _fuzzer is accepted).
# SECONDS defaults to 60. The build is clang with -DVLM_FUZZ=ON
# -DVLM_SANITIZE=address,undefined in its own directory, and only the target
# and what it links are built. The run keeps its corpus in
# BUILD/tests/fuzz/corpus/TARGET (grows over runs) and reads the seeds and
# regression inputs of the repo; a crash is written to BUILD/tests/fuzz/artifacts/
# and the script exits non-zero. To keep a finding: fix it, copy the input to
# tests/fuzz/regressions/TARGET/, and add a unit test for it.
#
#   VLM_FUZZ_BUILD_DIR  build directory (default: build-fuzz)
#   VLM_FUZZ_NICE       nice level of the run (default: 10)
#   VLM_JOBS            parallel build jobs (default: nproc)
#   VLM_TOKENIZER_DIR   the Qwen3 tokenizer (default: $VLM_CACHE_DIR/tokenizer or
#                       ~/.cache/vlm/tokenizer, where scripts/setup.sh puts it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${VLM_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}"
TARGETS=(image safetensors model_config tensor_codec tokenizer chat_template gateway_validation grammar)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
configure() {
  if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
    cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
      -DVLM_FUZZ=ON -DVLM_SANITIZE=address,undefined
  fi
}

[[ $# -ge 1 ]] || usage
if [[ "$1" == --list ]]; then printf '%s\n' "${TARGETS[@]}"; exit 0; fi
if [[ "$1" == --ci ]]; then
  configure
  VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/build.sh" "${TARGETS[@]/%/_fuzzer}"
  cd "$BUILD_DIR"
  exec ctest --output-on-failure -j "${VLM_TEST_JOBS:-2}" -L '^fuzz$'
fi
name="${1%_fuzzer}"; shift
if [[ ! " ${TARGETS[*]} " == *" $name "* ]]; then
  echo "fuzz.sh: unknown target '$name' (one of: ${TARGETS[*]})" >&2; exit 2
fi
seconds=60
if [[ $# -ge 1 && "$1" != -- ]]; then seconds="$1"; shift; fi
[[ "${1:-}" == -- ]] && shift

configure
VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/build.sh" "${name}_fuzzer"

if [[ -z "${VLM_TOKENIZER_DIR:-}" ]]; then
  export VLM_TOKENIZER_DIR="${VLM_CACHE_DIR:-${HOME:-/root}/.cache/vlm}/tokenizer"
fi
fuzz_dir="$BUILD_DIR/tests/fuzz"
work="$fuzz_dir/corpus/$name"
mkdir -p "$work" "$fuzz_dir/artifacts"
dirs=("$work" "$ROOT/tests/fuzz/corpus/$name")
[[ -d "$ROOT/tests/fuzz/regressions/$name" ]] && dirs+=("$ROOT/tests/fuzz/regressions/$name")
case "$name" in
  model_config|safetensors|tokenizer) dict=(-dict="$ROOT/tests/fuzz/dicts/$name.dict") ;;
  chat_template|gateway_validation) dict=(-dict="$ROOT/tests/fuzz/dicts/tokenizer.dict") ;;
  *) dict=() ;;
esac
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
exec nice -n "${VLM_FUZZ_NICE:-10}" "$fuzz_dir/${name}_fuzzer" \
  -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$fuzz_dir/artifacts/$name-" "${dict[@]}" "$@" "${dirs[@]}"
