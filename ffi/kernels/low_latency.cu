// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::low_latency: the decode-time dispatch / combine over an intranode
// group's low-latency buffers (BufferLayout::ll_*, ep_kernels.h). Each op is a
// send kernel and a wait kernel, launched by separate custom calls.
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
//   (blocks_done counter, as in the intranode protocol) stores, for every
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

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_kernels.h"
#include "ffi/kernels/intranode_protocol.cuh"
#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/low_latency_protocol.cuh"

namespace jax_ep::low_latency {
namespace {

using detail::kFullMask;
using detail::LaneMaskLt;
using detail::LastBlockOfGrid;
using detail::Vec16;
using intranode::GroupView;
using intranode::kLowLatencyCombine;
using intranode::kLowLatencyDispatch;
using intranode::kMaxK;
using intranode::kMaxR;
using intranode::OpCode;
using intranode::WaitKind;

constexpr int kSendThreads = 128;  // dispatch / combine send: a block per row
constexpr int kSendVecs = 8;       // row vectors each send thread holds
constexpr int kSendBlocksPerSm = 4;
constexpr int kWaitThreads = 256;
// NOTES: without a minimum of blocks per SM in its launch bounds, ptxas spilled
// a few bytes of the fp8 row copy to local memory (nvcc 13.0); see SpinArrival
// for why no wait-side kernel may use local memory.
constexpr int kWaitBlocksPerSmBound = 4;
constexpr int kPackVecs = 8;  // row vectors each lane of a packing warp holds
constexpr int kCombineRows = 2;   // rows a combine send block moves at a time
constexpr int kScaleBlock = 128;  // channels per fp8 scale
constexpr int kLocalVecs = 2;     // row vectors per thread, one-rank dispatch
constexpr int kCombineSlots = 8;  // slots' loads in flight, one-rank combine

using protocol::BufferSet;
using protocol::CombineFlag;
using protocol::CurrentSeq;
using protocol::DispatchFlag;
using protocol::FlagValue;

__device__ __forceinline__ int Region(int op) {
  return op == kLowLatencyDispatch ? intranode::kDispatchRegion
                                   : intranode::kCombineRegion;
}

__device__ __forceinline__ OpCode Code(int op) {
  return op == kLowLatencyDispatch ? OpCode::kLowLatencyDispatch
                                   : OpCode::kLowLatencyCombine;
}

// intranode::RecordTimeout, inlined (see SpinArrival's NOTES: a call would
// give the wait kernels a stack frame).
__device__ __forceinline__ void RecordFailure(const GroupView& g, int op,
                                              WaitKind what, int peer,
                                              uint64_t seq) {
  if (atomicCAS(&g.state->error_claimed, 0u, 1u) == 0u) {
    volatile intranode::Mailbox* m = g.mailbox;
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
  const uint64_t start = intranode::GlobalTimerNs();
  const uint64_t want = seq & 0xffffffffull;
  while (true) {
    const uint64_t v = intranode::LoadAcquireSys(flag);
    if ((v >> 32) == want) {
      return intranode::ClampCount(static_cast<int32_t>(v & 0xffffffffull), g);
    }
    if (intranode::Aborted(g)) return 0;
    if (intranode::GlobalTimerNs() - start >
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
  const bool aborted = intranode::Aborted(g);
  if (!aborted) {
    g.state->ll_pending[op] = 0u;
    g.state->ll_seq[op] = seq;
  }
  *status = aborted ? 1 : 0;
}

// The smallest power of two >= s (s > 0 and finite), exactly.
__device__ __forceinline__ float RoundUpPowerOfTwo(float s) {
  const uint32_t bits = __float_as_uint(s);
  const uint32_t exponent = bits & 0x7f800000u;
  const uint32_t mantissa = bits & 0x007fffffu;
  if (exponent == 0u) {  // subnormal: the next power of two of the mantissa
    if ((mantissa & (mantissa - 1u)) == 0u) return s;
    return __uint_as_float(1u << (32 - __clz(mantissa)));
  }
  if (mantissa == 0u) return s;
  return __uint_as_float(exponent + 0x00800000u);
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
      float f[kElems];
      Vec16<T>::Unpack(v[u], f);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kElems; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
      for (int off = kQ / 2; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
      }
      // The reference's rounding: amax * fp32(1 / 448), 1 for zeros.
      float s = amax > 0.0f ? amax * static_cast<float>(1.0 / 448.0) : 1.0f;
      if constexpr (kFormat == RowFormat::kFp8PowerOfTwo) {
        s = RoundUpPowerOfTwo(s);
      }
      scale[u] = s;
#pragma unroll
      for (int i = 0; i < kElems / 4; ++i) {
        uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; b += 2) {
          // IEEE division (no fast math), e4m3 round-to-nearest-even,
          // saturating at 448 like the reference's |x / s| <= 448.
          const float2 pair =
              make_float2(f[4 * i + b] / s, f[4 * i + b + 1] / s);
          const __nv_fp8x2_storage_t p =
              __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
          word |= static_cast<uint32_t>(p) << (8 * b);
        }
        q[u][i] = word;
      }
    }
  }
}

// Relaxed system-scope store (callers fence before it).
__device__ __forceinline__ void StoreRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v)
               : "memory");
}

// ---------------------------------------------------------------------------
// Dispatch send.
// ---------------------------------------------------------------------------

