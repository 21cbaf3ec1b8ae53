// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::low_latency, the protocol: where its state lives (the call's
// sequence and buffer set, and the arrival flags). Shared by the peer
// transport's kernels (low_latency_dispatch.cu, low_latency_combine.cu) and
// the network transport's put kernels (ffi/nvshmem/low_latency_puts.cu),
// which must agree on every offset. The buffers: BufferLayout::ll_* in
// group_buffer_layout.h; the launchers: low_latency_kernels.h.
//
// NOTES: the protocol.
// * Addresses known in advance. Receiver r keeps, per (local expert l, source
//   s), a private region of T_max rows. A sender s knows where its token t's
//   row for expert e lands without asking: rank e / L, expert e % L, row j =
//   the number of s's tokens before t that select e (a warp ballot over the
//   earlier tokens' ids; slots of one token naming the same expert are one
//   row, the first slot's). No count exchange precedes the data, and no
//   atomic decides a position: the receiver packs expert l's rows in (source,
//   token) order from the per-source counts.
// * Counts are the arrival flags. After its last row a sender's last block
//   (blocks_done counter, as in the peer protocol) stores, for every
//   expert e, flag(set, l, s) = (seq << 32 | rows) on rank e / L with
//   st.release.sys, after __threadfence_system in every block. Zero rows is
//   (seq << 32), distinct from any earlier call's value, so a receiver never
//   mistakes an old flag for a new one and nothing is cleared between calls.
// * Two buffer sets. Call n (0-based, DeviceState::ll_seq[op] = n completed)
//   uses set n % 2 and tag seq = n + 1. Why two are enough: a sender writes
//   set n % 2 of rank r in call n + 2 only after its own wait of call n + 1,
//   which needs r's flags of call n + 1, which r sends only after its wait of
//   call n (stream order) finished reading set n % 2. Every rank waits for
//   every rank's flags in every call (flags are sent with zero rows too), so
//   the chain holds for all pairs.
// * Sequence in device memory. The send reads ll_seq; the wait's last block
//   advances it. Nothing per call is baked into a launch: replays of a CUDA
//   graph stay correct. One send may be outstanding per op: a send while the
//   previous send's wait has not run (ll_pending) would reuse that call's
//   set and tag, so it is recorded as an error (WaitKind::kOutOfOrder) and
//   the group aborts, as a wait with no send before it does.
// * Combine. Each received row travels back to its token's home rank, to
//   ll_combine_rows[set][t][k] (k the first slot of the token naming that
//   expert); then one flag per (home, expert rank). The home reduces
//   out[t] = sum_k w[t, k] * row(t, k) in fp32, k ascending, once every
//   rank's flag arrived.
// * Residency. Send kernels never spin. Each wait spins in one block (flags
//   only), then copies or reduces in a bounded grid that never spins, whose
//   last block completes the call: with R ranks sharing one GPU (MPS),
//   R spinning blocks can never hold the SMs a peer's send needs (the rule of
//   the high-throughput transport too). Every spin has the group's timeout
//   (mailbox, abort): never a hang.
// * Reads of peer-written data use ld.global.cg (L2), after the acquire.

#ifndef JAX_EP_FFI_KERNELS_LOW_LATENCY_PROTOCOL_CUH_
#define JAX_EP_FFI_KERNELS_LOW_LATENCY_PROTOCOL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/group_view.h"

namespace jax_ep::low_latency::protocol {

// The current call of `op` (1-based): completed calls + 1.
__device__ __forceinline__ uint64_t CurrentSeq(const group::GroupView& g,
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
                                                  const group::GroupView& g,
                                                  int set, int l, int src) {
  return reinterpret_cast<uint64_t*>(base + g.layout.ll_flags) +
         (static_cast<int64_t>(set) * g.num_local + l) * g.num_ranks + src;
}

// Expert rank src's combine rows have all arrived, in buffer set `set`.
__device__ __forceinline__ uint64_t* CombineFlag(char* base,
                                                 const group::GroupView& g,
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
