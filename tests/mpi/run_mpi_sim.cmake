# cmake -DMPIEXEC=... -DNP=n -DDTE=... -DMODE=golden|killed|stalled "-DARGS=..." -P run_mpi_sim.cmake
# `dte simulate --transport mpi` as separate processes of one MPI job on loopback.
#   golden:  exit 0 and a JSON summary with all_bit_identical and all_verified true
#   killed:  a receiver SIGKILLed in a payload round: the job ends within 30 s, mpirun names the
#            killed MPI rank (KILLED), no process left behind
#   stalled: a trainer stalls past the deadline: the receivers raise a deadline error naming it
#            and the round, and report that they still hold the previous version; the job ends
#            within 30 s, no process left behind
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
separate_arguments(args UNIX_COMMAND "${ARGS}")
string(TIMESTAMP start "%s")
execute_process(COMMAND ${MPIEXEC} --oversubscribe -np ${NP} ${DTE} simulate --transport mpi ${args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
string(TIMESTAMP stop "%s")
math(EXPR seconds "${stop} - ${start}")
message("${out}\n${err}\nexit status ${rc} after ${seconds} s")
if(MODE STREQUAL "golden")
  if(NOT rc EQUAL 0 OR NOT out MATCHES "\"all_bit_identical\":true" OR
     NOT out MATCHES "\"all_verified\":true")
    message(FATAL_ERROR "the receivers did not hold the trainer's policy after every publication")
  endif()
  return()
endif()
if(rc EQUAL 0 OR seconds GREATER 30)
  message(FATAL_ERROR "the job should have failed, within 30 s")
endif()
if(MODE STREQUAL "killed" AND NOT "${out}${err}" MATCHES "process rank ${KILLED} [^\n]*signal 9")
  message(FATAL_ERROR "mpirun did not name the killed rank ${KILLED}")
endif()
if(MODE STREQUAL "stalled")
  string(REPLACE ";" "," errors "${err}")  # a CMake list would split the messages at ';'
  string(REGEX MATCHALL "error on receiver rank [0-9]+: [^\n]*" lines "${errors}")
  list(LENGTH lines n)
  if(n EQUAL 0)
    message(FATAL_ERROR "no receiver reported the deadline")
  endif()
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "in round [12] \\([a-z]+\\) for rank\\(s\\) 1 " OR
       NOT line MATCHES "still holds version 2 \\(publishing version 3\\)")
      message(FATAL_ERROR "a receiver did not name the stalled rank and its phase, or committed: ${line}")
    endif()
  endforeach()
  # The other trainer ranks wait for it at the next checkpoint and name it too.
  string(REGEX MATCHALL "error on trainer rank [0-9]+: [^\n]*" trainer_lines "${errors}")
  list(LENGTH trainer_lines t)
  if(t EQUAL 0)
    message(FATAL_ERROR "no other trainer rank reported the deadline")
  endif()
  foreach(line IN LISTS trainer_lines)
    if(NOT line MATCHES "before [a-z ]+ for rank\\(s\\) 1[,) ]")
      message(FATAL_ERROR "a trainer rank did not name the stalled rank and the phase: ${line}")
    endif()
  endforeach()
endif()
# (this job's own processes: other tests run `dte simulate` without the MPI transport beside it)
execute_process(COMMAND pgrep -f "^${DTE} simulate --transport mpi" RESULT_VARIABLE found
                OUTPUT_VARIABLE pids)
if(found EQUAL 0)
  message(FATAL_ERROR "processes left behind: ${pids}")
endif()