// One token's rows, kSendVecs vectors per thread per pass: the plain rows, or
// e4m3 with one scale per 128 channels. The Q = 128 / kElems vectors of one
// scale block are Q consecutive lanes of one warp (pass starts are multiples
// of kSendThreads vectors), so the block's amax is a Q-lane shuffle reduction.
template <typename T, RowFormat kFormat>
__global__ void __launch_bounds__(kSendThreads, kSendBlocksPerSm)
    DispatchSendKernel(GroupView g, const uint4* __restrict__ x,
                       const int32_t* __restrict__ topk,
                       const float* __restrict__ slot_scale, int32_t num_tokens,
                       int32_t* num_invalid, unsigned long long* counter) {
  constexpr int kElems = Vec16<T>::kElems;
  constexpr int kQ = kScaleBlock / kElems;  // vectors per scale block
  static_assert(32 % kQ == 0, "a scale block spans whole lanes of one warp");
  constexpr bool kFp8 = kFormat != RowFormat::kPlain;
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_expert[kMaxK];
  __shared__ int32_t s_pos[kMaxK];
  const int op = kLowLatencyDispatch;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  if (blockIdx.x == 0 && threadIdx.x == 0) StartSend(g, op, seq);
  if (intranode::BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  const int me = g.rank;
  const int32_t num_topk = g.num_topk;
  const int32_t num_local = g.num_local;
  const int32_t num_experts = num_local * g.num_ranks;
  const int64_t t_max = g.max_tokens;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t rv = static_cast<int32_t>(g.hidden / kElems);  // x vectors
  int32_t* send_counts =
      reinterpret_cast<int32_t*>(g.own + g.layout.ll_send_counts);
  int32_t invalid = 0;
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      const int32_t bad =
          StageExperts(topk, t, num_topk, num_experts, s_expert);
      if (threadIdx.x == 0) {
        invalid += bad;
        for (int k = 0; k < num_topk; ++k) {
          if (s_expert[k] >= 0) atomicAdd(send_counts + s_expert[k], 1);
        }
      }
    }
    __syncthreads();
    StagePositions<kSendThreads>(topk, t, num_topk, s_expert, s_pos);
    __syncthreads();
    const uint4* src = x + static_cast<int64_t>(t) * rv;
    for (int32_t v0 = 0; v0 < rv; v0 += kSendThreads * kSendVecs) {
      // fp8: quantise once per token, then send the same bytes everywhere.
      uint4 v[kSendVecs];
      uint32_t q[kSendVecs][kElems / 4];
      float scale[kSendVecs];
      LoadRowVecs<T, kFormat, kSendThreads>(src, v0, rv, v, q, scale);
      for (int k = 0; k < num_topk; ++k) {
        const int32_t e = s_expert[k];  // block-uniform
        if (e < 0) continue;
        const int d = e / num_local;
        const int l = e - d * num_local;
        // A rank on another host (no pointer): the row goes to the outbox at
        // (l, d, j), and the network transport's put kernel moves it.
        char* const base = s_peer[d];
        const int64_t slot =
            (static_cast<int64_t>(l) * g.num_ranks + (base ? me : d)) * t_max +
            s_pos[k];
        char* row = base ? base + g.layout.ll_dispatch_rows[set]
                         : g.own + g.layout.ll_outbox_rows[op];
        row += slot * row_bytes;
        if (v0 == 0 && threadIdx.x == 0) {
          char* meta = base ? base + g.layout.ll_dispatch_meta[set]
                            : g.own + g.layout.ll_outbox_meta;
          reinterpret_cast<int32_t*>(meta)[slot] = t * num_topk + k;
        }
        float w = 1.0f;
        if (!kFp8 && slot_scale != nullptr) w = slot_scale[t * num_topk + k];
#pragma unroll
        for (int u = 0; u < kSendVecs; ++u) {
          const int32_t j = v0 + u * kSendThreads + threadIdx.x;
          if (j >= rv) continue;
          if constexpr (kFp8) {
            if constexpr (kElems == 8) {
              reinterpret_cast<uint2*>(row)[j] = make_uint2(q[u][0], q[u][1]);
            } else {
              reinterpret_cast<uint32_t*>(row)[j] = q[u][0];
            }
            if (j % kQ == 0) {
              reinterpret_cast<float*>(row + g.hidden)[j / kQ] = scale[u];
            }
          } else {
            uint4 out = v[u];
            if (slot_scale != nullptr) {
              float f[kElems];
              Vec16<T>::Unpack(v[u], f);
#pragma unroll
              for (int i = 0; i < kElems; ++i) f[i] *= w;
              out = Vec16<T>::Pack(f);
            }
            reinterpret_cast<uint4*>(row)[j] = out;
          }
        }
      }
    }
  }
  if (threadIdx.x == 0 && invalid != 0) {
    atomicAdd(&g.state->ll_invalid, static_cast<unsigned>(invalid));
  }
  if (!intranode::ArriveLastBlock(counter, gridDim.x)) return;
  // Every block's rows and counts are visible (ArriveLastBlock's fences). One
  // fence per thread, then relaxed flag stores: the order of a release store
  // per flag at one fence (the reset of a count needs no order: the flag
  // carries its value).
  __threadfence_system();
  int32_t* outbox_counts =
      reinterpret_cast<int32_t*>(g.own + g.layout.ll_outbox_counts);
  for (int32_t e = threadIdx.x; e < num_experts; e += kSendThreads) {
    const int32_t rows = atomicExch(send_counts + e, 0);
    const int d = e / num_local;
    if (s_peer[d] == nullptr) {  // the put kernel sends it after the rows
      outbox_counts[e] = rows;
      continue;
    }
    StoreRelaxedSys(DispatchFlag(s_peer[d], g, set, e - d * num_local, me),
                    FlagValue(seq, rows));
  }
  if (threadIdx.x == 0)
    *num_invalid = static_cast<int32_t>(atomicExch(&g.state->ll_invalid, 0u));
}

// ---------------------------------------------------------------------------
// Dispatch wait, in two kernels: one block spins on the flags (so that a rank
// never holds more than one spinning block: with ranks sharing a GPU, many
// spinning blocks could hold the SMs a peer's send needs), then a bounded
// grid that never spins packs the rows.
// ---------------------------------------------------------------------------

// One block of kFlagsThreads: thread i waits for the flags (l, s) with
// l * R + s = i, i + kFlagsThreads, ...; then ll_recv_start[l][s] = rows of
// sources < s, [R] = the expert's total, and count[l].
constexpr int kFlagsThreads = 1024;

