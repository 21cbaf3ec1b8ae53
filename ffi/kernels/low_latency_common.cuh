// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// What the low-latency kernel files share (low_latency_dispatch.cu,
// low_latency_combine.cu, low_latency_local.cu): block sizes, the waits'
// failure path (the send / wait order, the spin, the mailbox) and the
// staging of one token's rows (its experts, its row in each expert's
// region, the fp8 quantisation: fp8_quantize.cuh's rounding). Internal:
// included only by those kernel translation units. The protocol:
// low_latency_protocol.cuh.

#ifndef JAX_EP_FFI_KERNELS_LOW_LATENCY_COMMON_CUH_
#define JAX_EP_FFI_KERNELS_LOW_LATENCY_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/fp8_quantize.cuh"
#include "ffi/kernels/group_view.h"
#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/low_latency_kernels.h"
#include "ffi/kernels/low_latency_protocol.cuh"
#include "ffi/kernels/peer_protocol.cuh"

namespace jax_ep::low_latency {
namespace {

using detail::kFullMask;
using detail::LaneMaskLt;
using detail::LastBlockOfGrid;
using detail::Vec16;
using group::GroupView;
using group::kLowLatencyCombine;
using group::kLowLatencyDispatch;
using peer::kMaxK;
using peer::kMaxR;
using group::OpCode;
using group::WaitKind;

constexpr int kSendThreads = 128;  // dispatch / combine send: a block per row
constexpr int kSendVecs = 8;       // row vectors each send thread holds
constexpr int kSendBlocksPerSm = 4;
constexpr int kWaitThreads = 256;
constexpr int kScaleBlock = 128;  // channels per fp8 scale

using protocol::BufferSet;
using protocol::CombineFlag;
using protocol::CurrentSeq;
using protocol::DispatchFlag;
using protocol::FlagValue;

__device__ __forceinline__ int Region(int op) {
  return op == kLowLatencyDispatch ? group::kDispatchRegion
                                   : group::kCombineRegion;
}

__device__ __forceinline__ OpCode Code(int op) {
  return op == kLowLatencyDispatch ? OpCode::kLowLatencyDispatch
                                   : OpCode::kLowLatencyCombine;
}

// peer::RecordTimeout, inlined (see SpinArrival's NOTES: a call would
// give the wait kernels a stack frame).
__device__ __forceinline__ void RecordFailure(const GroupView& g, int op,
                                              WaitKind what, int peer,
                                              uint64_t seq) {
  if (atomicCAS(&g.state->error_claimed, 0u, 1u) == 0u) {
    volatile group::Mailbox* m = g.mailbox;
    m->op = static_cast<int32_t>(Code(op));
    m->rank = g.rank;
    m->peer = peer;
    m->wait_kind = static_cast<int32_t>(what);
    m->region = Region(op);
    m->seq = seq;
    __threadfence_system();  // fields before state
    m->state = 1u;
  }
  atomicExch(&g.state->aborted, 1u);
  __threadfence_system();
}

// Spins until `flag` (acquire, system scope) carries this call's `seq`;
// returns its row count (clamped to [0, T_max]), or 0 when the group aborted
// or the wait timed out (then recorded in the mailbox).
// NOTES: inlined and without a pointer out-parameter, so that no wait kernel
// needs local memory: with ranks sharing one GPU under MPS, the first launch
// of a kernel that does can wait for the whole GPU to drain, peers' spinning
// waits included (suspected behind fp8 dispatch timeouts at R = 8).
__device__ __forceinline__ int32_t SpinArrival(const GroupView& g,
                                               const uint64_t* flag,
                                               uint64_t seq, int op, int peer) {
  const uint64_t start = peer::GlobalTimerNs();
  const uint64_t want = seq & 0xffffffffull;
  while (true) {
    const uint64_t v = peer::LoadAcquireSys(flag);
    if ((v >> 32) == want) {
      return peer::ClampCount(static_cast<int32_t>(v & 0xffffffffull), g);
    }
    if (peer::Aborted(g)) return 0;
    if (peer::GlobalTimerNs() - start >
        static_cast<uint64_t>(g.timeout_ns)) {
      RecordFailure(g, op, WaitKind::kArrival, peer, seq);
      return 0;
    }
  }
}

// Block 0, thread 0 of a send kernel: claims the op's one outstanding send.
__device__ __forceinline__ void StartSend(const GroupView& g, int op,
                                          uint64_t seq) {
  volatile unsigned int* pending = &g.state->ll_pending[op];
  if (*pending != 0u) {
    RecordFailure(g, op, WaitKind::kOutOfOrder, g.rank, seq);
    return;
  }
  *pending = 1u;
}

// Thread 0 of every wait block: a wait needs its send before it.
__device__ __forceinline__ void CheckWaitHasSend(const GroupView& g, int op,
                                                 uint64_t seq) {
  if (*reinterpret_cast<const volatile unsigned int*>(
          &g.state->ll_pending[op]) == 0u) {
    RecordFailure(g, op, WaitKind::kOutOfOrder, g.rank, seq);
  }
}

// The wait's last block: completes the call (unless the group aborted).
__device__ __forceinline__ void FinishWait(const GroupView& g, int op,
                                           uint64_t seq, int32_t* status) {
  const bool aborted = peer::Aborted(g);
  if (!aborted) {
    g.state->ll_pending[op] = 0u;
    g.state->ll_seq[op] = seq;
  }
  *status = aborted ? 1 : 0;
}

// Warp 0 (whole warp) stages token t's slots: s_expert[k] = e where slot k is
// the token's first slot naming a valid expert e, else -1. Returns (lane 0)
// the invalid ids of t.
__device__ __forceinline__ int32_t
StageExperts(const int32_t* __restrict__ topk, int32_t t, int32_t num_topk,
             int32_t num_experts, int32_t* s_expert) {
  const int lane = threadIdx.x & 31;
  const int32_t e_lane = lane < num_topk ? topk[t * num_topk + lane] : -1;
  const bool valid = e_lane >= 0 && e_lane < num_experts;
  // The first slot of each expert: no lower lane holds the same id.
  const unsigned same = __match_any_sync(kFullMask, e_lane);
  const bool first = valid && (same & LaneMaskLt()) == 0u;
  if (lane < num_topk) s_expert[lane] = first ? e_lane : -1;
  return __popc(__ballot_sync(
      kFullMask, lane < num_topk && (e_lane < -1 || e_lane >= num_experts)));
}

// The whole block: s_pos[k] = the number of tokens before t that select
// s_expert[k] (its row in the expert's region), one block-wide count per
// slot and kSendThreads earlier tokens.
template <int kThreads>
__device__ __forceinline__ void StagePositions(const int32_t* __restrict__ topk,
                                               int32_t t, int32_t num_topk,
                                               const int32_t* s_expert,
                                               int32_t* s_pos) {
  for (int k = 0; k < num_topk; ++k) {
    const int32_t e = s_expert[k];  // block-uniform
    if (e < 0) continue;
    int32_t j = 0;
    for (int32_t u0 = 0; u0 < t; u0 += kThreads) {
      const int32_t u = u0 + threadIdx.x;
      bool hit = false;
      if (u < t) {
        for (int k2 = 0; k2 < num_topk; ++k2) {
          hit |= __ldg(topk + u * num_topk + k2) == e;
        }
      }
      j += __syncthreads_count(hit);
    }
    if (threadIdx.x == 0) s_pos[k] = j;
  }
}

// Vectors j = v0 + u * kThreads + threadIdx.x (u < kVecs) of one token's
// row `src` (rv vectors): v[u] as loaded (zeros past the row) and, for fp8,
// their e4m3 words q[u] with the scale of their 128-channel block. The Q = 128
// / kElems vectors of one scale block are Q consecutive lanes of one warp
// (v0 is a multiple of kThreads vectors), so a block's amax is a Q-lane
// shuffle reduction; every lane of the warp must call it.
template <typename T, RowFormat kFormat, int kThreads, int kVecs = kSendVecs>
__device__ __forceinline__ void LoadRowVecs(
    const uint4* __restrict__ src, int32_t v0, int32_t rv, uint4 (&v)[kVecs],
    uint32_t (&q)[kVecs][Vec16<T>::kElems / 4], float (&scale)[kVecs]) {
  constexpr int kElems = Vec16<T>::kElems;
  constexpr int kQ = kScaleBlock / kElems;
  static_assert(32 % kQ == 0, "a scale block spans whole lanes of one warp");
#pragma unroll
  for (int u = 0; u < kVecs; ++u) {
    const int32_t j = v0 + u * kThreads + threadIdx.x;
    v[u] = j < rv ? detail::LoadVec(src + j) : make_uint4(0, 0, 0, 0);
  }
  if constexpr (kFormat != RowFormat::kPlain) {
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      fp8::QuantizeVec<T, kFormat == RowFormat::kFp8PowerOfTwo>(v[u], q[u],
                                                               &scale[u]);
    }
  }
}

// The grid of both send kernels: the group's SM budget at kSendBlocksPerSm.
inline unsigned SendGrid(const GroupView& g) {
  return static_cast<unsigned>(g.num_blocks) * kSendBlocksPerSm;
}

}  // namespace
}  // namespace jax_ep::low_latency

#endif  // JAX_EP_FFI_KERNELS_LOW_LATENCY_COMMON_CUH_
