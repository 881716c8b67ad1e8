# The CUDA path (TESSERA_ENABLE_CUDA=ON): nvcc, the CUDA runtime, cuBLAS, cuDNN and NCCL.
# The toolkit is found the usual way (nvcc on PATH, CUDACXX, or CMAKE_CUDA_COMPILER); its
# standard location is tried last. Without a GPU the build still compiles and links: the
# architectures default to 90 (H100/H200), since "native" needs a GPU at configure time.
if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(TESSERA_NVCC nvcc PATHS /usr/local/cuda/bin)
  if(NOT TESSERA_NVCC)
    message(FATAL_ERROR "TESSERA_ENABLE_CUDA=ON needs the CUDA toolkit (nvcc not found on PATH or in "
                        "/usr/local/cuda/bin); set CUDACXX or -DCMAKE_CUDA_COMPILER=.../nvcc")
  endif()
  set(CMAKE_CUDA_COMPILER "${TESSERA_NVCC}")
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
enable_language(CUDA)
# CMake 3.25 does not know that nvcc 13 takes C++20; the .cu files need only C++17.
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)

get_filename_component(TESSERA_CUDA_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
# A library of the CUDA stack (cuDNN, NCCL): its header and shared library, in the toolkit's
# folders or under $ENV{<PREFIX>_ROOT}; a clear error when either is missing.
function(tessera_find_cuda_library prefix header library what)
  find_path(${prefix}_INCLUDE_DIR ${header} HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV ${prefix}_ROOT PATH_SUFFIXES include)
  find_library(${prefix}_LIBRARY ${library} HINTS ${CUDAToolkit_LIBRARY_DIR} "${TESSERA_CUDA_ROOT}/lib64"
               ENV ${prefix}_ROOT PATH_SUFFIXES lib lib64)
  if(NOT ${prefix}_INCLUDE_DIR OR NOT ${prefix}_LIBRARY)
    message(FATAL_ERROR "TESSERA_ENABLE_CUDA=ON needs ${what} (${header} and lib${library}); set ${prefix}_ROOT")
  endif()
endfunction()
tessera_find_cuda_library(CUDNN cudnn.h cudnn "cuDNN 9")
tessera_find_cuda_library(NCCL nccl.h nccl "NCCL 2.18 or newer")

add_library(tessera_cudnn INTERFACE)
target_include_directories(tessera_cudnn SYSTEM INTERFACE "${CUDNN_INCLUDE_DIR}")
target_link_libraries(tessera_cudnn INTERFACE "${CUDNN_LIBRARY}" CUDA::cudart_static)
add_library(tessera_nccl INTERFACE)
target_include_directories(tessera_nccl SYSTEM INTERFACE "${NCCL_INCLUDE_DIR}")
target_link_libraries(tessera_nccl INTERFACE "${NCCL_LIBRARY}" CUDA::cudart_static)
message(STATUS "Tessera CUDA path: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}, "
               "cuDNN ${CUDNN_LIBRARY}, NCCL ${NCCL_LIBRARY}")