__global__ void __launch_bounds__(kFlagsThreads)
    DispatchFlagsKernel(GroupView g, int32_t* __restrict__ count) {
  const int op = kLowLatencyDispatch;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  if (threadIdx.x == 0) CheckWaitHasSend(g, op, seq);
  __syncthreads();
  const int num_ranks = g.num_ranks;
  const int32_t num_local = g.num_local;
  int32_t* start = reinterpret_cast<int32_t*>(g.own + g.layout.ll_recv_start);
  for (int32_t i = threadIdx.x; i < num_local * num_ranks; i += kFlagsThreads) {
    const int l = i / num_ranks;
    const int s = i - l * num_ranks;
    start[l * (num_ranks + 1) + s + 1] =
        intranode::Aborted(g)
            ? 0
            : SpinArrival(g, DispatchFlag(g.own, g, set, l, s), seq, op, s);
  }
  __syncthreads();
  for (int32_t l = threadIdx.x; l < num_local; l += kFlagsThreads) {
    int32_t* row = start + l * (num_ranks + 1);
    row[0] = 0;
    for (int s = 0; s < num_ranks; ++s) row[s + 1] += row[s];
    count[l] = row[num_ranks];
  }
}

// A warp per output row (l, i) of the [L, R*T_max] slabs: rows past the
// expert's total get recv_src = -1, the others their source's row.
template <RowFormat kFormat, bool kUe8m0>
__global__ void __launch_bounds__(kWaitThreads, kWaitBlocksPerSmBound)
    DispatchPackKernel(GroupView g, char* __restrict__ recv_x,
                       void* __restrict__ scales,
                       int32_t* __restrict__ recv_src, int32_t* status,
                       unsigned long long* counter) {
  constexpr bool kFp8 = kFormat != RowFormat::kPlain;
  const int op = kLowLatencyDispatch;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  const int lane = threadIdx.x & 31;
  const int num_ranks = g.num_ranks;
  const int64_t t_max = g.max_tokens;
  const int64_t slab = num_ranks * t_max;
  const int64_t hidden = g.hidden;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int64_t out_bytes = kFp8 ? hidden : row_bytes;
  const int32_t out_vecs = static_cast<int32_t>(out_bytes / 16);
  const int32_t num_scales = static_cast<int32_t>(hidden / kScaleBlock);
  const char* rows = g.own + g.layout.ll_dispatch_rows[set];
  const int32_t* meta =
      reinterpret_cast<const int32_t*>(g.own + g.layout.ll_dispatch_meta[set]);
  const int32_t* start =
      reinterpret_cast<const int32_t*>(g.own + g.layout.ll_recv_start);
  const int32_t code_stride = static_cast<int32_t>(t_max * g.num_topk);
  const int64_t num_rows = static_cast<int64_t>(g.num_local) * slab;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kWaitThreads / 32);
  for (int64_t out_row =
           (static_cast<int64_t>(blockIdx.x) * kWaitThreads + threadIdx.x) / 32;
       out_row < num_rows; out_row += warps) {
    const int64_t l = out_row / slab;
    const int32_t i = static_cast<int32_t>(out_row - l * slab);
    const int32_t* st = start + l * (num_ranks + 1);
    if (i >= st[num_ranks]) {  // warp-uniform
      if (lane == 0) recv_src[out_row] = -1;
      continue;
    }
    // The source: the number of sources s >= 1 whose rows start at or before i.
    int s = 0;
    for (int s0 = 1; s0 <= num_ranks; s0 += 32) {
      const int q = s0 + lane;
      s += __popc(__ballot_sync(kFullMask, q < num_ranks && st[q] <= i));
    }
    const int64_t slot = (l * num_ranks + s) * t_max + (i - st[s]);
    const uint4* src = reinterpret_cast<const uint4*>(rows + slot * row_bytes);
    uint4* dst = reinterpret_cast<uint4*>(recv_x + out_row * out_bytes);
    // kPackVecs loads in flight per lane (a row is 14 to 28 of its vectors).
    for (int32_t j0 = lane; j0 < out_vecs; j0 += 32 * kPackVecs) {
      uint4 v[kPackVecs];
#pragma unroll
      for (int u = 0; u < kPackVecs; ++u) {
        const int32_t j = j0 + 32 * u;
        if (j < out_vecs) v[u] = __ldcg(src + j);
      }
#pragma unroll
      for (int u = 0; u < kPackVecs; ++u) {
        const int32_t j = j0 + 32 * u;
        if (j < out_vecs) dst[j] = v[u];
      }
    }
    if constexpr (kFp8) {
      const float* src_scales =
          reinterpret_cast<const float*>(rows + slot * row_bytes + hidden);
      if constexpr (kUe8m0) {
        int32_t* dst_scales =
            static_cast<int32_t*>(scales) + out_row * (num_scales / 4);
        for (int32_t c = lane; c < num_scales / 4; c += 32) {
          uint32_t packed = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const uint32_t bits =
                __float_as_uint(__ldcg(src_scales + 4 * c + b));
            packed |= ((bits >> 23) & 0xffu) << (8 * b);
          }
          dst_scales[c] = static_cast<int32_t>(packed);
        }
      } else {
        float* dst_scales = static_cast<float*>(scales) + out_row * num_scales;
        for (int32_t c = lane; c < num_scales; c += 32)
          dst_scales[c] = __ldcg(src_scales + c);
      }
    }
    if (lane == 0) {
      const int32_t code = __ldcg(meta + slot);
      recv_src[out_row] = s * code_stride + min(max(code, 0), code_stride - 1);
    }
  }
  if (LastBlockOfGrid(counter) && threadIdx.x == 0) {
    FinishWait(g, op, seq, status);
  }
}

