// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::network: what the peer transport's handlers hand to the network
// transport (the NVSHMEM module, ffi/nvshmem/) for the ranks of a group that
// live on other hosts. The two are separate shared objects built from this
// tree: the main extension loads where NVSHMEM is not installed, and the
// NVSHMEM module registers its entry point with a group when it connects one
// (runtime::ConnectTable), so the handlers call it through this
// plain-C interface.

#ifndef JAX_EP_FFI_KERNELS_NETWORK_H_
#define JAX_EP_FFI_KERNELS_NETWORK_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/group_view.h"

namespace jax_ep::network {

// What the hook puts, launched on the same stream right after the kernel
// that staged it.
enum SendOp : int32_t {
  // A low-latency send kernel staged the rows for every rank whose peers[]
  // entry is null in the outbox (BufferLayout::ll_outbox_*): they go into
  // those ranks' buffers, then their arrival flags, ordered after the data.
  kLowLatencyDispatchSend = group::kLowLatencyDispatch,
  kLowLatencyCombineSend = group::kLowLatencyCombine,
  // The rail exchange's pack staged one block per other host in the rail
  // outbox: each goes to that host's rail peer, then its flag.
  kRailSend = 2,
};

struct Send {
  int32_t op;  // SendOp
  group::GroupView view;
  const int32_t* recv_src;  // low-latency combine: `[L, R*T_max]`
  const int32_t* count;     // low-latency combine: `[L]`; rail: `[Hn]` rows
  const int32_t* pes;       // rail: `[Hn]` the rail peer on each host
  int64_t record_bytes;     // rail: bytes of one staged record
};

// Returns a cudaError_t (as int: a C interface between the two modules).
extern "C" typedef int (*SendFn)(const Send* send, cudaStream_t stream);

}  // namespace jax_ep::network

#endif  // JAX_EP_FFI_KERNELS_NETWORK_H_
