// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer, device side of the protocol: constants, flag and timeout
// helpers and the row-staging helpers shared by the peer transport's
// kernels (peer_*.cu). Multi-rank dispatch / combine where every rank's
// kernels write straight into the other ranks' library-owned buffers through
// a table of peer pointers (CUDA IPC or P2P, one NVLink domain; several
// processes sharing one GPU under MPS use the same path). The whole protocol,
// buffer by buffer and op by op: docs/intranode.md.
//
// NOTES: the protocol.
// * Buffers. Each rank owns one buffer (layout: group::BufferLayout in
//   group_buffer_layout.h). Peers write into it; only its owner reads
//   it. Regions are sized for the worst routing skew, so nothing waits for
//   room.
// * Regions and sequence numbers. Three regions (dispatch, combine, dots) are
//   reused independently. Device state `seq[region]` counts completed calls
//   that used the region; call n (0-based) of a region uses seq = n + 1. Every
//   kernel of an op reads seq from device memory; the op's last kernel
//   (FinishKernel) advances it. No per-call value is baked into a launch, so
//   an op captured in a CUDA graph replays correctly. All ranks must issue
//   the ops of one group in the same order (SPMD programs do).
// * Send. WaitConsumedKernel (one block) first waits until every destination
//   d has released the region from the previous call: d's
//   `consumed[region]` >= seq - 1 (ld.acquire.sys through the pointer table).
//   The send kernel after it writes rows / meta with ordinary stores into
//   d's region at [this rank][position]; those stores are ordered after that
//   acquire by stream order alone (the send kernel starts after the wait
//   kernel completed), as the release in FinishKernel relies on stream order
//   for the earlier kernels' reads. Each block
//   then runs __threadfence_system() in every thread, a barrier, and one
//   atomicAdd on a monotonic per-kernel "blocks done" counter in device
//   state; the block that completes a multiple of the kernel's grid is the
//   last one (no reset, no co-residency needed, graph replays keep working)
//   and writes every destination's arrival flag `arrival[region][this rank]`
//   = (seq << 32 | count) with st.release.sys.
// * Dispatch counts first (DESIGN.md's notify). NotifyKernel stands in for
//   the consumed wait: once d released the region it writes this rank's slot
//   counts per local expert of d, and the send positions of its chunks, into
//   d's region and releases d's `notify[this rank]` = (seq << 32 | chunks).
//   WaitCountsKernel (one block) acquires every source's, and derives where
//   each source's slots land (offset[s][l]) with group_sizes and
//   num_dropped, before any row moves. The sender sends each slot's row in
//   its own grouped order of what it sends d (dispatch_rank), so a slot's
//   row of recv_x is offset[s][l] + dispatch_rank: no layout pass over the
//   received entries, and rows can be placed before all of them arrived.
//   The send kernel then places this rank's own tokens from x in other
//   blocks, and where every rank has a GPU of its own with native P2P
//   atomics to every other (GroupView::receive_while_sending)
//   receiving blocks place the other sources' rows chunk by chunk: after its
//   last token of a chunk a sending block fences (thread 0, after a barrier)
//   and adds its tokens of the chunk to d's `chunk_done[this rank][chunk]`;
//   a receiving block acquires that count until it reaches the chunk's
//   positions. The op resets the counters after the arrival flags (every
//   count of the call precedes them) and before its release. Where ranks
//   share a GPU, local::Dispatch after the arrivals places the other sources'
//   rows instead (a spinning block there could hold the SMs a peer's sender
//   needs).
// * Receive. WaitArrivalsKernel spins (ld.acquire.sys) until the flag of
//   every source carries this call's seq; the kernels after it (stream order)
//   read the region with ld.global.cg (L2; the L1 / non-coherent caches never
//   hold peer-written data). The op's FinishKernel then publishes
//   `consumed[region]` = seq (st.release.sys) on the own buffer: every read
//   of the region precedes it in stream order.
// * Deadlock freedom: the only cross-rank waits are "peer's data (counts,
//   chunk, arrival) of call seq" and "peer's release of call seq - 1"; a
//   rank's release of seq - 1 depends only on calls <= seq - 1 of every rank.
//   Inside the dispatch send kernel only receiving blocks spin, on other
//   GPUs' sending blocks, which never wait and have the lowest block indices
//   of their grid. NOTES: that relies on the hardware dispatching blocks in
//   index order when a grid is not all resident (other streams hold SMs);
//   CUDA does not promise it. Were it not so, a wait would end in the
//   group's timeout error, never a hang.
// * Timeouts. Every spin gives up after the group's timeout (%globaltimer):
//   the first failing thread claims the mailbox (atomicCAS on device state),
//   writes (op, rank, peer, seq, region, what) to host-mapped memory, fences,
//   sets `state` = 1, and sets the sticky device flag `aborted`. Every send and
//   wait kernel of a group op checks `aborted` and returns early (spins
//   check it each turn; the local placing kernels run on, on defined inputs);
//   FinishKernel then writes status = 1 and publishes nothing. The handler of
//   any later call reads the mailbox first and fails with its message. Never
//   a hang, never a trap.
// * Bounded grid: each send kernel always runs exactly `num_blocks` times its
//   blocks-per-SM constant of sending blocks (the group's SM budget at as
//   many blocks as its registers let one SM hold, named in its launch bounds;
//   a constant per kernel, which the monotonic counters rely on). The
//   dispatch send kernel's placing and receiving blocks take the SMs outside
//   the budget, as the local::Dispatch they replace did; the receivers spin
//   there while rows are in flight, so other streams' kernels get fewer SMs
//   during a dispatch. The combine send kernel's local blocks (this rank's own
//   items, which stay in its region) take them too; they never spin. Each
//   grid is the same every call (the SM counts are the device's), as the
//   counters need.
//   The waits run in one block each: where ranks share one GPU a rank never
//   holds more than one spinning block, so they cannot starve each other of
//   SMs. The local kernels (layout, local::Dispatch, the reduce) do not spin.
// * Determinism: positions come from scans, reductions have a fixed order;
//   no atomic decides where data goes.

