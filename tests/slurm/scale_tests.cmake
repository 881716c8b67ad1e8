# The scaling-study driver (jobs/scale.py) end to end under the local Slurm of the `slurm` fixture,
# on the small HDF5 file of the `h5py_data` fixture (tests/cli). Included from tests/slurm/CMakeLists.txt:
#   include(${CMAKE_CURRENT_SOURCE_DIR}/scale_tests.cmake)
# It expects the fixture's start script to write ${CMAKE_CURRENT_BINARY_DIR}/slurm.env.
if(NOT DEFINED TESSERA_PYTHON)
  set(TESSERA_PYTHON /usr/bin/python3)
endif()
add_test(NAME slurm.scale_strong
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/test_scale.sh $<TARGET_FILE:tessera>
                 ${CMAKE_BINARY_DIR}/tests/cli/data/h5py/good.h5 ${CMAKE_CURRENT_BINARY_DIR}/slurm.env
                 ${CMAKE_CURRENT_BINARY_DIR}/scale)
set_tests_properties(slurm.scale_strong PROPERTIES FIXTURES_REQUIRED "slurm;h5py_data" TIMEOUT 300
                     PROCESSORS 2 LABELS "slurm" ENVIRONMENT "TESSERA_PYTHON=${TESSERA_PYTHON}")
