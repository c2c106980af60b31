# cmake -DMPIEXEC=... -DNP=4 -DEXE=... -DMODE=ok|deadline|killed [-DARGS=...] -P run_mpi.cmake
# Runs an MPI job on loopback and checks how it ended: every rank passed the transport suite, or
# a deadline error naming the stalled rank and the round, or a SIGKILLed rank named by mpirun; in
# the failure modes the job must end within 30 s and leave no process behind.
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
string(TIMESTAMP start "%s")
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND ${MPIEXEC} --oversubscribe -np ${NP} ${EXE} ${args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
string(TIMESTAMP stop "%s")
math(EXPR seconds "${stop} - ${start}")
message("${out}")
message("exit status ${rc} after ${seconds} s")
if(MODE STREQUAL "ok")
  string(REGEX MATCHALL "transport suite passed" lines "${out}")
  list(LENGTH lines n)
  if(NOT rc EQUAL 0 OR NOT n EQUAL NP)
    message(FATAL_ERROR "expected ${NP} verified ranks and exit 0")
  endif()
  return()
endif()
if(rc EQUAL 0 OR seconds GREATER 30)
  message(FATAL_ERROR "the job should have failed within 30 s")
endif()
if(MODE STREQUAL "deadline" AND NOT out MATCHES "DEADLINE: MpiTwoRound: rank [0-9]+ waited [0-9]+ ms in round 1 \\(counts\\) for rank\\(s\\) 1 ")
  message(FATAL_ERROR "no deadline error naming rank 1 and round 1")
endif()
if(MODE STREQUAL "killed" AND NOT out MATCHES "rank 3 [^\n]*signal 9")
  message(FATAL_ERROR "mpirun did not name the killed rank 3")
endif()
# Anchored: the processes of the job start with the executable (this script's own command
# line only mentions it).
execute_process(COMMAND pgrep -f "^${EXE}" RESULT_VARIABLE found OUTPUT_VARIABLE pids)
if(found EQUAL 0)
  message(FATAL_ERROR "processes left behind: ${pids}")
endif()