// ---------------------------------------------------------------------------
// Combine send: items are the valid rows (l, i < count[l]) in expert order.
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kSendThreads, kSendBlocksPerSm)
    CombineSendKernel(GroupView g, const uint4* __restrict__ expert_out,
                      const int32_t* __restrict__ recv_src,
                      const int32_t* __restrict__ count,
                      unsigned long long* counter) {
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_start[kMaxExperts + 1];
  __shared__ int32_t s_warp[kSendThreads / 32];
  const int op = kLowLatencyCombine;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  if (blockIdx.x == 0 && threadIdx.x == 0) StartSend(g, op, seq);
  if (intranode::BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  const int me = g.rank;
  const int32_t num_local = g.num_local;
  const int64_t t_max = g.max_tokens;
  const int64_t slab = g.num_ranks * t_max;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t rv = static_cast<int32_t>(row_bytes / 16);
  const int32_t code_stride = static_cast<int32_t>(t_max * g.num_topk);
  // s_start[l] = valid rows of experts < l (counts clamped to the slab).
  int32_t run = 0;
  for (int32_t l0 = 0; l0 < num_local; l0 += kSendThreads) {
    const int32_t l = l0 + threadIdx.x;
    const int32_t c =
        l < num_local ? min(max(count[l], 0), static_cast<int32_t>(slab)) : 0;
    int32_t all = 0;
    const int32_t before =
        detail::BlockExclusiveScan<kSendThreads>(c, s_warp, &all);
    if (l < num_local) s_start[l] = run + before;
    run += all;
    __syncthreads();  // s_warp is reused by the next chunk
  }
  if (threadIdx.x == 0) s_start[num_local] = run;
  __syncthreads();
  const int32_t total = run;
  // kCombineRows rows per block at a time: twice the loads in flight.
  for (int32_t item0 = blockIdx.x * kCombineRows; item0 < total;
       item0 += gridDim.x * kCombineRows) {
    uint4* dst[kCombineRows];
    const uint4* src[kCombineRows];
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) {
      const int32_t item = item0 + r;
      dst[r] = nullptr;
      src[r] = nullptr;
      if (item >= total) continue;  // block-uniform
      int lo = 0, hi = num_local;   // the l: s_start[l] <= item < s_start[l+1]
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s_start[mid] <= item)
          lo = mid;
        else
          hi = mid;
      }
      const int64_t in_row = lo * slab + (item - s_start[lo]);
      const int32_t code = recv_src[in_row];
      if (code < 0 || code >= g.num_ranks * code_stride) continue;
      const int s = code / code_stride;
      const int64_t tk = code - s * code_stride;
      // A home on another host: staged in the outbox at the row's own place,
      // for the network transport's put kernel (the source of a put must be
      // memory the network can read).
      dst[r] = reinterpret_cast<uint4*>(
          s_peer[s] != nullptr
              ? s_peer[s] + g.layout.ll_combine_rows[set] + tk * row_bytes
              : g.own + g.layout.ll_outbox_rows[op] + in_row * row_bytes);
      src[r] = expert_out + in_row * rv;
    }
    for (int32_t v0 = 0; v0 < rv; v0 += kSendThreads * kSendVecs) {
      uint4 v[kCombineRows][kSendVecs];
#pragma unroll
      for (int r = 0; r < kCombineRows; ++r) {
#pragma unroll
        for (int u = 0; u < kSendVecs; ++u) {
          const int32_t j = v0 + u * kSendThreads + threadIdx.x;
          if (src[r] != nullptr && j < rv)
            v[r][u] = detail::LoadVec(src[r] + j);
        }
      }
#pragma unroll
      for (int r = 0; r < kCombineRows; ++r) {
#pragma unroll
        for (int u = 0; u < kSendVecs; ++u) {
          const int32_t j = v0 + u * kSendThreads + threadIdx.x;
          if (dst[r] != nullptr && j < rv) dst[r][j] = v[r][u];
        }
      }
    }
  }
  if (!intranode::ArriveLastBlock(counter, gridDim.x)) return;
  if (threadIdx.x < g.num_ranks && s_peer[threadIdx.x] != nullptr) {
    intranode::StoreReleaseSys(CombineFlag(s_peer[threadIdx.x], g, set, me),
                               FlagValue(seq, 0));
  }
}

// ---------------------------------------------------------------------------
// Combine wait: one block waits for the R flags, then a bounded grid that
// never spins reduces (or gathers) tokens t = blockIdx.x, + gridDim.x, ...
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kMaxR) CombineFlagsKernel(GroupView g) {
  const int op = kLowLatencyCombine;
  const uint64_t seq = CurrentSeq(g, op);
  if (threadIdx.x == 0) CheckWaitHasSend(g, op, seq);
  __syncthreads();
  if (threadIdx.x < g.num_ranks && !intranode::Aborted(g)) {
    SpinArrival(g, CombineFlag(g.own, g, BufferSet(seq), threadIdx.x), seq, op,
                threadIdx.x);
  }
}

template <typename T, bool kGather>
__global__ void __launch_bounds__(kWaitThreads)
    CombineReduceKernel(GroupView g, const int32_t* __restrict__ topk,
                        const float* __restrict__ weights, int32_t num_tokens,
                        int32_t num_experts, uint4* __restrict__ out,
                        int32_t* status, unsigned long long* counter) {
  constexpr int kElems = Vec16<T>::kElems;
  __shared__ int32_t s_first[kMaxK];
  __shared__ float s_w[kMaxK];
  const int op = kLowLatencyCombine;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  const int32_t num_topk = g.num_topk;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t rv = static_cast<int32_t>(row_bytes / 16);
  const char* rows = g.own + g.layout.ll_combine_rows[set];
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int32_t e = lane < num_topk ? topk[t * num_topk + lane] : -1;
      const bool valid = e >= 0 && e < num_experts;
      const unsigned same = __match_any_sync(kFullMask, e);
      if (lane < num_topk) {
        s_first[lane] = valid ? __ffs(same) - 1 : -1;
        s_w[lane] = (!kGather && valid) ? weights[t * num_topk + lane] : 0.0f;
      }
    }
    __syncthreads();
    if constexpr (kGather) {
      for (int k = 0; k < num_topk; ++k) {
        const int32_t first = s_first[k];
        uint4* dst = out + (static_cast<int64_t>(t) * num_topk + k) * rv;
        const uint4* src = reinterpret_cast<const uint4*>(
            rows +
            (static_cast<int64_t>(t) * num_topk + max(first, 0)) * row_bytes);
        for (int32_t j = threadIdx.x; j < rv; j += kWaitThreads) {
          dst[j] = first >= 0 ? __ldcg(src + j) : make_uint4(0, 0, 0, 0);
        }
      }
    } else {
      for (int32_t j = threadIdx.x; j < rv; j += kWaitThreads) {
        float acc[kElems];
#pragma unroll
        for (int i = 0; i < kElems; ++i) acc[i] = 0.0f;
        for (int k = 0; k < num_topk; ++k) {
          const int32_t first = s_first[k];
          if (first < 0) continue;
          const uint4* src = reinterpret_cast<const uint4*>(
              rows + (static_cast<int64_t>(t) * num_topk + first) * row_bytes);
          float f[kElems];
          Vec16<T>::Unpack(__ldcg(src + j), f);
          const float w = s_w[k];
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[i] = fmaf(w, f[i], acc[i]);
        }
        out[static_cast<int64_t>(t) * rv + j] = Vec16<T>::Pack(acc);
      }
    }
  }
  if (LastBlockOfGrid(counter) && threadIdx.x == 0) {
    FinishWait(g, op, seq, status);
  }
}

