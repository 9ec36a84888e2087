# The installed package works with no source tree: install the build into WORK_DIR/prefix, build
# tests/install/consumer against it (find_package(moejit)), run the consumer, and run the installed
# CLI on the installed shapes. Any failing step fails the test.
#   cmake -DSOURCE_DIR=<repo> -DBUILD_DIR=<build> -DWORK_DIR=<scratch> -P run_install_test.cmake
foreach(var SOURCE_DIR BUILD_DIR WORK_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_install_test.cmake: -D${var}=... is required")
  endif()
endforeach()

set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/consumer-build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# Runs one step; stops the test with its output when it fails.
function(run_step name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "install test: ${name} failed (exit ${rc})\n  command: ${command}\n"
                        "--- stdout ---\n${out}\n--- stderr ---\n${err}")
  endif()
  message(STATUS "install test: ${name}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

# The consumer is configured with the generator and compiler the main build used (a machine may
# have Ninja but no make), and finds the toolkit where the main build found it.
file(STRINGS "${BUILD_DIR}/CMakeCache.txt" generator_line REGEX "^CMAKE_GENERATOR:INTERNAL=")
string(REGEX REPLACE "^CMAKE_GENERATOR:INTERNAL=" "" generator "${generator_line}")
file(STRINGS "${BUILD_DIR}/CMakeCache.txt" cxx_line REGEX "^CMAKE_CXX_COMPILER:[A-Z]+=")
string(REGEX REPLACE "^CMAKE_CXX_COMPILER:[A-Z]+=" "" cxx "${cxx_line}")
file(STRINGS "${BUILD_DIR}/CMakeCache.txt" nvcc_line REGEX "^CUDAToolkit_NVCC_EXECUTABLE:[A-Z]+=")
string(REGEX REPLACE "^CUDAToolkit_NVCC_EXECUTABLE:[A-Z]+=" "" nvcc "${nvcc_line}")
set(configure_args -S "${SOURCE_DIR}/tests/install/consumer" -B "${consumer_build}"
                   "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_BUILD_TYPE=Release)
if(generator)
  list(APPEND configure_args -G "${generator}")
endif()
if(cxx)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${cxx}")
endif()
if(nvcc AND EXISTS "${nvcc}")
  get_filename_component(nvcc_bin "${nvcc}" DIRECTORY)
  get_filename_component(toolkit_root "${nvcc_bin}" DIRECTORY)
  list(APPEND configure_args "-DCUDAToolkit_ROOT=${toolkit_root}")
endif()

run_step("install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}")
foreach(installed include/moejit/moejit.hpp include/moejit/moejit.h bin/moejit
                  share/moejit/shapes/reference.json share/moejit/shapes/schema.json)
  if(NOT EXISTS "${prefix}/${installed}")
    message(FATAL_ERROR "install test: ${installed} is not in the installed tree ${prefix}")
  endif()
endforeach()
run_step("configure consumer" "${CMAKE_COMMAND}" ${configure_args})
run_step("build consumer" "${CMAKE_COMMAND}" --build "${consumer_build}")

# Run from the scratch dir, with the cache there too: nothing may come from the source tree.
find_program(consumer NAMES moejit_consumer PATHS "${consumer_build}" NO_DEFAULT_PATH)
if(NOT consumer)
  message(FATAL_ERROR "install test: the consumer binary was not built in ${consumer_build}")
endif()
set(ENV{MOEJIT_CACHE_DIR} "${WORK_DIR}/cache")
unset(ENV{MOEJIT_CACHE_MODE})
run_step("run consumer" "${consumer}")
message(STATUS "${step_output}")
find_program(consumer_c NAMES moejit_consumer_c PATHS "${consumer_build}" NO_DEFAULT_PATH)
if(NOT consumer_c)
  message(FATAL_ERROR "install test: the C consumer was not built in ${consumer_build}")
endif()
run_step("run C consumer" "${consumer_c}")
message(STATUS "${step_output}")

# The installed CLI reads the installed shapes and generates from the embedded templates.
run_step("installed moejit --version" "${prefix}/bin/moejit" --version)
run_step("installed moejit source" "${prefix}/bin/moejit" source
         "${prefix}/share/moejit/shapes/reference.json" --shape qwen2-57b-a14b
         --kernel append_shared --arch sm_90a)
if(NOT step_output MATCHES "append_shared")
  message(FATAL_ERROR "install test: `moejit source` printed no append_shared kernel:\n${step_output}")
endif()

# The installed Python binding finds the installed library by its own location.
find_program(python NAMES python3)
if(python)
  unset(ENV{MOEJIT_LIBRARY})
  set(ENV{PYTHONPATH} "${prefix}/share/moejit/python")
  # (No ';' in the program: run_step passes its command as a list.)
  run_step("installed Python binding" "${python}" -c
           "m = __import__('moejit')\nprint(m.version(), m.weight_layout_version(), m._lib._name)")
  if(NOT step_output MATCHES "${prefix}/lib")
    message(FATAL_ERROR "install test: the installed moejit.py did not load the installed library:\n${step_output}")
  endif()
  message(STATUS "${step_output}")
endif()
