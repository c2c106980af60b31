# cmake -DBUILD_DIR=... -DWORK_DIR=... -DSOURCE_DIR=... -P run_consumer.cmake
# Installs the dte build into a fresh prefix, then configures, builds and runs a separate
# project that finds it with find_package(dte CONFIG REQUIRED).
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# dte/sim/ is the testing target dte_testing (testing/include): never installed.
file(GLOB_RECURSE installed_sim "${WORK_DIR}/prefix/*/dte/sim/*")
if(installed_sim)
  message(FATAL_ERROR "testing headers installed: ${installed_sim}")
endif()
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G Ninja
    "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" "-DDTE_EXPECT_STORAGE=${EXPECT_STORAGE}")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer")
run("${WORK_DIR}/build/consumer_io")
if(EXPECT_STORAGE)
  run("${WORK_DIR}/build/consumer_storage")
endif()