// ---------------------------------------------------------------------------
// One rank: the fused ops straight into their outputs. With one source the
// packed slab order (source rank, source token) is the token order, so a
// token's row for expert e goes to recv_x[e][j] at once (j as in the send:
// the tokens before it that select e); no buffer, no flags, no copy. The
// combine finds each slot's row in expert_out the same way.
// ---------------------------------------------------------------------------

// A block per (token, kLocalVecs * kSendThreads vectors of its row): decode
// sends few tokens, so the rows are spread over blocks, not the tokens alone.
// count, recv_src and num_invalid were cleared (0, -1, 0) before; the
// atomics only count (no position depends on them), in column block 0.
template <typename T, RowFormat kFormat, bool kUe8m0>
__global__ void __launch_bounds__(kSendThreads, kSendBlocksPerSm)
    DispatchLocalKernel(const uint4* __restrict__ x,
                        const int32_t* __restrict__ topk,
                        const float* __restrict__ slot_scale,
                        int32_t num_tokens, int32_t num_topk,
                        int32_t num_experts, int32_t t_max, int32_t hidden,
                        char* __restrict__ recv_x, void* __restrict__ scales,
                        int32_t* __restrict__ count,
                        int32_t* __restrict__ recv_src, int32_t* num_invalid) {
  constexpr int kElems = Vec16<T>::kElems;
  constexpr int kQ = kScaleBlock / kElems;
  constexpr bool kFp8 = kFormat != RowFormat::kPlain;
  __shared__ int32_t s_expert[kMaxK];
  __shared__ int32_t s_pos[kMaxK];
  const int32_t rv = hidden / kElems;
  const int64_t out_bytes =
      kFp8 ? hidden : static_cast<int64_t>(hidden) * sizeof(T);
  const int32_t num_scales = hidden / kScaleBlock;
  const int32_t v0 = blockIdx.x * (kSendThreads * kLocalVecs);
  const bool first_column = blockIdx.x == 0;
  int32_t invalid = 0;
  for (int32_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      const int32_t bad =
          StageExperts(topk, t, num_topk, num_experts, s_expert);
      if (threadIdx.x == 0) invalid += bad;
    }
    __syncthreads();
    StagePositions<kSendThreads>(topk, t, num_topk, s_expert, s_pos);
    __syncthreads();
    if (first_column && threadIdx.x < num_topk && s_expert[threadIdx.x] >= 0) {
      const int32_t e = s_expert[threadIdx.x];
      recv_src[static_cast<int64_t>(e) * t_max + s_pos[threadIdx.x]] =
          t * num_topk + threadIdx.x;
      atomicAdd(count + e, 1);
    }
    uint4 v[kLocalVecs];
    uint32_t q[kLocalVecs][kElems / 4];
    float scale[kLocalVecs];
    LoadRowVecs<T, kFormat, kSendThreads, kLocalVecs>(
        x + static_cast<int64_t>(t) * rv, v0, rv, v, q, scale);
    for (int k = 0; k < num_topk; ++k) {
      const int32_t e = s_expert[k];  // block-uniform
      if (e < 0) continue;
      const int64_t row = static_cast<int64_t>(e) * t_max + s_pos[k];
      char* dst = recv_x + row * out_bytes;
      float w = 1.0f;
      if (!kFp8 && slot_scale != nullptr) w = slot_scale[t * num_topk + k];
#pragma unroll
      for (int u = 0; u < kLocalVecs; ++u) {
        const int32_t j = v0 + u * kSendThreads + threadIdx.x;
        if (j >= rv) continue;
        if constexpr (kFp8) {
          if constexpr (kElems == 8) {
            reinterpret_cast<uint2*>(dst)[j] = make_uint2(q[u][0], q[u][1]);
          } else {
            reinterpret_cast<uint32_t*>(dst)[j] = q[u][0];
          }
          if (j % kQ == 0) {
            const int64_t c = row * num_scales + j / kQ;
            if constexpr (kUe8m0) {  // byte c of the row's packed int32s
              static_cast<uint8_t*>(scales)[c] = static_cast<uint8_t>(
                  (__float_as_uint(scale[u]) >> 23) & 0xffu);
            } else {
              static_cast<float*>(scales)[c] = scale[u];
            }
          }
        } else {
          uint4 out = v[u];
          if (slot_scale != nullptr) {
            float f[kElems];
            Vec16<T>::Unpack(v[u], f);
#pragma unroll
            for (int i = 0; i < kElems; ++i) f[i] *= w;
            out = Vec16<T>::Pack(f);
          }
          reinterpret_cast<uint4*>(dst)[j] = out;
        }
      }
    }
  }
  if (first_column && threadIdx.x == 0 && invalid != 0) {
    atomicAdd(num_invalid, invalid);
  }
}