#ifndef JAX_EP_FFI_KERNELS_PEER_PROTOCOL_CUH_
#define JAX_EP_FFI_KERNELS_PEER_PROTOCOL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/peer_kernels.h"

namespace jax_ep::peer {
namespace {

using detail::kFullMask;
using detail::LaneMaskLt;
using detail::LoadVec;
using detail::StoreMaybeStreaming;
using detail::Vec16;

constexpr int kMaxR = static_cast<int>(kMaxRanks);
constexpr int kMaxK = static_cast<int>(kMaxTopk);
// NOTES: rows send holds a whole row per block (128 threads x 8 vectors covers
// H = 8192 bf16) and runs 8 blocks per budgeted SM, so 8 tokens' loads are in
// flight per SM; with fewer, larger blocks each block sits idle for a load
// latency per token and the send is latency-bound.
// __launch_bounds__ asks for those 8 blocks (64 registers, no spills with
// nvcc 13.0); combine and dots send ask for the 3 and 2 that fit theirs (see
// kCombineSendBlocksPerSm).
constexpr int kCommThreads = 128;     // rows send: a block per token
constexpr int kCombineThreads = 256;  // combine send: a block per item
constexpr int kSendVecs = 8;          // x vectors each thread holds
constexpr int kDotsThreads = 256;     // dots send: a warp per item
constexpr int kLayoutThreads =        // send lists: a token per thread
    static_cast<int>(kSendTileTokens);
constexpr int kReduceThreads = 128;   // home-side combine: a block per token
constexpr int kWaitThreads = kMaxR;   // arrival wait: a thread per source
constexpr int kNotifyThreads = 256;   // notify: a thread per rank waits
constexpr int kCountsThreads = 1024;  // counts: a thread per local expert
constexpr int kTargetChunks = 8;      // dispatch send chunks per call
constexpr int kReduceLoads = 8;       // partial rows in flight per thread
constexpr int kCombineLoads = 8;      // expert row vectors in flight per thread
constexpr int kCombinePasses = 4;     // row vectors per combine-send thread
constexpr int kDotsGroup = 8;         // slots reduced together in dots
constexpr int kMaxBlocksPerSm = 16;
// Blocks per budgeted SM of each send kernel (up to 1024 threads per SM): one
// block per SM keeps too few bytes in flight to hide the latency of peer (or,
// emulated, HBM) loads and stores.
constexpr int kRowsSendBlocksPerSm = 1024 / kCommThreads;
// NOTES: the launch bounds of the send kernels name these counts, so a grid of
// num_sms times as many blocks is resident at once on num_sms SMs' worth of
// registers. Combine send holds kCombinePasses fp32 sums and kCombineLoads
// vectors per thread (80 registers): 3 blocks of 256. Dots send needs about
// 100 registers: 2 blocks of 256. A count above what fits would spread the
// grid over more SMs than the budget.
constexpr int kCombineSendBlocksPerSm = 3;
constexpr int kDotsSendBlocksPerSm = 2;
constexpr int kMaxWaves = 8;
static_assert(kMaxR <= 64, "destinations are staged by one warp, two ballots");
static_assert(kMaxK <= 32, "slot staging uses one warp, lane k = slot k");
static_assert(kCountsThreads == kMaxExperts && kNotifyThreads >= kMaxR,
              "WaitCountsKernel: a thread per local expert; NotifyKernel: "
              "a thread per rank");
static_assert(kWaitThreads >= kMaxR && kCommThreads >= kMaxR &&
                  kCombineThreads >= kMaxR && kDotsThreads >= kMaxR,
              "a thread per rank in the prologues / epilogues");

// The dtype combine's partial sums travel home in. NOTES: bf16 activations
// send bf16 partials (each rounded once on the expert side, then summed in
// fp32 in rank order at home, DeepEP's wire): half the wire bytes of fp32,
// which on the emulated R=8 run alone capped combine at 0.30 of the copy
// bound. The cost is one extra bf16 rounding per partial: an absolute error
// up to about 2^-8 * sum_r |partial_r| (unbounded relative error where the
// partials cancel), against the reference's fp32 partials. f16 and f32 keep
// fp32 partials.
template <typename T>
struct CombineWire {
  using Type = float;
};
template <>
struct CombineWire<__nv_bfloat16> {
  using Type = __nv_bfloat16;
};

// ---------------------------------------------------------------------------
// Memory-model helpers.
// ---------------------------------------------------------------------------

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];"
               : "=l"(v)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v)
               : "memory");
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool Aborted(const GroupView& g) {
  return *reinterpret_cast<const volatile unsigned int*>(&g.state->aborted) !=
         0u;
}

