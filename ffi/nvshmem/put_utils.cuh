// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Device helpers of the network transport's put kernels
// (low_latency_puts.cu, rail_puts.cu).

#ifndef JAX_EP_FFI_NVSHMEM_PUT_UTILS_CUH_
#define JAX_EP_FFI_NVSHMEM_PUT_UTILS_CUH_

#include <cuda_runtime.h>

#include "ffi/kernels/ep_kernels.h"

namespace jax_ep::nvshmem {

constexpr int kPutThreads = 256;
constexpr int kPutWarps = kPutThreads / 32;

__device__ __forceinline__ bool Aborted(const intranode::GroupView& g) {
  return *reinterpret_cast<const volatile unsigned int*>(&g.state->aborted) !=
         0u;
}

// Whether this block is the last of its grid to get here; that block resets
// the counter (so the grid may differ between calls). Every thread has
// quieted its puts before.
__device__ __forceinline__ bool LastBlock(unsigned long long* counter) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const bool last = atomicAdd(counter, 1ull) + 1ull == gridDim.x;
    if (last) atomicExch(counter, 0ull);
    s_last = last ? 1 : 0;
  }
  __syncthreads();
  return s_last != 0;
}

// The put kernels' grid: the group's SM budget, one block per SM.
inline unsigned PutGrid(const intranode::GroupView& g) {
  return static_cast<unsigned>(g.num_blocks > 0 ? g.num_blocks : 1);
}

}  // namespace jax_ep::nvshmem

#endif  // JAX_EP_FFI_NVSHMEM_PUT_UTILS_CUH_