// A block per (token, kWaitThreads vectors of its row), one vector per
// thread with up to kCombineSlots slots' loads in flight: out[t] = sum over k
// ascending of w[t, k] * row(t, k) in fp32 (or, with kGather, out[t, k] =
// row(t, k)), row(t, k) the expert_out row of the token's first slot naming
// the same expert.
template <typename T, bool kGather>
__global__ void __launch_bounds__(kWaitThreads)
    CombineLocalKernel(const uint4* __restrict__ expert_out,
                       const int32_t* __restrict__ topk,
                       const float* __restrict__ weights, int32_t num_tokens,
                       int32_t num_topk, int32_t num_experts, int32_t t_max,
                       int32_t hidden, uint4* __restrict__ out) {
  constexpr int kElems = Vec16<T>::kElems;
  __shared__ int32_t s_expert[kMaxK];
  __shared__ int32_t s_pos[kMaxK];
  __shared__ int64_t s_row[kMaxK];  // slot k's expert_out row, -1: none
  __shared__ float s_w[kMaxK];
  const int32_t rv = hidden / kElems;
  const int32_t j = blockIdx.x * kWaitThreads + threadIdx.x;
  for (int32_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    __syncthreads();
    if (threadIdx.x < 32) {
      StageExperts(topk, t, num_topk, num_experts, s_expert);
    }
    __syncthreads();
    StagePositions<kWaitThreads>(topk, t, num_topk, s_expert, s_pos);
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int32_t e = lane < num_topk ? topk[t * num_topk + lane] : -1;
      const bool valid = e >= 0 && e < num_experts;
      const unsigned same = __match_any_sync(kFullMask, e);
      if (lane < num_topk) {
        const int first = __ffs(same) - 1;
        s_row[lane] =
            valid ? static_cast<int64_t>(e) * t_max + s_pos[first] : -1;
        s_w[lane] = (!kGather && valid) ? weights[t * num_topk + lane] : 0.0f;
      }
    }
    __syncthreads();
    if (j >= rv) continue;
    if constexpr (kGather) {
      for (int k0 = 0; k0 < num_topk; k0 += kCombineSlots) {
        uint4 v[kCombineSlots];
#pragma unroll
        for (int u = 0; u < kCombineSlots; ++u) {
          const int k = k0 + u;
          const int64_t row = k < num_topk ? s_row[k] : -1;
          v[u] = row >= 0 ? detail::LoadVec(expert_out + row * rv + j)
                          : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kCombineSlots; ++u) {
          const int k = k0 + u;
          if (k < num_topk) {
            out[(static_cast<int64_t>(t) * num_topk + k) * rv + j] = v[u];
          }
        }
      }
    } else {
      float acc[kElems];
#pragma unroll
      for (int i = 0; i < kElems; ++i) acc[i] = 0.0f;
      for (int k0 = 0; k0 < num_topk; k0 += kCombineSlots) {
        uint4 v[kCombineSlots];
#pragma unroll
        for (int u = 0; u < kCombineSlots; ++u) {
          const int k = k0 + u;
          const int64_t row = k < num_topk ? s_row[k] : -1;
          if (row >= 0) v[u] = detail::LoadVec(expert_out + row * rv + j);
        }
#pragma unroll
        for (int u = 0; u < kCombineSlots; ++u) {  // k ascending, as the waits
          const int k = k0 + u;
          if (k >= num_topk || s_row[k] < 0) continue;
          float f[kElems];
          Vec16<T>::Unpack(v[u], f);
          const float w = s_w[k];
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[i] = fmaf(w, f[i], acc[i]);
        }
      }
      out[static_cast<int64_t>(t) * rv + j] = Vec16<T>::Pack(acc);
    }
  }
}

// (column blocks of a row, tokens): every token's row split over blocks of
// `per_block` vectors (gridDim.y is at most 65535: the kernels loop over the
// tokens past it).
dim3 RowGrid(int64_t num_tokens, int32_t row_vecs, int32_t per_block) {
  const int64_t tokens =
      num_tokens < 1 ? 1 : (num_tokens > 65535 ? 65535 : num_tokens);
  return dim3(static_cast<unsigned>((row_vecs + per_block - 1) / per_block),
              static_cast<unsigned>(tokens));
}

template <typename T>
struct LaunchDispatchLocal {
  static cudaError_t Run(const GroupView& g, RowFormat format, bool ue8m0,
                         const void* x, const int32_t* topk,
                         const float* slot_scale, int32_t num_tokens,
                         void* recv_x, void* scales, int32_t* count,
                         int32_t* recv_src, int32_t* num_invalid,
                         cudaStream_t stream) {
    const int32_t t_max = static_cast<int32_t>(g.max_tokens);
    const int32_t num_experts = g.num_local;
    const int32_t hidden = static_cast<int32_t>(g.hidden);
    const uint4* xv = static_cast<const uint4*>(x);
    char* out = static_cast<char*>(recv_x);
    const dim3 grid = RowGrid(num_tokens, hidden / Vec16<T>::kElems,
                              kSendThreads * kLocalVecs);
#define JAX_EP_DISPATCH_LOCAL(FORMAT, UE8M0, SCALE)                         \
  DispatchLocalKernel<T, FORMAT, UE8M0><<<grid, kSendThreads, 0, stream>>>( \
      xv, topk, SCALE, num_tokens, g.num_topk, num_experts, t_max, hidden,  \
      out, scales, count, recv_src, num_invalid)
    switch (format) {
      case RowFormat::kPlain:
        JAX_EP_DISPATCH_LOCAL(RowFormat::kPlain, false, slot_scale);
        break;
      case RowFormat::kFp8:
        JAX_EP_DISPATCH_LOCAL(RowFormat::kFp8, false, nullptr);
        break;
      case RowFormat::kFp8PowerOfTwo:
        if (ue8m0) {
          JAX_EP_DISPATCH_LOCAL(RowFormat::kFp8PowerOfTwo, true, nullptr);
        } else {
          JAX_EP_DISPATCH_LOCAL(RowFormat::kFp8PowerOfTwo, false, nullptr);
        }
        break;
    }
#undef JAX_EP_DISPATCH_LOCAL
    return cudaGetLastError();
  }
};

template <typename T>
struct LaunchCombineLocal {
  static cudaError_t Run(const GroupView& g, const void* expert_out,
                         const int32_t* topk, const float* weights,
                         int32_t num_tokens, bool gather, void* out,
                         cudaStream_t stream) {
    const int32_t t_max = static_cast<int32_t>(g.max_tokens);
    const int32_t hidden = static_cast<int32_t>(g.hidden);
    const uint4* eo = static_cast<const uint4*>(expert_out);
    uint4* o = static_cast<uint4*>(out);
    const dim3 grid =
        RowGrid(num_tokens, hidden / Vec16<T>::kElems, kWaitThreads);
    if (gather) {
      CombineLocalKernel<T, true><<<grid, kWaitThreads, 0, stream>>>(
          eo, topk, weights, num_tokens, g.num_topk, g.num_local, t_max, hidden,
          o);
    } else {
      CombineLocalKernel<T, false><<<grid, kWaitThreads, 0, stream>>>(
          eo, topk, weights, num_tokens, g.num_topk, g.num_local, t_max, hidden,
          o);
    }
    return cudaGetLastError();
  }
};