// seq of the current call of `region` (FinishKernel advances the counter).
__device__ __forceinline__ uint64_t CurrentSeq(const GroupView& g, int region) {
  return *reinterpret_cast<const volatile unsigned long long*>(
             &g.state->seq[region]) +
         1ull;
}

__device__ __forceinline__ uint64_t* ArrivalFlag(char* base, const GroupView& g,
                                                 int region, int src) {
  return reinterpret_cast<uint64_t*>(base + g.layout.flags) +
         static_cast<int64_t>(region) * g.num_ranks + src;
}

__device__ __forceinline__ uint64_t* ConsumedFlag(char* base,
                                                  const GroupView& g,
                                                  int region) {
  return reinterpret_cast<uint64_t*>(base + g.layout.flags) +
         static_cast<int64_t>(kNumRegions) * g.num_ranks + region;
}

// Source src's dispatch counts of the current call (its seq << 32).
__device__ __forceinline__ uint64_t* NotifyFlag(char* base, const GroupView& g,
                                                int src) {
  return reinterpret_cast<uint64_t*>(base + g.layout.flags) +
         static_cast<int64_t>(kNumRegions) * (g.num_ranks + 1) + src;
}

__device__ __forceinline__ uint64_t FlagValue(uint64_t seq, int32_t count) {
  return (seq << 32) | static_cast<uint32_t>(count);
}

