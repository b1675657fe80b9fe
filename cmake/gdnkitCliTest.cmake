# One check of the gdnkit command-line tool, run by CTest (CMakeLists.txt registers the cli_* tests):
#   cmake -DCLI=<gdnkit> -DARGS=<a|b|c> [-DEXPECT=zero|nonzero] [-DEXIT=<code>] [-DOUTPUT=<regex>]
#         [-DOUTPUT_ONCE=<regex>] [-DNOT_OUTPUT=<regex>] [-DEXACT_STDOUT=<text>] [-DFILES=<paths that must exist>]
#         [-DNO_FILES=<paths that must not exist>] [-DCLEAN=<paths removed before the run>] -P gdnkitCliTest.cmake
# Lists (ARGS, FILES, NO_FILES, CLEAN) are separated by '|' (a ';' would split add_test's argument).
# OUTPUT and NOT_OUTPUT are matched against stdout and stderr together; OUTPUT_ONCE must match exactly once.
# A failed check names what it expected and shows the tool's output.
cmake_minimum_required(VERSION 3.24)

foreach(var ARGS FILES NO_FILES CLEAN)
  string(REPLACE "|" ";" ${var} "${${var}}")
endforeach()

foreach(p IN LISTS CLEAN)
  file(REMOVE_RECURSE "${p}")
endforeach()

execute_process(COMMAND "${CLI}" ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
string(REPLACE ";" " " shown_args "${ARGS}")
set(failures "")

if(NOT rc MATCHES "^[0-9]+$")
  string(APPEND failures "  the tool did not exit normally: ${rc}\n")
elseif(DEFINED EXIT AND NOT rc EQUAL EXIT)
  string(APPEND failures "  exit status ${rc}, expected ${EXIT}\n")
elseif(EXPECT STREQUAL "zero" AND NOT rc EQUAL 0)
  string(APPEND failures "  exit status ${rc}, expected 0\n")
elseif(EXPECT STREQUAL "nonzero" AND rc EQUAL 0)
  string(APPEND failures "  exit status 0, expected non-zero\n")
endif()
if(DEFINED OUTPUT AND NOT all MATCHES "${OUTPUT}")
  string(APPEND failures "  the output does not match '${OUTPUT}'\n")
endif()
if(DEFINED OUTPUT_ONCE)
  string(REGEX MATCHALL "${OUTPUT_ONCE}" hits "${all}")
  list(LENGTH hits n)
  if(NOT n EQUAL 1)
    string(APPEND failures "  '${OUTPUT_ONCE}' occurs ${n} times in the output, expected once\n")
  endif()
endif()
if(DEFINED NOT_OUTPUT AND all MATCHES "${NOT_OUTPUT}")
  string(APPEND failures "  the output matches '${NOT_OUTPUT}', which it must not\n")
endif()
if(DEFINED EXACT_STDOUT AND NOT out STREQUAL "${EXACT_STDOUT}\n")
  string(APPEND failures "  stdout is not exactly '${EXACT_STDOUT}'\n")
endif()
foreach(p IN LISTS FILES)
  if(NOT EXISTS "${p}")
    string(APPEND failures "  ${p} was not written\n")
  endif()
endforeach()
foreach(p IN LISTS NO_FILES)
  if(EXISTS "${p}")
    string(APPEND failures "  ${p} exists, expected it not to be created\n")
  endif()
endforeach()

if(failures)
  message(FATAL_ERROR "gdnkit ${shown_args}:\n${failures}--- stdout:\n${out}--- stderr:\n${err}")
endif()
message(STATUS "gdnkit ${shown_args}: exit ${rc}, as expected")