bool ValidView(const GroupView& g, ElementType dtype) {
  return g.low_latency != 0 && g.peers != nullptr && g.own != nullptr &&
         g.state != nullptr && g.num_ranks >= 1 && g.num_ranks <= kMaxR &&
         g.rank >= 0 && g.rank < g.num_ranks && g.num_local >= 1 &&
         g.num_local <= kMaxExperts && g.num_topk >= 1 && g.num_topk <= kMaxK &&
         g.hidden % kHiddenMultiple == 0 &&
         g.itemsize == detail::ElementBytes(dtype) &&
         g.layout.ll_row_bytes == g.hidden * g.itemsize &&
         g.num_ranks * g.max_tokens * g.num_topk <= INT32_MAX;
}

unsigned SendGrid(const GroupView& g) {
  return static_cast<unsigned>(g.num_blocks) * kSendBlocksPerSm;
}

template <typename T>
struct LaunchDispatchSend {
  static cudaError_t Run(const GroupView& g, RowFormat format, const void* x,
                         const int32_t* topk, const float* slot_scale,
                         int32_t num_tokens, int32_t* num_invalid,
                         cudaStream_t stream) {
    unsigned long long* counter =
        &g.state->blocks_done[intranode::kLowLatencyDispatchSendCounter];
    const uint4* xv = static_cast<const uint4*>(x);
    // NOTES: always the same grid per kernel (the counters rely on it).
    switch (format) {
      case RowFormat::kPlain:
        DispatchSendKernel<T, RowFormat::kPlain>
            <<<SendGrid(g), kSendThreads, 0, stream>>>(
                g, xv, topk, slot_scale, num_tokens, num_invalid, counter);
        break;
      case RowFormat::kFp8:
        DispatchSendKernel<T, RowFormat::kFp8>
            <<<SendGrid(g), kSendThreads, 0, stream>>>(
                g, xv, topk, nullptr, num_tokens, num_invalid, counter);
        break;
      case RowFormat::kFp8PowerOfTwo:
        DispatchSendKernel<T, RowFormat::kFp8PowerOfTwo>
            <<<SendGrid(g), kSendThreads, 0, stream>>>(
                g, xv, topk, nullptr, num_tokens, num_invalid, counter);
        break;
    }
    return cudaGetLastError();
  }
};

template <typename T>
struct LaunchCombineWait {
  static cudaError_t Run(const GroupView& g, const int32_t* topk,
                         const float* weights, int32_t num_tokens,
                         int32_t num_experts, bool gather, void* out,
                         int32_t* status, cudaStream_t stream) {
    CombineFlagsKernel<<<1, kMaxR, 0, stream>>>(g);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    uint4* o = static_cast<uint4*>(out);
    unsigned long long* counter =
        &g.state->blocks_done[intranode::kLowLatencyCombineReduceCounter];
    unsigned grid = 0;
    if (gather) {
      JAX_EP_CUDA_RETURN_IF_ERROR(intranode::ElementwiseGrid(
          CombineReduceKernel<T, true>, kWaitThreads,
          static_cast<int64_t>(num_tokens) * kWaitThreads, &grid));
      CombineReduceKernel<T, true><<<grid, kWaitThreads, 0, stream>>>(
          g, topk, weights, num_tokens, num_experts, o, status, counter);
    } else {
      JAX_EP_CUDA_RETURN_IF_ERROR(intranode::ElementwiseGrid(
          CombineReduceKernel<T, false>, kWaitThreads,
          static_cast<int64_t>(num_tokens) * kWaitThreads, &grid));
      CombineReduceKernel<T, false><<<grid, kWaitThreads, 0, stream>>>(
          g, topk, weights, num_tokens, num_experts, o, status, counter);
    }
    return cudaGetLastError();
  }
};

// The most local memory (bytes per thread) any kernel of this file needs, as
// the last PreloadKernels found it (must stay 0: see SpinArrival's NOTES).
size_t max_local_bytes = 0;

template <typename Kernel>
cudaError_t Load(Kernel kernel) {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  if (attr.localSizeBytes > max_local_bytes)
    max_local_bytes = attr.localSizeBytes;
  return cudaSuccess;
}

template <typename T>
struct PreloadTyped {
  static cudaError_t Run() {
    JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchSendKernel<T, RowFormat::kPlain>));
    JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchSendKernel<T, RowFormat::kFp8>));
    JAX_EP_CUDA_RETURN_IF_ERROR(
        Load(DispatchSendKernel<T, RowFormat::kFp8PowerOfTwo>));
    JAX_EP_CUDA_RETURN_IF_ERROR(Load(CombineReduceKernel<T, true>));
    JAX_EP_CUDA_RETURN_IF_ERROR(Load(CombineReduceKernel<T, false>));
    JAX_EP_CUDA_RETURN_IF_ERROR(
        Load(DispatchLocalKernel<T, RowFormat::kPlain, false>));
    JAX_EP_CUDA_RETURN_IF_ERROR(
        Load(DispatchLocalKernel<T, RowFormat::kFp8, false>));
    JAX_EP_CUDA_RETURN_IF_ERROR(
        Load(DispatchLocalKernel<T, RowFormat::kFp8PowerOfTwo, false>));
    JAX_EP_CUDA_RETURN_IF_ERROR(
        Load(DispatchLocalKernel<T, RowFormat::kFp8PowerOfTwo, true>));
    JAX_EP_CUDA_RETURN_IF_ERROR(Load(CombineLocalKernel<T, true>));
    return Load(CombineLocalKernel<T, false>);
  }
};

}  // namespace

cudaError_t DispatchSend(const GroupView& g, ElementType dtype,
                         RowFormat format, const void* x,
                         const int32_t* topk_idx, const float* slot_scale,
                         int64_t num_tokens, int32_t* num_invalid,
                         cudaStream_t stream) {
  if (!ValidView(g, dtype) || num_tokens < 0 || num_tokens > g.max_tokens ||
      (format != RowFormat::kPlain && g.hidden % kScaleBlock != 0)) {
    return cudaErrorInvalidValue;
  }
  return detail::DispatchDtype<LaunchDispatchSend>(
      dtype, g, format, x, topk_idx, slot_scale,
      static_cast<int32_t>(num_tokens), num_invalid, stream);
}

