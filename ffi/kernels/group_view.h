// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// group::GroupView: everything a peer kernel (peer transport,
// low-latency pair, rail exchange, the network transport's puts) needs about
// its group, and the group's limits. Host-side set-up (allocation, IPC,
// registry): ffi/runtime/group.h.

#ifndef JAX_EP_FFI_KERNELS_GROUP_VIEW_H_
#define JAX_EP_FFI_KERNELS_GROUP_VIEW_H_

#include <cstdint>

#include "ffi/kernels/group_buffer_layout.h"
#include "ffi/kernels/group_mailbox.h"
#include "ffi/kernels/group_state.h"

namespace jax_ep::group {

// Ranks of one native group (a flag array per region is indexed by rank; one
// warp stages a token's destinations in two ballots).
inline constexpr int64_t kMaxRanks = 64;
// Hosts of a network group (the rail exchange stages them in one warp pair).
inline constexpr int64_t kMaxHosts = 64;

// Everything a peer kernel needs about its group, passed by value. All
// pointers are fixed at connect time (none changes per call), so launches are
// safe to capture into CUDA graphs.
struct GroupView {
  char* const* peers;  // device array [R]: base of each rank's buffer; null
                       // for a rank reached through the network transport
  char* own;           // this rank's buffer (== peers[rank]), device memory
  DeviceState* state;  // device memory
  Mailbox* mailbox;    // device pointer of the host-mapped mailbox
  BufferLayout layout;
  int64_t max_tokens;  // T_max
  int64_t hidden;      // H
  int64_t timeout_ns;  // every spin gives up after this long
  int32_t rank;
  int32_t num_ranks;   // R
  int32_t num_topk;    // K
  int32_t itemsize;    // bytes per activation element of the buffers
  int32_t num_blocks;  // SM budget: send kernels run num_blocks times their
                       // blocks per SM of sending blocks
                       // (peer_protocol.cuh), on whichever SMs are free;
                       // it bounds their threads, not which SMs (the dispatch's
                       // placing blocks use the rest)
  int32_t
      receive_while_sending;  // 1: every rank has a GPU of its own and
                              // every pair has native P2P atomics, so a
                              // dispatch receives in blocks that spin beside
                              // its sends (peer_dispatch.cu); 0: ranks
                              // share a GPU (MPS), where a spinning block could
                              // hold the SMs a peer's sender needs, or chunk
                              // counts could not be added atomically
  int32_t num_local;          // L = E / R local experts (low-latency ops)
  int32_t expert_alignment;   // each local expert's rows of the dispatch's
                              // recv_x start at a multiple of it
  int32_t low_latency;        // 1: the buffer has the low-latency regions
  int32_t network;            // 1: some peers are reached through the network
                              // transport (their peers[] entry is null; the
                              // buffer has the ll_outbox_* regions)
  int32_t num_hosts;          // Hn >= 2 for a network group (the rail_*
                              // regions), else 0
};

}  // namespace jax_ep::group

#endif  // JAX_EP_FFI_KERNELS_GROUP_VIEW_H_
