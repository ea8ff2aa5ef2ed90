# Writes the full names (Suite.Case, Prefix/Suite.Case/0, ...) of a gtest
# binary's cases to OUT, one per line; run after every link of the binary
# (vlm_add_test), the list feeding its per-case ctest tests.
#   cmake -D BINARY=... -D OUT=... -P list_cases.cmake
# Sanitizer reports are off here (leaks at exit, TSan/UBSan at static
# initialization): listing is not a test; the ctest run reports them.
set(ENV{ASAN_OPTIONS} "$ENV{ASAN_OPTIONS}:detect_leaks=0")
set(ENV{TSAN_OPTIONS} "$ENV{TSAN_OPTIONS}:report_bugs=0")
set(ENV{UBSAN_OPTIONS} "$ENV{UBSAN_OPTIONS}:halt_on_error=0")
execute_process(COMMAND "${BINARY}" --gtest_list_tests
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BINARY} --gtest_list_tests failed (${rc}): ${err}")
endif()
string(REPLACE ";" "\\;" out "${out}")
string(REPLACE "\n" ";" lines "${out}")
set(cases "")
set(suite "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "#.*" "" line "${line}")  # "  # GetParam() = ..." comments
  if(line MATCHES "^([^ ].*)$")
    string(STRIP "${CMAKE_MATCH_1}" suite)
  elseif(line MATCHES "^ +([^ ].*)$")
    string(STRIP "${CMAKE_MATCH_1}" name)
    string(APPEND cases "${suite}${name}\n")
  endif()
endforeach()
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL cases)
  file(WRITE "${OUT}" "${cases}")
endif()
