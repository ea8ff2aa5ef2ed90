#!/bin/sh
# The ctest test of one gtest case: reports the verdict that run_gtest.py
# recorded when the case's binary ran (the ctest test RUNNER, a fixture of
# this test, so ctest runs it first).
#   case_result.sh RESULT_BASE CASE RUNNER
# Exit 0: passed; 77 (SKIP_RETURN_CODE): skipped, the reason printed; 1: failed,
# the failure printed, or no recorded result.
if [ -f "$1.pass" ]; then exit 0; fi
if [ -f "$1.skip" ]; then echo "skipped: $(cat "$1.skip")"; exit 77; fi
if [ -f "$1.fail" ]; then cat "$1.fail"; exit 1; fi
echo "$2: no recorded result: the binary crashed or did not run this case; see ctest test $3"
exit 1
