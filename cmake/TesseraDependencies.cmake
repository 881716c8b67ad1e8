# Finds every required dependency and stops with a message that says which Debian package provides it.
macro(tessera_require found what package)
  if(NOT ${found})
    message(FATAL_ERROR "Tessera needs ${what}. On Debian 12: apt-get install ${package}")
  endif()
endmacro()

find_package(MPI COMPONENTS CXX QUIET)
tessera_require(MPI_CXX_FOUND "MPI (Open MPI)" "libopenmpi-dev openmpi-bin")

set(HDF5_PREFER_PARALLEL ON)
find_package(HDF5 COMPONENTS C QUIET)
tessera_require(HDF5_FOUND "parallel HDF5" "libhdf5-openmpi-dev")
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "Tessera needs a *parallel* HDF5 (found a serial one at ${HDF5_INCLUDE_DIRS}). "
                      "On Debian 12: apt-get install libhdf5-openmpi-dev")
endif()
add_library(tessera_hdf5 INTERFACE)
target_include_directories(tessera_hdf5 SYSTEM INTERFACE ${HDF5_INCLUDE_DIRS})
target_link_libraries(tessera_hdf5 INTERFACE ${HDF5_LIBRARIES} MPI::MPI_CXX)
target_compile_definitions(tessera_hdf5 INTERFACE ${HDF5_DEFINITIONS})

find_package(Kokkos QUIET)
tessera_require(Kokkos_FOUND "Kokkos" "libtrilinos-kokkos-dev")
# Debian's Kokkos::kokkos points at a non-existent include folder; use the real one.
get_filename_component(TESSERA_KOKKOS_INCLUDE "${Kokkos_INCLUDE_DIRS}" REALPATH)
set_target_properties(Kokkos::kokkos PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "")
add_library(tessera_kokkos INTERFACE)
target_include_directories(tessera_kokkos SYSTEM INTERFACE "${TESSERA_KOKKOS_INCLUDE}")
target_link_libraries(tessera_kokkos INTERFACE Kokkos::kokkos)

find_package(OpenCL QUIET)
tessera_require(OpenCL_FOUND "the OpenCL loader (needed by oneDNN's CMake config)" "ocl-icd-opencl-dev")
find_package(dnnl QUIET)
tessera_require(dnnl_FOUND "oneDNN" "libdnnl-dev ocl-icd-opencl-dev")

find_package(OpenMP QUIET COMPONENTS CXX)
tessera_require(OpenMP_CXX_FOUND "OpenMP (oneDNN's threading runtime)" "g++")

find_package(yaml-cpp QUIET)
tessera_require(yaml-cpp_FOUND "yaml-cpp" "libyaml-cpp-dev")
find_package(CLI11 QUIET)
tessera_require(CLI11_FOUND "CLI11" "libcli11-dev")
find_package(fmt QUIET)
tessera_require(fmt_FOUND "fmt" "libfmt-dev")
find_package(spdlog QUIET)
tessera_require(spdlog_FOUND "spdlog" "libspdlog-dev")
find_package(nlohmann_json QUIET)
tessera_require(nlohmann_json_FOUND "nlohmann-json" "nlohmann-json3-dev")
# ONNX's protobuf classes: `tessera import onnx` and `tessera export onnx`.
find_package(Protobuf QUIET)
tessera_require(Protobuf_FOUND "Protocol Buffers" "libprotobuf-dev")
find_package(ONNX QUIET)
tessera_require(ONNX_FOUND "ONNX" "libonnx-dev")

if(TESSERA_BUILD_TESTS)
  find_package(GTest QUIET)
  tessera_require(GTest_FOUND "GoogleTest" "libgtest-dev")
endif()