cudaError_t DispatchWait(const GroupView& g, ElementType dtype,
                         RowFormat format, bool ue8m0, void* recv_x,
                         void* scales, int32_t* count, int32_t* recv_src,
                         int32_t* status, cudaStream_t stream) {
  if (!ValidView(g, dtype) ||
      (format != RowFormat::kPlain && g.hidden % kScaleBlock != 0) ||
      (ue8m0 && (format != RowFormat::kFp8PowerOfTwo ||
                 g.hidden % (4 * kScaleBlock) != 0))) {
    return cudaErrorInvalidValue;
  }
  DispatchFlagsKernel<<<1, kFlagsThreads, 0, stream>>>(g, count);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  char* out = static_cast<char*>(recv_x);
  unsigned long long* counter =
      &g.state->blocks_done[intranode::kLowLatencyDispatchPackCounter];
  const int64_t rows =
      static_cast<int64_t>(g.num_local) * g.num_ranks * g.max_tokens;
  unsigned grid = 0;
  if (format == RowFormat::kPlain) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        intranode::ElementwiseGrid(DispatchPackKernel<RowFormat::kPlain, false>,
                                   kWaitThreads, rows * 32, &grid));
    DispatchPackKernel<RowFormat::kPlain, false>
        <<<grid, kWaitThreads, 0, stream>>>(g, out, scales, recv_src, status,
                                            counter);
  } else if (ue8m0) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        intranode::ElementwiseGrid(DispatchPackKernel<RowFormat::kFp8, true>,
                                   kWaitThreads, rows * 32, &grid));
    DispatchPackKernel<RowFormat::kFp8, true>
        <<<grid, kWaitThreads, 0, stream>>>(g, out, scales, recv_src, status,
                                            counter);
  } else {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        intranode::ElementwiseGrid(DispatchPackKernel<RowFormat::kFp8, false>,
                                   kWaitThreads, rows * 32, &grid));
    DispatchPackKernel<RowFormat::kFp8, false>
        <<<grid, kWaitThreads, 0, stream>>>(g, out, scales, recv_src, status,
                                            counter);
  }
  return cudaGetLastError();
}

cudaError_t CombineSend(const GroupView& g, ElementType dtype,
                        const void* expert_out, const int32_t* recv_src,
                        const int32_t* count, cudaStream_t stream) {
  if (!ValidView(g, dtype)) return cudaErrorInvalidValue;
  CombineSendKernel<<<SendGrid(g), kSendThreads, 0, stream>>>(
      g, static_cast<const uint4*>(expert_out), recv_src, count,
      &g.state->blocks_done[intranode::kLowLatencyCombineSendCounter]);
  return cudaGetLastError();
}

cudaError_t CombineWait(const GroupView& g, ElementType dtype,
                        const int32_t* topk_idx, const float* weights,
                        int64_t num_tokens, int64_t num_experts, bool gather,
                        void* out, int32_t* status, cudaStream_t stream) {
  if (!ValidView(g, dtype) || num_tokens < 0 || num_tokens > g.max_tokens ||
      num_experts != static_cast<int64_t>(g.num_local) * g.num_ranks) {
    return cudaErrorInvalidValue;
  }
  return detail::DispatchDtype<LaunchCombineWait>(
      dtype, g, topk_idx, weights, static_cast<int32_t>(num_tokens),
      static_cast<int32_t>(num_experts), gather, out, status, stream);
}

cudaError_t DispatchLocal(const GroupView& g, ElementType dtype,
                          RowFormat format, bool ue8m0, const void* x,
                          const int32_t* topk_idx, const float* slot_scale,
                          int64_t num_tokens, void* recv_x, void* scales,
                          int32_t* count, int32_t* recv_src,
                          int32_t* num_invalid, int32_t* status,
                          cudaStream_t stream) {
  if (!ValidView(g, dtype) || g.num_ranks != 1 || num_tokens < 0 ||
      num_tokens > g.max_tokens ||
      (format != RowFormat::kPlain && g.hidden % kScaleBlock != 0) ||
      (ue8m0 && (format != RowFormat::kFp8PowerOfTwo ||
                 g.hidden % (4 * kScaleBlock) != 0))) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(g.num_local) * g.max_tokens;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(count, 0, sizeof(int32_t) * g.num_local, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(recv_src, 0xff, sizeof(int32_t) * rows, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(num_invalid, 0, sizeof(int32_t), stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(status, 0, sizeof(int32_t), stream));
  return detail::DispatchDtype<LaunchDispatchLocal>(
      dtype, g, format, ue8m0, x, topk_idx, slot_scale,
      static_cast<int32_t>(num_tokens), recv_x, scales, count, recv_src,
      num_invalid, stream);
}

cudaError_t CombineLocal(const GroupView& g, ElementType dtype,
                         const void* expert_out, const int32_t* topk_idx,
                         const float* weights, int64_t num_tokens,
                         int64_t num_experts, bool gather, void* out,
                         int32_t* status, cudaStream_t stream) {
  if (!ValidView(g, dtype) || g.num_ranks != 1 || num_tokens < 0 ||
      num_tokens > g.max_tokens || num_experts != g.num_local) {
    return cudaErrorInvalidValue;
  }
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(status, 0, sizeof(int32_t), stream));
  return detail::DispatchDtype<LaunchCombineLocal>(
      dtype, g, expert_out, topk_idx, weights, static_cast<int32_t>(num_tokens),
      gather, out, stream);
}

cudaError_t PreloadKernels() {
  max_local_bytes = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(CombineSendKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchFlagsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(CombineFlagsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      Load(DispatchPackKernel<RowFormat::kPlain, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchPackKernel<RowFormat::kFp8, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchPackKernel<RowFormat::kFp8, true>));
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadTyped<__nv_bfloat16>::Run());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadTyped<__half>::Run());
  return PreloadTyped<float>::Run();
}

size_t MaxLocalBytes() { return max_local_bytes; }

}  // namespace jax_ep::low_latency
