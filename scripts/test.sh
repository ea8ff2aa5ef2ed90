#!/usr/bin/env bash
# From nothing to a full test run: install packages, build, run every test.
#
#   scripts/test.sh [--sanitize=SANITIZERS] [ctest args...]
#
# Without --sanitize: the normal build (VLM_BUILD_DIR, default build) and every
# test. With --sanitize=address,undefined: the whole tree built with ASan +
# UBSan into build-asan, then every test not labelled slow, deploy (deploy
# tests check packaging, not memory safety) or memory_bound (RSS bounds do not
# hold under ASan). With --sanitize=thread: TSan into
# build-tsan, only the tests labelled concurrency (and the binaries they need).
# Reports are errors (UBSan aborts, LSan leaks fail the test); third-party
# reports that are known and not ours are listed, each with its reason, in
# tests/sanitizers/*.supp. ctest args after the option are passed on (e.g. -R).
#   VLM_BUILD_DIR       build directory of the normal build (default: build)
#   VLM_SANITIZE_BUILD_DIR  build directory of a sanitizer build (default:
#                       build-asan or build-tsan)
#   VLM_TEST_JOBS       parallel tests (default: 2)
# Results, skipped tests with their reason included, are also written as JUnit
# XML to BUILD_DIR/Testing/ctest-junit.xml (.ci/run prints the skipped ones).
# A gtest binary is one ctest test and each of its cases another one
# (NAME/Suite.Case, see vlm_add_test in CMakeLists.txt).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
sanitize=""
if [[ "${1:-}" == --sanitize=* ]]; then
  sanitize="${1#--sanitize=}"
  shift
fi
"$ROOT/scripts/setup.sh"

if [[ -z "$sanitize" ]]; then
  BUILD_DIR="${VLM_BUILD_DIR:-$ROOT/build}"
  "$ROOT/scripts/build.sh"
  cd "$BUILD_DIR"
  exec ctest --output-on-failure -j "${VLM_TEST_JOBS:-2}" \
    --output-junit "$BUILD_DIR/Testing/ctest-junit.xml" "$@"
fi

case "$sanitize" in
  address,undefined|undefined,address|address) kind=asan ;;
  thread) kind=tsan ;;
  *) echo "test.sh: --sanitize=$sanitize: use address,undefined or thread" >&2; exit 2 ;;
esac
BUILD_DIR="${VLM_SANITIZE_BUILD_DIR:-$ROOT/build-$kind}"
SUPP="$ROOT/tests/sanitizers"
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DVLM_SANITIZE="$sanitize"
fi
# Every report fails the test that produced it; stacks are symbolized.
export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:suppressions=$SUPP/asan.supp${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$SUPP/ubsan.supp${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp${TSAN_OPTIONS:+:$TSAN_OPTIONS}"

if [[ "$kind" == asan ]]; then
  VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/build.sh"
  cd "$BUILD_DIR"
  exec ctest --output-on-failure -j "${VLM_TEST_JOBS:-2}" -LE '^(slow|deploy|memory_bound)$' \
    --output-junit "$BUILD_DIR/Testing/ctest-junit.xml" "$@"
fi

# TSan: build only the binaries of the tests labelled concurrency (a gtest
# binary's test name is its target name; its per-case tests NAME/Suite.Case
# match no target and drop out) and the checkpoint tool their fixtures use.
# Configure first so that tests added since the last build are listed.
cmake -S "$ROOT" -B "$BUILD_DIR" >/dev/null
mapfile -t targets < <(
  cd "$BUILD_DIR" && ninja -t targets all | sed -n 's/^\([A-Za-z0-9_.-]*\): .*/\1/p' | sort -u |
  comm -12 - <(ctest -N -L '^concurrency$' | sed -n 's/^ *Test *#[0-9]*: \(.*\)$/\1/p' |
               cat - <(echo vlm-make-checkpoint) | sort -u))
if [[ ${#targets[@]} -eq 0 ]]; then
  echo "test.sh: no test is labelled concurrency" >&2; exit 1
fi
VLM_BUILD_DIR="$BUILD_DIR" "$ROOT/scripts/build.sh" "${targets[@]}"
cd "$BUILD_DIR"
exec ctest --output-on-failure -j "${VLM_TEST_JOBS:-2}" -L '^concurrency$' \
  --output-junit "$BUILD_DIR/Testing/ctest-junit.xml" "$@"
