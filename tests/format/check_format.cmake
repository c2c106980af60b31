# cmake -DSOURCE_DIR=... -DCLANG_FORMAT=... -P check_format.cmake
# Fails when a C++/CUDA file of the project differs from what .clang-format says.
file(GLOB_RECURSE files
     "${SOURCE_DIR}/include/*.hpp" "${SOURCE_DIR}/include/*.cuh" "${SOURCE_DIR}/include/*.inc"
     "${SOURCE_DIR}/testing/*.hpp" "${SOURCE_DIR}/testing/*.cuh"
     "${SOURCE_DIR}/tests/*.cpp" "${SOURCE_DIR}/tests/*.cu" "${SOURCE_DIR}/tests/*.hpp"
     "${SOURCE_DIR}/tools/*.cpp" "${SOURCE_DIR}/tools/*.hpp"
     "${SOURCE_DIR}/examples/*.cpp" "${SOURCE_DIR}/examples/*.cu" "${SOURCE_DIR}/bench/*.cpp"
     "${SOURCE_DIR}/bench/gpu/*.cu" "${SOURCE_DIR}/python/src/*.cpp")
list(FILTER files EXCLUDE REGEX "/build[^/]*/")
execute_process(COMMAND "${CLANG_FORMAT}" --dry-run -Werror ${files}
                RESULT_VARIABLE rc ERROR_VARIABLE err)
list(LENGTH files n)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${err}\nclang-format: some of ${n} files are not formatted; run "
                      "clang-format -i on them")
endif()
message("clang-format: ${n} files formatted")
