// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Device helpers of the network transport's put kernels
// (low_latency_puts.cu, rail_puts.cu).

#ifndef JAX_EP_FFI_NVSHMEM_PUT_UTILS_CUH_
#define JAX_EP_FFI_NVSHMEM_PUT_UTILS_CUH_

#include <cuda_runtime.h>

#include "ffi/kernels/group_view.h"
#include "ffi/kernels/kernel_utils.cuh"

namespace jax_ep::nvshmem {

constexpr int kPutThreads = 256;
constexpr int kPutWarps = kPutThreads / 32;

__device__ __forceinline__ bool Aborted(const group::GroupView& g) {
  return *reinterpret_cast<const volatile unsigned int*>(&g.state->aborted) !=
         0u;
}

// The put kernels' grid: the group's SM budget, one block per SM.
inline unsigned PutGrid(const group::GroupView& g) {
  return static_cast<unsigned>(g.num_blocks > 0 ? g.num_blocks : 1);
}

}  // namespace jax_ep::nvshmem

#endif  // JAX_EP_FFI_NVSHMEM_PUT_UTILS_CUH_