__device__ __forceinline__ int32_t ClampCount(int32_t count,
                                              const GroupView& g) {
  return min(max(count, 0), static_cast<int32_t>(g.max_tokens));
}

// First timeout of the group: fill the mailbox once, then abort every later
// kernel of the group.
__device__ void RecordTimeout(const GroupView& g, OpCode op, int region,
                              WaitKind what, int peer, uint64_t seq) {
  if (atomicCAS(&g.state->error_claimed, 0u, 1u) == 0u) {
    volatile Mailbox* m = g.mailbox;
    m->op = static_cast<int32_t>(op);
    m->rank = g.rank;
    m->peer = peer;
    m->wait_kind = static_cast<int32_t>(what);
    m->region = region;
    m->seq = seq;
    __threadfence_system();  // fields before state
    m->state = 1u;
  }
  atomicExch(&g.state->aborted, 1u);
  __threadfence_system();
}

// Spins until *flag (acquire, system scope) satisfies the wait: for kArrival
// and kCounts its seq field equals `seq`, for kConsumed its value is
// >= seq - 1. Returns false when the group aborted or the wait timed out
// (then recorded).
__device__ bool SpinWait(const GroupView& g, const uint64_t* flag,
                         WaitKind what, uint64_t seq, OpCode op, int region,
                         int peer, uint64_t* value) {
  const uint64_t start = GlobalTimerNs();
  const uint64_t want_seq = seq & 0xffffffffull;
  while (true) {
    const uint64_t v = LoadAcquireSys(flag);
    const bool done =
        what == WaitKind::kConsumed ? v + 1ull >= seq : (v >> 32) == want_seq;
    if (done) {
      *value = v;
      return true;
    }
    if (Aborted(g)) return false;
    if (GlobalTimerNs() - start > static_cast<uint64_t>(g.timeout_ns)) {
      RecordTimeout(g, op, region, what, peer, seq);
      return false;
    }
  }
}

// Send-kernel prologue: true (block-uniform) when the group aborted (then
// the kernel returns and its op's FinishKernel reports the failure).
__device__ __forceinline__ bool BlockSeesAbort(const GroupView& g) {
  return __syncthreads_or(Aborted(g)) != 0;
}

// Send-kernel epilogue, called once by every one of the kernel's `num_blocks`
// sending blocks after its last store to a peer. Returns true (block-uniform)
// in the block that arrives last.
// NOTES: every thread fences its own peer stores at system scope before the
// barrier, so thread 0's atomic is ordered after all of the block's stores;
// the last block fences again before any thread releases a flag.
__device__ bool ArriveLastBlock(unsigned long long* counter,
                                unsigned num_blocks) {
  __shared__ int s_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long old = atomicAdd(counter, 1ull);
    const bool last = (old + 1ull) % num_blocks == 0ull;
    if (last) __threadfence_system();
    s_last = last ? 1 : 0;
  }
  __syncthreads();
  return s_last != 0;
}

// Warp 0 stages the destinations of token t (send_pos[t, d] >= 0) in d
// ascending order: s_dest[j], s_pos[j], *s_num. Must be called by the whole
// warp 0 (two full-warp ballots cover R <= 64).
__device__ __forceinline__ void StageDestinations(
    const int32_t* __restrict__ send_pos, int64_t t, const GroupView& g,
    int32_t* s_dest, int32_t* s_pos, int32_t* s_num) {
  const int lane = threadIdx.x & 31;
  int32_t n = 0;
  for (int d0 = 0; d0 < g.num_ranks; d0 += 32) {
    const int d = d0 + lane;
    int32_t pos = d < g.num_ranks ? send_pos[t * g.num_ranks + d] : -1;
    if (pos >= g.max_tokens) pos = -1;  // a corrupt position never escapes
    const unsigned ballot = __ballot_sync(kFullMask, pos >= 0);
    if (pos >= 0) {
      const int32_t at = n + __popc(ballot & LaneMaskLt());
      s_dest[at] = d;
      s_pos[at] = pos;
    }
    n += __popc(ballot);
  }
  if (lane == 0) *s_num = n;
}

