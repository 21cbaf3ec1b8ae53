// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Where the low-latency protocol's state lives (ffi/kernels/low_latency.cu
// describes the protocol): the call's sequence and buffer set, and the
// arrival flags. Shared by the peer transport's kernels and the network
// transport's put kernels (ffi/nvshmem/low_latency_puts.cu), which must agree
// on every offset.

#ifndef JAX_EP_FFI_KERNELS_LOW_LATENCY_PROTOCOL_CUH_
#define JAX_EP_FFI_KERNELS_LOW_LATENCY_PROTOCOL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_kernels.h"

namespace jax_ep::low_latency::protocol {

// The current call of `op` (1-based): completed calls + 1.
__device__ __forceinline__ uint64_t CurrentSeq(const intranode::GroupView& g,
                                               int op) {
  return *reinterpret_cast<const volatile unsigned long long*>(
             &g.state->ll_seq[op]) +
         1ull;
}

__device__ __forceinline__ int BufferSet(uint64_t seq) {
  return static_cast<int>((seq - 1ull) & 1ull);
}

// Source src's count of rows for local expert l, in buffer set `set`.
__device__ __forceinline__ uint64_t* DispatchFlag(char* base,
                                                  const intranode::GroupView& g,
                                                  int set, int l, int src) {
  return reinterpret_cast<uint64_t*>(base + g.layout.ll_flags) +
         (static_cast<int64_t>(set) * g.num_local + l) * g.num_ranks + src;
}

// Expert rank src's combine rows have all arrived, in buffer set `set`.
__device__ __forceinline__ uint64_t* CombineFlag(char* base,
                                                 const intranode::GroupView& g,
                                                 int set, int src) {
  return reinterpret_cast<uint64_t*>(base + g.layout.ll_flags) +
         2ll * g.num_local * g.num_ranks +
         static_cast<int64_t>(set) * g.num_ranks + src;
}

// A flag's value: the call in the high half (only its low 32 bits), the
// count in the low half (zero rows is still distinct from any other call).
__device__ __forceinline__ uint64_t FlagValue(uint64_t seq, int32_t count) {
  return (seq << 32) | static_cast<uint32_t>(count);
}

}  // namespace jax_ep::low_latency::protocol

#endif  // JAX_EP_FFI_KERNELS_LOW_LATENCY_PROTOCOL_CUH_
