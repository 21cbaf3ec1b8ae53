// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Where the rail exchange's state lives (ffi/kernels/rail_exchange.cu
// describes the protocol): the call's sequence and inbox set, the blocks and
// the flags. Shared by the pack / wait kernels and the network transport's
// put kernel (ffi/nvshmem/rail_puts.cu), which must agree on every offset.

#ifndef JAX_EP_FFI_KERNELS_RAIL_PROTOCOL_CUH_
#define JAX_EP_FFI_KERNELS_RAIL_PROTOCOL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/group_view.h"

namespace jax_ep::rail::protocol {

// The current call (1-based): completed calls + 1.
__device__ __forceinline__ uint64_t CurrentSeq(const group::GroupView& g) {
  return *reinterpret_cast<const volatile unsigned long long*>(
             &g.state->rail_seq) +
         1ull;
}

__device__ __forceinline__ int InboxSet(uint64_t seq) {
  return static_cast<int>((seq - 1ull) & 1ull);
}

// Block `host` (the source host) of inbox set `set` (room for T_max records
// of the widest call; a call's rows are at its own record stride).
__device__ __forceinline__ char* Inbox(char* base,
                                       const group::GroupView& g, int set,
                                       int host) {
  return base + g.layout.rail_inbox[set] +
         static_cast<int64_t>(host) * g.max_tokens * g.layout.rail_record_bytes;
}

// Block `host` (the destination host) of the outbox.
__device__ __forceinline__ char* Outbox(char* base,
                                        const group::GroupView& g,
                                        int host) {
  return base + g.layout.rail_outbox +
         static_cast<int64_t>(host) * g.max_tokens * g.layout.rail_record_bytes;
}

// Source host `host`'s rows of this call have arrived, in set `set`.
__device__ __forceinline__ uint64_t* Flag(char* base,
                                          const group::GroupView& g,
                                          int set, int host) {
  return reinterpret_cast<uint64_t*>(base + g.layout.rail_flags) +
         static_cast<int64_t>(set) * g.num_hosts + host;
}

// The call in the high half (its low 32 bits), the rows in the low half.
__device__ __forceinline__ uint64_t FlagValue(uint64_t seq, int32_t rows) {
  return (seq << 32) | static_cast<uint32_t>(rows);
}

// This rank's host: the one whose rail peer it is itself (-1 if none).
__device__ __forceinline__ int OwnHost(const group::GroupView& g,
                                       const int32_t* pes) {
  for (int h = 0; h < g.num_hosts; ++h) {
    if (pes[h] == g.rank) return h;
  }
  return -1;
}

}  // namespace jax_ep::rail::protocol

#endif  // JAX_EP_FFI_KERNELS_RAIL_PROTOCOL_CUH_
