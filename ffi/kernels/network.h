// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::network: what the peer transport's handlers hand to the network
// transport (the NVSHMEM module, ffi/nvshmem/) for the ranks of a group that
// live on other hosts. The two are separate shared objects built from this
// tree: the main extension loads where NVSHMEM is not installed, and the
// NVSHMEM module registers its entry point with a group when it connects one
// (intranode_group::ConnectTable), so the handlers call it through this
// plain-C interface.

#ifndef JAX_EP_FFI_KERNELS_NETWORK_H_
#define JAX_EP_FFI_KERNELS_NETWORK_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_kernels.h"

namespace jax_ep::network {

// A low-latency send kernel staged the rows for every rank whose peers[]
// entry is null in the outbox (BufferLayout::ll_outbox_*); the hook, launched
// next on the same stream, puts them into those ranks' buffers and then their
// arrival flags, ordered after the data.
struct LowLatencySend {
  int32_t op;  // intranode::LowLatencyOp
  intranode::GroupView view;
  const int32_t* recv_src;  // combine: `[L, R*T_max]` (the send's operand)
  const int32_t* count;     // combine: `[L]`
};

// Returns a cudaError_t (as int: a C interface between the two modules).
extern "C" typedef int (*LowLatencySendFn)(const LowLatencySend* send,
                                           cudaStream_t stream);

}  // namespace jax_ep::network

#endif  // JAX_EP_FFI_KERNELS_NETWORK_H_
