# gdnkit_build_estimate(): says at configure time how long the build will take, so that `pip install -v .`
# and `cmake --build` are not a silent wait of minutes.
#
# Measured at 0.1.0 with CUDA 13.0 (sm_90a, Release), the library alone: on a 16-core Xeon server the 10 CUDA
# translation units take 300 s of compile time in all, the longest one (prefill_k128.cu) 85 s, so the build
# takes about max(85 s, 300 s / jobs): 85 s wall with 16 jobs; on a 2-core development machine 218 s wall
# (435 s of compile time, the longest 141 s). The host-only (CPU) sources take under 15 s in all. The
# estimate below is max(longest, total / jobs) from the server's numbers plus a quarter for slower cores:
# 2 minutes on 16 cores, 4 on 2.
set(GDNKIT_NVCC_TOTAL_SECONDS 300)
set(GDNKIT_NVCC_LONGEST_SECONDS 85)

function(gdnkit_build_estimate)
  if(DEFINED ENV{CMAKE_BUILD_PARALLEL_LEVEL} AND "$ENV{CMAKE_BUILD_PARALLEL_LEVEL}" MATCHES "^[1-9][0-9]*$")
    set(jobs "$ENV{CMAKE_BUILD_PARALLEL_LEVEL}")
  else()
    cmake_host_system_information(RESULT jobs QUERY NUMBER_OF_LOGICAL_CORES)
    if(NOT jobs OR jobs LESS 1)
      set(jobs 1)
    endif()
  endif()
  if(GDNKIT_WITH_CUDA)
    math(EXPR seconds "${GDNKIT_NVCC_TOTAL_SECONDS} / ${jobs}")
    if(seconds LESS GDNKIT_NVCC_LONGEST_SECONDS)
      set(seconds ${GDNKIT_NVCC_LONGEST_SECONDS})
    endif()
    math(EXPR minutes "(${seconds} * 5 / 4 + 59) / 60")
    message(STATUS "gdnkit: building the CUDA kernels (sm_90a, 10 nvcc translation units): about ${minutes} "
                   "minute(s) on ${jobs} core(s), longer on slow cores; a CPU-only build "
                   "(-DGDNKIT_CUDA=OFF, pip: -C cmake.define.GDNKIT_CUDA=OFF) takes under a minute")
  else()
    message(STATUS "gdnkit: CPU-only build (the CPU reference backend; no CUDA kernels): under a minute")
  endif()
endfunction()