// Received items (s, i), i < recv_counts[s], enumerated source-major:
// s_start[s] = items of sources < s (counts clamped to [0, T_max]).
__device__ __forceinline__ void StageItemStarts(
    const int32_t* __restrict__ recv_counts, const GroupView& g,
    int32_t* s_start) {
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int s = 0; s < g.num_ranks; ++s) {
      s_start[s] = run;
      run += ClampCount(recv_counts[s], g);
    }
    s_start[g.num_ranks] = run;
  }
}

__device__ __forceinline__ int ItemSource(const int32_t* s_start,
                                          int32_t item) {
  int s = 0;
  while (item >= s_start[s + 1]) ++s;
  return s;
}

__device__ __forceinline__ int32_t CheckedRow(int32_t row, int64_t capacity) {
  return (row >= 0 && row < capacity) ? row : -1;
}

// CheckedRow of a row computed in 64 bits (offset plus a rank that came from
// another GPU: a corrupt one can never make an out-of-range row).
__device__ __forceinline__ int32_t CheckedRow64(int64_t row, int64_t capacity) {
  return row >= 0 && row < capacity ? static_cast<int32_t>(row) : -1;
}

// Pushes one token's row `src` (rv vectors, read once by the whole block) to
// dispatch_rows[this rank][s_pos[q]] of every rank s_dest[q], q < n, the
// first send_vecs vectors of it; kSkipSelf leaves this rank out, kStreaming
// stores evict-first. Index is the vector index type (32 bits where the
// caller's registers need it). Block-uniform arguments.
template <bool kSkipSelf, bool kStreaming, typename Index>
__device__ __forceinline__ void PushRow(const GroupView& g, char* const* s_peer,
                                        const int32_t* s_dest,
                                        const int32_t* s_pos, int32_t n,
                                        const uint4* __restrict__ src, Index rv,
                                        Index send_vecs) {
  const int me = g.rank;
  const int64_t t_max = g.max_tokens;
  for (Index v0 = 0; v0 < send_vecs; v0 += kCommThreads * kSendVecs) {
    uint4 v[kSendVecs];
#pragma unroll
    for (int u = 0; u < kSendVecs; ++u) {
      const Index j = v0 + u * kCommThreads + threadIdx.x;
      if (j < rv) v[u] = LoadVec(src + j);
    }
    for (int32_t q = 0; q < n; ++q) {
      if (kSkipSelf && s_dest[q] == me) continue;  // block-uniform
      uint4* dst =
          reinterpret_cast<uint4*>(s_peer[s_dest[q]] + g.layout.dispatch_rows) +
          (me * t_max + s_pos[q]) * rv;
#pragma unroll
      for (int u = 0; u < kSendVecs; ++u) {
        const Index j = v0 + u * kCommThreads + threadIdx.x;
        if (j < rv) StoreMaybeStreaming<kStreaming>(dst + j, v[u]);
      }
    }
  }
}

// A grid of at most two resident waves for an elementwise kernel of
// `num_items` items at `block` threads (at least one block).
template <typename Kernel>
cudaError_t ElementwiseGrid(Kernel kernel, int block, int64_t num_items,
                            unsigned* grid) {
  const int64_t blocks = (num_items + block - 1) / block;
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
      kernel, block, kMaxBlocksPerSm, /*max_waves=*/2, blocks, grid));
  if (*grid == 0) *grid = 1;
  return cudaSuccess;
}

}  // namespace
}  // namespace jax_ep::peer

#endif  // JAX_EP_FFI_KERNELS_PEER_PROTOCOL_CUH_
