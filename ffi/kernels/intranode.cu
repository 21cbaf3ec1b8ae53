// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::intranode — the intranode transport: multi-rank dispatch / combine where
// every rank's kernels write straight into the other ranks' library-owned
// buffers through a table of peer pointers (CUDA IPC or P2P, one NVLink
// domain; several processes sharing one GPU under MPS use the same path).
//
// NOTES: the protocol.
// * Buffers. Each rank owns one buffer (layout: intranode::BufferLayout in
//   ep_kernels.h). Peers write into it; only its owner reads it. Regions are
//   sized for the worst routing skew, so nothing waits for room.
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
//   share a GPU, the permute after the arrivals places the other sources'
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
//   wait kernel of a intranode op checks `aborted` and returns early (spins check
//   it each turn; the local placing kernels run on, on defined inputs);
//   FinishKernel then writes status = 1 and publishes nothing. The handler of
//   any later call reads the mailbox first and fails with its message. Never
//   a hang, never a trap.
// * Bounded grid: each send kernel always runs exactly `num_blocks` times its
//   blocks-per-SM constant of sending blocks (the group's SM budget at as
//   many blocks as its registers let one SM hold, named in its launch bounds;
//   a constant per kernel, which the monotonic counters rely on). The
//   dispatch send kernel's placing and receiving blocks take the SMs outside
//   the budget, as the permute they replace did; the receivers spin there
//   while rows are in flight, so other streams' kernels get fewer SMs during
//   a dispatch. The combine send kernel's local blocks (this rank's own
//   items, which stay in its region) take them too; they never spin. Each
//   grid is the same every call (the SM counts are the device's), as the
//   counters need.
//   The waits run in one block each: where ranks share one GPU a rank never
//   holds more than one spinning block, so they cannot starve each other of
//   SMs. The local kernels (layout, permute, reduce) do not spin.
// * Determinism: positions come from scans, reductions have a fixed order;
//   no atomic decides where data goes.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ffi/kernels/ep_kernels.h"
#include "ffi/kernels/kernel_utils.cuh"

namespace jax_ep::intranode {
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
__device__ __forceinline__ uint64_t CurrentSeq(const GroupView& g,
                                               int region) {
  return *reinterpret_cast<const volatile unsigned long long*>(
             &g.state->seq[region]) +
         1ull;
}

__device__ __forceinline__ uint64_t* ArrivalFlag(char* base,
                                                 const GroupView& g,
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
__device__ bool SpinWait(const GroupView& g, const uint64_t* flag, WaitKind what,
                         uint64_t seq, OpCode op, int region, int peer,
                         uint64_t* value) {
  const uint64_t start = GlobalTimerNs();
  const uint64_t want_seq = seq & 0xffffffffull;
  while (true) {
    const uint64_t v = LoadAcquireSys(flag);
    const bool done = what == WaitKind::kConsumed ? v + 1ull >= seq
                                                  : (v >> 32) == want_seq;
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

// Runs (one block) before every send kernel: thread d < R waits for rank d to
// have released `region` from the previous call.
// NOTES: the wait is a kernel of its own, not a prologue of the send kernel,
// so that at most one spinning block per rank exists. Ranks sharing one GPU
// (MPS) would otherwise fill the SMs with send blocks spinning on a peer whose
// release (its FinishKernel, or the reduce before it) then never gets an SM.
__global__ void __launch_bounds__(kWaitThreads)
    WaitConsumedKernel(GroupView g, OpCode op, int region) {
  const int d = threadIdx.x;
  if (d >= g.num_ranks || Aborted(g)) return;
  const uint64_t seq = CurrentSeq(g, region);
  uint64_t v = 0;
  SpinWait(g, ConsumedFlag(g.peers[d], g, region), WaitKind::kConsumed, seq,
           op, region, d, &v);
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

// ---------------------------------------------------------------------------
// Dispatch, send side.
// ---------------------------------------------------------------------------

// The send lists of a dispatch, in two kernels over (token tile, destination)
// blocks, a tile being kLayoutThreads tokens (a thread each): "t goes to d"
// when some slot of token t selects an expert of rank d.
// NOTES: over tiles, each block does one round; one block per destination
// walking every token runs R blocks of T / kLayoutThreads dependent rounds.
__device__ __forceinline__ bool TokenGoesTo(const int32_t* __restrict__ idx,
                                            int32_t num_topk,
                                            int32_t num_experts,
                                            int32_t num_local, int d) {
  bool goes = false;
  for (int k = 0; k < num_topk; ++k) {
    const int32_t e = idx[k];
    goes |= e >= 0 && e < num_experts && e / num_local == d;
  }
  return goes;
}

// Block (tile, d): dest_ids[d, t, k] = the local expert of slot (t, k) on
// rank d, -1 where it selects none of d's (the input of the per-destination
// layout), for the tile's tokens; tile_count[d, tile] = its tokens that go
// to d; blocks of d = 0 also write invalid_count[tile] (ids < -1 or >= E).
__global__ void __launch_bounds__(kLayoutThreads)
    SendCountKernel(const int32_t* __restrict__ topk_idx,
                    int32_t* __restrict__ dest_ids,
                    int32_t* __restrict__ tile_count,
                    int32_t* __restrict__ invalid_count, int32_t num_tokens,
                    int32_t num_topk, int32_t num_experts, int32_t num_local,
                    int32_t num_tiles) {
  constexpr int kWarps = kLayoutThreads / 32;
  __shared__ int32_t s_goes[kWarps];
  __shared__ int32_t s_bad[kWarps];
  const int32_t tile = blockIdx.x;
  const int d = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int32_t t = tile * kLayoutThreads + static_cast<int32_t>(threadIdx.x);
  bool goes = false;
  int32_t invalid = 0;
  if (t < num_tokens) {
    const int64_t row = static_cast<int64_t>(t) * num_topk;
    int32_t* ids_d = dest_ids + static_cast<int64_t>(d) * num_tokens * num_topk;
    for (int k = 0; k < num_topk; ++k) {
      const int32_t e = topk_idx[row + k];
      int32_t local = -1;
      if (e >= 0 && e < num_experts) {
        if (e / num_local == d) local = e - d * num_local;
      } else if (e < -1 || e >= num_experts) {
        ++invalid;
      }
      goes |= local >= 0;
      ids_d[row + k] = local;
    }
  }
  const unsigned ballot = __ballot_sync(kFullMask, goes);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    invalid += __shfl_xor_sync(kFullMask, invalid, off);
  }
  if (lane == 0) {
    s_goes[warp] = __popc(ballot);
    s_bad[warp] = invalid;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    int32_t bad = 0;
    for (int w = 0; w < kWarps; ++w) {
      total += s_goes[w];
      bad += s_bad[w];
    }
    tile_count[d * num_tiles + tile] = total;
    if (d == 0) invalid_count[tile] = bad;
  }
}

// Block (tile, d): send_pos[t, d] = exclusive scan over tokens of "t goes to
// d" (-1 for tokens that do not), from the counts of the tiles before this
// one; chunk_start[d, c] = that scan at token c * chunk_tokens (the send
// position of the first token of chunk c that goes to d). The last tile's
// blocks also write count_to[d] = the total and chunk_start[d, chunks] = it;
// block (0, 0) writes num_invalid.
__global__ void __launch_bounds__(kLayoutThreads)
    SendPosKernel(const int32_t* __restrict__ topk_idx,
                  const int32_t* __restrict__ tile_count,
                  const int32_t* __restrict__ invalid_count,
                  int32_t* __restrict__ send_pos,
                  int32_t* __restrict__ count_to,
                  int32_t* __restrict__ chunk_start,
                  int32_t* __restrict__ num_invalid, int32_t num_tokens,
                  int32_t num_topk, int32_t num_experts, int32_t num_local,
                  int32_t num_ranks, int32_t num_tiles, int32_t chunk_tokens,
                  int64_t chunk_stride) {
  constexpr int kWarps = kLayoutThreads / 32;
  __shared__ int32_t s_warp[kWarps];
  __shared__ int32_t s_before;
  const int32_t tile = blockIdx.x;
  const int d = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // The tiles before this one (a warp sums them; few: T / kLayoutThreads).
  if (warp == 0) {
    int32_t before = 0;
    for (int32_t p = lane; p < tile; p += 32) {
      before += tile_count[d * num_tiles + p];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      before += __shfl_xor_sync(kFullMask, before, off);
    }
    if (lane == 0) s_before = before;
  }
  const int32_t t = tile * kLayoutThreads + static_cast<int32_t>(threadIdx.x);
  const bool goes =
      t < num_tokens &&
      TokenGoesTo(topk_idx + static_cast<int64_t>(t) * num_topk, num_topk,
                  num_experts, num_local, d);
  const unsigned ballot = __ballot_sync(kFullMask, goes);
  if (lane == 0) s_warp[warp] = __popc(ballot);
  __syncthreads();
  int32_t offset = s_before;
  int32_t total = s_before;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int32_t c = s_warp[w];
    if (w < warp) offset += c;
    total += c;
  }
  if (t < num_tokens) {
    const int32_t before = offset + __popc(ballot & LaneMaskLt());
    send_pos[static_cast<int64_t>(t) * num_ranks + d] = goes ? before : -1;
    if (t % chunk_tokens == 0) {
      chunk_start[d * chunk_stride + t / chunk_tokens] = before;
    }
  }
  if (tile == num_tiles - 1 && threadIdx.x == 0) {
    count_to[d] = total;
    chunk_start[d * chunk_stride +
                (num_tokens + chunk_tokens - 1) / chunk_tokens] = total;
  }
  if (tile == 0 && d == 0 && threadIdx.x == 0) {
    int32_t sum = 0;
    for (int32_t p = 0; p < num_tiles; ++p) sum += invalid_count[p];
    *num_invalid = sum;
  }
}

// Notify (dispatch, one block): thread d < R waits until rank d released the
// dispatch region of the previous call, then the block writes this rank's slot
// counts for d's local experts into d's notify_counts[this rank], the send
// positions of its chunks (chunk_start[d, 0..num_chunks]) into d's
// notify_chunks[this rank], and releases d's notify flag [this rank] =
// (seq << 32 | num_chunks). The stores into d's region are ordered after the
// wait as in the send kernels (NOTES at the top); this kernel stands in for
// WaitConsumedKernel in front of the dispatch's sends.
__global__ void __launch_bounds__(kNotifyThreads)
    NotifyKernel(GroupView g, const int32_t* __restrict__ counts,
                 const int32_t* __restrict__ chunk_start, int32_t num_local,
                 int32_t num_chunks) {
  __shared__ char* s_peer[kMaxR];
  const int me = g.rank;
  const uint64_t seq = CurrentSeq(g, kDispatchRegion);
  bool failed = Aborted(g);
  if (!failed && threadIdx.x < g.num_ranks) {
    const int d = threadIdx.x;
    s_peer[d] = g.peers[d];
    uint64_t v = 0;
    failed = !SpinWait(g, ConsumedFlag(s_peer[d], g, kDispatchRegion),
                       WaitKind::kConsumed, seq, OpCode::kDispatch,
                       kDispatchRegion, d, &v);
  }
  if (__syncthreads_or(failed)) return;
  const int32_t total = g.num_ranks * num_local;
  for (int32_t q = threadIdx.x; q < total; q += kNotifyThreads) {
    const int32_t d = q / num_local;
    const int32_t l = q - d * num_local;
    reinterpret_cast<int32_t*>(s_peer[d] + g.layout.notify_counts)
        [static_cast<int64_t>(me) * kMaxExperts + l] = counts[q];
  }
  const int64_t stride = g.max_tokens + 1;
  const int32_t per_rank = num_chunks + 1;
  for (int32_t q = threadIdx.x; q < g.num_ranks * per_rank;
       q += kNotifyThreads) {
    const int32_t d = q / per_rank;
    const int32_t c = q - d * per_rank;
    reinterpret_cast<int32_t*>(s_peer[d] + g.layout.notify_chunks)
        [me * stride + c] = chunk_start[d * stride + c];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < g.num_ranks) {
    StoreReleaseSys(NotifyFlag(s_peer[threadIdx.x], g, me),
                    FlagValue(seq, num_chunks));
  }
}

// Every source's counts (one block): thread s < R waits for source s's notify
// flag and records its number of chunks in source_chunks[s]; then, with
// c[s][l] its slot count for local expert l,
//   total[l] = sum_s c[s][l]; base[l] = sum_{l' < l} total[l'] (the expert's
//   first row); group_sizes[l] = min(max(capacity - base[l], 0), total[l]);
//   num_dropped = max(sum_l total[l] - capacity, 0);
//   offset[s][l] = base[l] + sum_{s' < s} c[s'][l] - sum_{l' < l} c[s][l'].
// A slot of source s for expert l with row r in the source's own grouped order
// of the slots it sends here (dispatch_rank) lands at row offset[s][l] + r:
// experts ascending, then sources ascending, then the source's (t, k) order,
// the contract's order, which the local layout of the same entries gives.
// Whole-block results; a warp scans each source's row, a thread each column.
__global__ void __launch_bounds__(kCountsThreads)
    WaitCountsKernel(GroupView g, int32_t num_local, int64_t capacity,
                     int32_t* __restrict__ offset,
                     int32_t* __restrict__ group_sizes,
                     int32_t* __restrict__ num_dropped,
                     int32_t* __restrict__ source_chunks) {
  constexpr int kWarps = kCountsThreads / 32;
  __shared__ int32_t s_warp[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint64_t seq = CurrentSeq(g, kDispatchRegion);
  bool failed = Aborted(g);
  if (!failed && threadIdx.x < g.num_ranks) {
    const int s = threadIdx.x;
    uint64_t v = 0;
    failed = !SpinWait(g, NotifyFlag(g.own, g, s), WaitKind::kCounts, seq,
                       OpCode::kDispatch, kDispatchRegion, s, &v);
    source_chunks[s] = ClampCount(static_cast<int32_t>(v & 0xffffffffull), g);
  }
  // Outputs are garbage after an abort; the status says so.
  if (__syncthreads_or(failed)) return;
  const int32_t* counts =
      reinterpret_cast<const int32_t*>(g.own + g.layout.notify_counts);
  // offset[s][l] = -(exclusive scan of c[s][.] at l): one warp per source,
  // each lane a contiguous run of experts.
  const int32_t per_lane = (num_local + 31) / 32;
  for (int s = warp; s < g.num_ranks; s += kWarps) {
    const int32_t* c = counts + static_cast<int64_t>(s) * kMaxExperts;
    const int32_t l0 = lane * per_lane;
    const int32_t l1 = min(l0 + per_lane, num_local);
    int32_t run = 0;
    for (int32_t l = l0; l < l1; ++l) run += __ldcg(c + l);
    int32_t inclusive = run;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int32_t up = __shfl_up_sync(kFullMask, inclusive, off);
      if (lane >= off) inclusive += up;
    }
    run = inclusive - run;
    for (int32_t l = l0; l < l1; ++l) {
      offset[s * num_local + l] = -run;
      run += __ldcg(c + l);
    }
  }
  // total[l] over sources; base = exclusive scan of total (one expert per
  // thread: num_local <= kMaxExperts == kCountsThreads).
  const int l = threadIdx.x;
  int32_t total = 0;
  if (l < num_local) {
    for (int s = 0; s < g.num_ranks; ++s) {
      total += __ldcg(counts + static_cast<int64_t>(s) * kMaxExperts + l);
    }
  }
  // The scan's barrier also orders the offset stores above before the reads
  // below.
  int32_t all = 0;
  const int32_t base =
      detail::BlockExclusiveScan<kCountsThreads>(total, s_warp, &all);
  if (l < num_local) {
    const int64_t room = capacity - base > 0 ? capacity - base : 0;
    group_sizes[l] = static_cast<int32_t>(room < total ? room : total);
    int32_t prefix = base;
    for (int s = 0; s < g.num_ranks; ++s) {
      offset[s * num_local + l] += prefix;
      prefix += __ldcg(counts + static_cast<int64_t>(s) * kMaxExperts + l);
    }
  }
  if (threadIdx.x == 0) {
    *num_dropped = all > capacity ? static_cast<int32_t>(all - capacity) : 0;
  }
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
                                        const uint4* __restrict__ src,
                                        Index rv, Index send_vecs) {
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

// Copies one row (rv 16-byte vectors) from src to each of the rows s_row[0..K)
// of recv_x that are >= 0, with the whole block (kCommThreads threads), the
// row read once. Block-uniform arguments.
template <bool kPeerSource>
__device__ __forceinline__ void PlaceRow(const uint4* __restrict__ src,
                                         const int32_t* s_row, int num_topk,
                                         int32_t rv,
                                         uint4* __restrict__ recv_x) {
  // NOTES: 32-bit vector indices (ValidView bounds rv); with 64-bit ones the
  // placing roles spilled at the 64 registers of the sending role.
  for (int32_t v0 = 0; v0 < rv; v0 += kCommThreads * kSendVecs) {
    uint4 v[kSendVecs];
#pragma unroll
    for (int u = 0; u < kSendVecs; ++u) {
      const int32_t j = v0 + u * kCommThreads + threadIdx.x;
      if (j < rv) v[u] = kPeerSource ? __ldcg(src + j) : LoadVec(src + j);
    }
    for (int k = 0; k < num_topk; ++k) {
      const int32_t row = s_row[k];
      if (row < 0) continue;  // block-uniform
      uint4* dst = recv_x + static_cast<int64_t>(row) * rv;
#pragma unroll
      for (int u = 0; u < kSendVecs; ++u) {
        const int32_t j = v0 + u * kCommThreads + threadIdx.x;
        if (j < rv) StoreMaybeStreaming<true>(dst + j, v[u]);
      }
    }
  }
}

// Spins (thread 0 of the block) until *counter >= want; block-uniform result,
// false when the group aborted or the wait timed out (then recorded).
__device__ bool BlockWaitCount(const GroupView& g, const unsigned* counter,
                               unsigned want, int peer) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    const uint64_t start = GlobalTimerNs();
    int ok = 1;
    while (true) {
      unsigned v;
      asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
                   : "=r"(v)
                   : "l"(counter)
                   : "memory");
      if (v >= want) break;
      if (Aborted(g)) {
        ok = 0;
        break;
      }
      if (GlobalTimerNs() - start > static_cast<uint64_t>(g.timeout_ns)) {
        RecordTimeout(g, OpCode::kDispatch, kDispatchRegion,
                      WaitKind::kArrival, peer, CurrentSeq(g, kDispatchRegion));
        ok = 0;
        break;
      }
    }
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

// The sends of a dispatch, the placement of this rank's own tokens and, where
// every rank has a GPU of its own, the placement of the other sources' rows as
// they land: one kernel, three roles by block index.
// * Senders, blocks [0, num_senders) (the group's SM budget): items are
//   tokens t, grid-stride; chunk c = tokens [c * chunk_tokens, (c + 1) *
//   chunk_tokens), chunk_tokens a multiple of num_senders. Row t is read
//   once and written to every other rank d with send_pos[t, d] >= 0 at
//   dispatch_rows[this rank][send_pos]; for every rank d the token goes to,
//   this one included, its K local expert ids (-1 for slots of other ranks),
//   K weights and K grouped ranks (dispatch_rank, from slot_rank[d, t, k])
//   go to d's region. After its last token of chunk c, thread 0 adds the
//   block's tokens of the chunk for every other rank d to d's
//   chunk_done[this rank][c]. The last sender releases the arrival flags.
// * Placers, blocks [num_senders, num_senders + num_placers): items are
//   tokens t with slots on this rank; row t goes straight from x to
//   recv_x[offset[me][l] + slot_rank[me, t, k]] for each (rows >= capacity
//   dropped). With `receive`, they then zero the tail rows [used, capacity).
// * Receivers (only with `receive`), the remaining blocks: the other sources'
//   positions, chunk by chunk (chunks ascending, then sources), spread over
//   the receivers; a block waits until a chunk's tokens are all done
//   (chunk_done[s][c] == its positions, notify_chunks[s] gives them), then
//   places each position's row at offset[s][l] + dispatch_rank.
// Placers and senders never spin. Receivers spin only on other GPUs' senders,
// which have the lowest block indices of their kernels (see the deadlock
// NOTES at the top).
// NOTES: the placement needs every source's counts (the contract orders
// sources inside an expert), hence the notify in front of this kernel; with
// it the permute runs under the sends instead of after the arrivals. Pushes
// are evict-first stores.
__global__ void __launch_bounds__(kCommThreads, kRowsSendBlocksPerSm)
    DispatchSendKernel(GroupView g, const uint4* __restrict__ x,
                       const int32_t* __restrict__ send_pos,
                       const int32_t* __restrict__ topk_idx,
                       const float* __restrict__ topk_weights,
                       const int32_t* __restrict__ count_to,
                       const int32_t* __restrict__ slot_rank,
                       const int32_t* __restrict__ offset,
                       const int32_t* __restrict__ group_sizes,
                       const int32_t* __restrict__ source_chunks,
                       uint4* __restrict__ recv_x, int64_t capacity,
                       int32_t num_tokens, int32_t num_experts,
                       int32_t num_local, int32_t num_senders,
                       int32_t chunk_tokens, int32_t num_placers,
                       bool receive) {
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_dest[kMaxR];
  __shared__ int32_t s_pos[kMaxR];
  __shared__ int32_t s_num;
  __shared__ int32_t s_idx[kMaxK];
  __shared__ float s_w[kMaxK];
  __shared__ int32_t s_row[kMaxK];
  __shared__ int64_t s_red[kCommThreads / 32];
  if (BlockSeesAbort(g)) return;
  const int me = g.rank;
  const int32_t num_topk = g.num_topk;
  const int64_t t_max = g.max_tokens;
  const int32_t rv = static_cast<int32_t>(g.hidden * g.itemsize / 16);
  const int64_t slots = static_cast<int64_t>(num_tokens) * num_topk;
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  if (block >= num_senders + num_placers) {
    // Receiver.
    const int32_t num_receivers = gridDim.x - num_senders - num_placers;
    const int32_t q = block - num_senders - num_placers;
    const int32_t* chunks =
        reinterpret_cast<const int32_t*>(g.own + g.layout.notify_chunks);
    const unsigned* done =
        reinterpret_cast<const unsigned*>(g.own + g.layout.chunk_done);
    const int32_t* meta =
        reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_meta);
    const int32_t* ranks =
        reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_rank);
    const uint4* rows =
        reinterpret_cast<const uint4*>(g.own + g.layout.dispatch_rows);
    int64_t item = 0;  // items (positions) of the chunks before this one
    for (int32_t c = 0;; ++c) {
      bool any = false;
      for (int s = 0; s < g.num_ranks; ++s) {
        if (s == me || c >= source_chunks[s]) continue;
        any = true;
        const int32_t* start = chunks + s * (t_max + 1);
        const int32_t begin = min(max(__ldcg(start + c), 0),
                                  static_cast<int32_t>(t_max));
        const int32_t end = min(max(__ldcg(start + c + 1), begin),
                                static_cast<int32_t>(t_max));
        const int32_t n = end - begin;
        int32_t j = static_cast<int32_t>(
            (q - item % num_receivers + num_receivers) % num_receivers);
        item += n;
        if (j >= n) continue;  // block-uniform: nothing of this chunk here
        if (!BlockWaitCount(g, done + s * (t_max + 1) + c,
                            static_cast<unsigned>(n), s)) {
          return;
        }
        for (; j < n; j += num_receivers) {
          const int64_t entry = s * t_max + begin + j;
          __syncthreads();  // the previous row's readers of s_row are done
          int32_t my_row = -1;
          if (threadIdx.x < num_topk) {
            const int64_t at = entry * num_topk + threadIdx.x;
            const int32_t l = __ldcg(meta + at);
            if (l >= 0 && l < num_local) {
              my_row = CheckedRow64(
                  static_cast<int64_t>(offset[s * num_local + l]) +
                      __ldcg(ranks + at),
                  capacity);
            }
            s_row[threadIdx.x] = my_row;
          }
          if (!__syncthreads_or(my_row >= 0)) continue;  // block-uniform
          PlaceRow<true>(rows + entry * rv, s_row, num_topk, rv, recv_x);
        }
      }
      if (!any) break;  // block-uniform
    }
    return;
  }
  if (block >= num_senders) {
    // Placer.
    const int32_t* rank_me = slot_rank + me * slots;
    const int32_t* offset_me = offset + me * num_local;
    for (int32_t t = block - num_senders; t < num_tokens; t += num_placers) {
      __syncthreads();  // the previous token's readers of s_row are done
      int32_t my_row = -1;
      if (threadIdx.x < num_topk) {
        const int64_t at = static_cast<int64_t>(t) * num_topk + threadIdx.x;
        const int32_t e = topk_idx[at];
        if (e >= 0 && e < num_experts && e / num_local == me) {
          my_row = CheckedRow64(
              static_cast<int64_t>(offset_me[e - me * num_local]) +
                  rank_me[at],
              capacity);
        }
        s_row[threadIdx.x] = my_row;
      }
      if (!__syncthreads_or(my_row >= 0)) continue;  // block-uniform
      PlaceRow<false>(x + static_cast<int64_t>(t) * rv, s_row, num_topk, rv,
                      recv_x);
    }
    if (!receive) return;  // the permute after the arrivals zeroes the tail
    // Zero tail: rows [min(sum(group_sizes), capacity), capacity).
    const int64_t used = detail::UsedRows<kCommThreads>(
        group_sizes, num_local, capacity, s_red);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int64_t row = used + (block - num_senders); row < capacity;
         row += num_placers) {
      uint4* dst = recv_x + row * rv;
      for (int32_t j = threadIdx.x; j < rv; j += kCommThreads) {
        StoreMaybeStreaming<true>(dst + j, zero);
      }
    }
    return;
  }
  // Sender.
  __shared__ unsigned s_done[kMaxR];  // this chunk's tokens done per rank
  if (threadIdx.x < g.num_ranks) {
    s_peer[threadIdx.x] = g.peers[threadIdx.x];
    s_done[threadIdx.x] = 0u;
  }
  const int64_t stride = t_max + 1;
  for (int32_t t = block; t < num_tokens; t += num_senders) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      StageDestinations(send_pos, t, g, s_dest, s_pos, &s_num);
    }
    if (threadIdx.x < num_topk) {
      // A slot selects at most one rank's expert: its grouped rank is staged
      // beside its id (-1 for no expert).
      const int64_t at = static_cast<int64_t>(t) * num_topk + threadIdx.x;
      const int32_t e = topk_idx[at];
      s_idx[threadIdx.x] = e;
      s_w[threadIdx.x] = topk_weights[at];
      s_row[threadIdx.x] =
          e >= 0 && e < num_experts ? slot_rank[(e / num_local) * slots + at]
                                    : -1;
    }
    __syncthreads();
    const int32_t n = s_num;  // block-uniform
    const uint4* src = x + static_cast<int64_t>(t) * rv;
    // Block-uniform: a token kept on this rank alone (or sent nowhere) moves
    // no row.
    const int32_t send_vecs = n == 0 || (n == 1 && s_dest[0] == me) ? 0 : rv;
    PushRow</*kSkipSelf=*/true, /*kStreaming=*/true>(g, s_peer, s_dest, s_pos, n,
                                                     src, rv, send_vecs);
    for (int32_t q = threadIdx.x; q < n * num_topk; q += kCommThreads) {
      const int32_t j = q / num_topk;
      const int32_t k = q - j * num_topk;
      const int32_t d = s_dest[j];
      const int32_t e = s_idx[k];
      const bool mine = e >= 0 && e < num_experts && e / num_local == d;
      const int64_t at = (me * t_max + s_pos[j]) * num_topk + k;
      char* base = s_peer[d];
      reinterpret_cast<int32_t*>(base + g.layout.dispatch_meta)[at] =
          mine ? e - d * num_local : -1;
      reinterpret_cast<float*>(base + g.layout.dispatch_weights)[at] = s_w[k];
      reinterpret_cast<int32_t*>(base + g.layout.dispatch_rank)[at] =
          mine ? s_row[k] : -1;
    }
    if (threadIdx.x < n) s_done[s_dest[threadIdx.x]] += 1u;  // distinct d
    // This block's last token of chunk c: its tokens of the chunk are done
    // at every other rank.
    // NOTES: the barrier orders every thread's stores above before thread
    // 0's system fence, which orders them before the counts (the receiver
    // acquires them); once per chunk and block, not per token: the fence
    // waits out the block's NVLink stores, and per token it held every block
    // a round trip per token.
    const int32_t c = t / chunk_tokens;
    const int32_t next = t + num_senders;
    if (next >= num_tokens || next / chunk_tokens != c) {  // block-uniform
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();
        for (int d = 0; d < g.num_ranks; ++d) {
          const unsigned k = s_done[d];
          if (k == 0u || d == me) continue;
          atomicAdd_system(reinterpret_cast<unsigned*>(s_peer[d] +
                                                       g.layout.chunk_done) +
                               me * stride + c,
                           k);
        }
        for (int d = 0; d < g.num_ranks; ++d) s_done[d] = 0u;
      }
    }
  }
  if (!ArriveLastBlock(&g.state->blocks_done[kDispatchSendCounter],
                       num_senders)) {
    return;
  }
  // NOTES: seq is read here, not at entry: this op's FinishKernel is the
  // only writer and runs later; held across the token loop it spilled.
  const uint64_t seq = CurrentSeq(g, kDispatchRegion);
  if (threadIdx.x < g.num_ranks) {
    const int d = threadIdx.x;
    StoreReleaseSys(ArrivalFlag(s_peer[d], g, kDispatchRegion, me),
                    FlagValue(seq, count_to[d]));
  }
}

// Rows only (the cached dispatch and the combine VJP's d_out): items are
// tokens (grid-stride over a fixed grid, see LaunchRowsSend). Token t is read
// once and written to every rank d with send_pos[t, d] >= 0, this one
// included, at dispatch_rows[this rank][send_pos]. Plain stores. NOTES:
// __stcs makes ptxas spill at the 64 registers the launch bounds allow.
__global__ void __launch_bounds__(kCommThreads, kRowsSendBlocksPerSm)
    RowsSendKernel(GroupView g, const uint4* __restrict__ x,
                   const int32_t* __restrict__ send_pos, int32_t num_tokens,
                   unsigned long long* counter) {
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_dest[kMaxR];
  __shared__ int32_t s_pos[kMaxR];
  __shared__ int32_t s_num;
  const uint64_t seq = CurrentSeq(g, kDispatchRegion);
  if (BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  const int me = g.rank;
  const int64_t rv = g.hidden * g.itemsize / 16;
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      StageDestinations(send_pos, t, g, s_dest, s_pos, &s_num);
    }
    __syncthreads();
    const int32_t n = s_num;
    if (n == 0) continue;  // block-uniform
    const uint4* src = x + static_cast<int64_t>(t) * rv;
    PushRow</*kSkipSelf=*/false, /*kStreaming=*/false>(g, s_peer, s_dest, s_pos,
                                                       n, src, rv, rv);
  }
  if (!ArriveLastBlock(counter, gridDim.x)) return;
  if (threadIdx.x < g.num_ranks) {
    StoreReleaseSys(ArrivalFlag(s_peer[threadIdx.x], g, kDispatchRegion, me),
                    FlagValue(seq, 0));
  }
}

// ---------------------------------------------------------------------------
// Receive side (shared by every op).
// ---------------------------------------------------------------------------

// One block; thread s waits for source s's arrival flag of `region` in the
// own buffer. counts_out[s] (optional) = the count it carried, clamped to
// [0, T_max]; 0 when the group aborted or the wait timed out.
__global__ void __launch_bounds__(kWaitThreads)
    WaitArrivalsKernel(GroupView g, OpCode op, int region,
                       int32_t* __restrict__ counts_out) {
  const int s = threadIdx.x;
  if (s >= g.num_ranks) return;
  const uint64_t seq = CurrentSeq(g, region);
  int32_t count = 0;
  uint64_t v = 0;
  if (!Aborted(g) && SpinWait(g, ArrivalFlag(g.own, g, region, s),
                              WaitKind::kArrival, seq, op, region, s, &v)) {
    count = ClampCount(static_cast<int32_t>(v & 0xffffffffull), g);
  }
  if (counts_out != nullptr) counts_out[s] = count;
}

// Entries n = s * T_max + i, slot k: entry_row[n, k] = offset[s][l] +
// dispatch_rank (see WaitCountsKernel) for entries with i < recv_counts[s]
// whose slot selects local expert l, -1 where that row is >= capacity or there
// is none; entry_weights[n, k] = the weight that came with the entry, 0 where
// the slot is not for this rank. Also resets the chunk counters.
__global__ void EntryRowsKernel(GroupView g,
                                const int32_t* __restrict__ recv_counts,
                                const int32_t* __restrict__ offset,
                                int32_t num_local, int64_t capacity,
                                int32_t* __restrict__ entry_row,
                                float* __restrict__ entry_weights) {
  const int32_t* meta =
      reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_meta);
  const float* weights =
      reinterpret_cast<const float*>(g.own + g.layout.dispatch_weights);
  const int32_t* ranks =
      reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_rank);
  const int64_t num_topk = g.num_topk;
  const int64_t total = g.num_ranks * g.max_tokens * num_topk;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       q < total; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = q / num_topk;
    const int64_t s = n / g.max_tokens;
    const int64_t i = n - s * g.max_tokens;
    int32_t row = -1;
    float w = 0.0f;
    if (i < recv_counts[s]) {
      const int32_t l = __ldcg(meta + q);
      if (l >= 0 && l < num_local) {
        row = CheckedRow64(static_cast<int64_t>(offset[s * num_local + l]) +
                               __ldcg(ranks + q),
                           capacity);
        w = __ldcg(weights + q);
      }
    }
    entry_row[q] = row;
    entry_weights[q] = w;
  }
  // Every source's chunk counters back to 0 for the next call: this call's
  // counts all precede the arrival flags acquired before this kernel, and the
  // next call's follow the release of the region after it.
  unsigned* done = reinterpret_cast<unsigned*>(g.own + g.layout.chunk_done);
  const int64_t counters = g.num_ranks * (g.max_tokens + 1);
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       q < counters; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    done[q] = 0u;
  }
}

// Last kernel of every op: publish the release of the regions the op read
// and advance their sequence counters, unless the group aborted; status.
__global__ void FinishKernel(GroupView g, unsigned region_mask,
                             int32_t* __restrict__ status) {
  if (threadIdx.x != 0) return;
  const bool aborted = Aborted(g);
  if (!aborted) {
    for (int region = 0; region < kNumRegions; ++region) {
      if ((region_mask >> region & 1u) == 0u) continue;
      const uint64_t seq = CurrentSeq(g, region);
      StoreReleaseSys(ConsumedFlag(g.own, g, region), seq);
      g.state->seq[region] = seq;
    }
  }
  *status = aborted ? 1 : 0;
}

// ---------------------------------------------------------------------------
// Combine.
// ---------------------------------------------------------------------------

// Expert side. Items: received (s, i). partial = sum over k ascending of
// w * expert_out[entry_row[s, i, k]] (fp32, one fmaf each, rows < 0 skipped),
// written to rank s's combine_rows[this rank][i] in CombineWire<T>.
// Two roles:
// * Senders, blocks [0, num_senders) (the group's SM budget): the other
//   sources' items, whose partials cross to their ranks.
// * Local blocks, the rest of the grid: this rank's own items, whose partials
//   stay in its own region. NOTES: every item reads its slots' expert rows
//   from HBM (at R=2 the reads, not the wire, bound the send: 470 MB against
//   58 MB on the wire), so the own 1/R of the reads runs on the SMs outside
//   the budget, beside the senders, as the dispatch's placers do.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads, kCombineSendBlocksPerSm)
    CombineSendKernel(GroupView g, const uint4* __restrict__ expert_out,
                      const int32_t* __restrict__ entry_row,
                      const float* __restrict__ entry_weights,
                      const int32_t* __restrict__ recv_counts,
                      int64_t capacity, bool weighted, int32_t num_senders) {
  using Wire = typename CombineWire<T>::Type;
  constexpr int kE = Vec16<T>::kElems;
  [[maybe_unused]] constexpr int kF4 = kE / 4;  // fp32 float4s per X vector
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_start[kMaxR + 1];
  __shared__ int32_t s_row[kMaxK];
  __shared__ float s_w[kMaxK];
  __shared__ int32_t s_num;
  const uint64_t seq = CurrentSeq(g, kCombineRegion);
  if (BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  StageItemStarts(recv_counts, g, s_start);
  __syncthreads();
  const int me = g.rank;
  const int64_t t_max = g.max_tokens;
  const int32_t num_topk = g.num_topk;
  const int64_t rv = g.hidden * static_cast<int64_t>(sizeof(T)) / 16;
  const int32_t block = blockIdx.x;
  const bool sender = block < num_senders;
  for (int32_t k = sender ? block : block - num_senders;;
       k += sender ? num_senders : gridDim.x - num_senders) {
    __syncthreads();  // the previous item's readers of s_row are done
    // A sender's k-th item skips the own range; a local block's k-th is in
    // it. NOTES: the range is read from shared memory each item, not held:
    // the kernel is at its register bound (kCombineSendBlocksPerSm); held,
    // they spilled 28 bytes, and now one register is saved and restored once
    // per item, outside the row loop.
    const int32_t own_begin = s_start[me];
    const int32_t own_items = s_start[me + 1] - own_begin;
    if (k >= (sender ? s_start[g.num_ranks] - own_items : own_items)) break;
    const int32_t item =
        sender ? (k < own_begin ? k : k + own_items) : own_begin + k;
    const int s = ItemSource(s_start, item);
    const int64_t i = item - s_start[s];
    const int64_t n = s * t_max + i;
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int64_t q = n * num_topk + lane;
      const bool in_topk = lane < num_topk;
      // The weight is loaded beside the row id, not after the ballot (one
      // dependent memory latency fewer; see CombineKernel).
      const int32_t row = in_topk ? CheckedRow(entry_row[q], capacity) : -1;
      const float w = in_topk && weighted ? entry_weights[q] : 1.0f;
      const unsigned valid = __ballot_sync(kFullMask, row >= 0);
      if (row >= 0) {
        const int at = __popc(valid & LaneMaskLt());
        s_row[at] = row;
        s_w[at] = w;
      }
      if (lane == 0) s_num = __popc(valid);
    }
    __syncthreads();
    const int nv = s_num;
    char* dst_row = s_peer[s] + g.layout.combine_rows +
                    (me * t_max + i) * g.hidden * static_cast<int64_t>(
                                                     sizeof(Wire));
    for (int64_t j0 = threadIdx.x; j0 < rv;
         j0 += kCombineThreads * kCombinePasses) {
      float acc[kCombinePasses][kE];
      detail::WeightedRowSums<T, kCombineLoads, kCombinePasses>(
          expert_out, s_row, s_w, nv, rv, j0, kCombineThreads, acc);
#pragma unroll
      for (int p = 0; p < kCombinePasses; ++p) {
        const int64_t j = j0 + p * kCombineThreads;
        if (j >= rv) break;
        if constexpr (std::is_same_v<Wire, float>) {
          float4* dst = reinterpret_cast<float4*>(dst_row);
#pragma unroll
          for (int c = 0; c < kF4; ++c) {
            dst[j * kF4 + c] =
                make_float4(acc[p][4 * c], acc[p][4 * c + 1],
                            acc[p][4 * c + 2], acc[p][4 * c + 3]);
          }
        } else {
          reinterpret_cast<uint4*>(dst_row)[j] = Vec16<T>::Pack(acc[p]);
        }
      }
    }
  }
  if (!ArriveLastBlock(&g.state->blocks_done[kCombineSendCounter],
                       gridDim.x)) {
    return;
  }
  if (threadIdx.x < g.num_ranks) {
    const int s = threadIdx.x;
    StoreReleaseSys(ArrivalFlag(s_peer[s], g, kCombineRegion, me),
                    FlagValue(seq, s_start[s + 1] - s_start[s]));
  }
}

// Home side. Items: tokens. out[t] = sum over d ascending with send_pos[t, d]
// >= 0 of combine_rows[d][send_pos[t, d]] (in CombineWire<T>, widened to
// fp32; fp32 adds, rounded once); zeros
// for tokens sent nowhere.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    CombineReduceKernel(GroupView g, const int32_t* __restrict__ send_pos,
                        uint4* __restrict__ out, int32_t num_tokens) {
  constexpr int kE = Vec16<T>::kElems;
  [[maybe_unused]] constexpr int kF4 = kE / 4;
  __shared__ int32_t s_src[kMaxR];
  __shared__ int32_t s_pos[kMaxR];
  __shared__ int32_t s_num;
  // NOTES: one decision per block (the loop below has barriers): `aborted`
  // is a volatile read that a concurrent kernel of the group could flip
  // between two threads' reads.
  if (__syncthreads_or(Aborted(g))) return;  // outputs are garbage; status says so
  using Wire = typename CombineWire<T>::Type;
  // One of the two views is used, depending on the wire dtype.
  [[maybe_unused]] const float4* region =
      reinterpret_cast<const float4*>(g.own + g.layout.combine_rows);
  [[maybe_unused]] const uint4* region16 =
      reinterpret_cast<const uint4*>(g.own + g.layout.combine_rows);
  const int64_t t_max = g.max_tokens;
  [[maybe_unused]] const int64_t row_f4 = g.hidden / 4;
  const int64_t rv = g.hidden * static_cast<int64_t>(sizeof(T)) / 16;
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      StageDestinations(send_pos, t, g, s_src, s_pos, &s_num);
    }
    __syncthreads();
    const int n = s_num;
    uint4* dst = out + static_cast<int64_t>(t) * rv;
    for (int64_t j = threadIdx.x; j < rv; j += kReduceThreads) {
      float acc[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[e] = 0.0f;
      for (int q0 = 0; q0 < n; q0 += kReduceLoads) {
        if constexpr (std::is_same_v<Wire, float>) {
          float4 v[kReduceLoads][kF4];
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
              const float4* src =
                  region + (s_src[q0 + u] * t_max + s_pos[q0 + u]) * row_f4 +
                  j * kF4;
#pragma unroll
              for (int c = 0; c < kF4; ++c) v[u][c] = __ldcg(src + c);
            }
          }
          // NOTES: fixed order — ranks d ascending, one fp32 add each.
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
#pragma unroll
              for (int c = 0; c < kF4; ++c) {
                acc[4 * c] = __fadd_rn(acc[4 * c], v[u][c].x);
                acc[4 * c + 1] = __fadd_rn(acc[4 * c + 1], v[u][c].y);
                acc[4 * c + 2] = __fadd_rn(acc[4 * c + 2], v[u][c].z);
                acc[4 * c + 3] = __fadd_rn(acc[4 * c + 3], v[u][c].w);
              }
            }
          }
        } else {
          uint4 v[kReduceLoads];
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
              v[u] = __ldcg(region16 +
                            (s_src[q0 + u] * t_max + s_pos[q0 + u]) * rv + j);
            }
          }
          // NOTES: fixed order — ranks d ascending, one fp32 add each.
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
              float f[kE];
              Vec16<T>::Unpack(v[u], f);
#pragma unroll
              for (int e = 0; e < kE; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
            }
          }
        }
      }
      dst[j] = Vec16<T>::Pack(acc);
    }
  }
}

// ---------------------------------------------------------------------------
// Combine VJP: slot dots.
// ---------------------------------------------------------------------------

// Expert side. Items: received (s, i), one warp each. dots[k] = <d_out row
// received from s (dispatch_rows[s][i]), expert_out[entry_row[s, i, k]]> in
// fp32 (per lane j ascending by 32, elements in order, one fmaf each, then a
// fixed xor tree), 0 where the row is < 0; written to rank s's
// dots[this rank][i][k].
template <typename T>
__global__ void __launch_bounds__(kDotsThreads, kDotsSendBlocksPerSm)
    DotsSendKernel(GroupView g, const uint4* __restrict__ expert_out,
                   const int32_t* __restrict__ entry_row,
                   const int32_t* __restrict__ recv_counts, int64_t capacity) {
  constexpr int kE = Vec16<T>::kElems;
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_start[kMaxR + 1];
  const uint64_t seq = CurrentSeq(g, kDotsRegion);
  if (BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  StageItemStarts(recv_counts, g, s_start);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int me = g.rank;
  const int64_t t_max = g.max_tokens;
  const int32_t num_topk = g.num_topk;
  const int64_t rv = g.hidden * static_cast<int64_t>(sizeof(T)) / 16;
  const uint4* rows =
      reinterpret_cast<const uint4*>(g.own + g.layout.dispatch_rows);
  const int32_t total = s_start[g.num_ranks];
  const int32_t warps_per_block = kDotsThreads / 32;
  for (int32_t item = blockIdx.x * warps_per_block + (threadIdx.x >> 5);
       item < total; item += gridDim.x * warps_per_block) {
    const int s = ItemSource(s_start, item);
    const int64_t i = item - s_start[s];
    const int64_t n = s * t_max + i;
    const int32_t my_row =
        lane < num_topk ? CheckedRow(entry_row[n * num_topk + lane], capacity)
                        : -1;
    const uint4* grad = rows + n * rv;
    float* dst = reinterpret_cast<float*>(s_peer[s] + g.layout.dots) +
                 (me * t_max + i) * num_topk;
    for (int k0 = 0; k0 < num_topk; k0 += kDotsGroup) {
      int32_t row[kDotsGroup];
      float part[kDotsGroup];
#pragma unroll
      for (int u = 0; u < kDotsGroup; ++u) {
        row[u] = __shfl_sync(kFullMask, my_row, (k0 + u) & 31);
        if (k0 + u >= num_topk) row[u] = -1;
        part[u] = 0.0f;
      }
      for (int64_t j = lane; j < rv; j += 32) {
        const uint4 gv = __ldcg(grad + j);
        uint4 v[kDotsGroup];
#pragma unroll
        for (int u = 0; u < kDotsGroup; ++u) {
          if (row[u] >= 0) v[u] = LoadVec(expert_out + row[u] * rv + j);
        }
        float gf[kE];
        Vec16<T>::Unpack(gv, gf);
#pragma unroll
        for (int u = 0; u < kDotsGroup; ++u) {
          if (row[u] < 0) continue;
          float f[kE];
          Vec16<T>::Unpack(v[u], f);
#pragma unroll
          for (int e = 0; e < kE; ++e) part[u] = __fmaf_rn(gf[e], f[e], part[u]);
        }
      }
      float mine = 0.0f;
#pragma unroll
      for (int u = 0; u < kDotsGroup; ++u) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          part[u] += __shfl_xor_sync(kFullMask, part[u], off);
        }
        if (lane == u) mine = row[u] >= 0 ? part[u] : 0.0f;
      }
      if (lane < kDotsGroup && k0 + lane < num_topk) dst[k0 + lane] = mine;
    }
  }
  if (!ArriveLastBlock(&g.state->blocks_done[kDotsSendCounter], gridDim.x)) {
    return;
  }
  if (threadIdx.x < g.num_ranks) {
    const int s = threadIdx.x;
    StoreReleaseSys(ArrivalFlag(s_peer[s], g, kDotsRegion, me),
                    FlagValue(seq, s_start[s + 1] - s_start[s]));
  }
}

// Home side: d_weights[t, k] = dots[d][send_pos[t, d]][k] with d the rank of
// expert topk_idx[t, k]; 0 for slots that select nothing.
__global__ void WeightGradKernel(GroupView g,
                                 const int32_t* __restrict__ topk_idx,
                                 const int32_t* __restrict__ send_pos,
                                 float* __restrict__ d_weights,
                                 int32_t num_tokens, int32_t num_experts,
                                 int32_t num_local) {
  if (Aborted(g)) return;  // outputs are garbage then; status says so
  const float* dots = reinterpret_cast<const float*>(g.own + g.layout.dots);
  const int64_t num_topk = g.num_topk;
  const int64_t total = num_tokens * num_topk;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       q < total; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = q / num_topk;
    const int64_t k = q - t * num_topk;
    const int32_t e = topk_idx[q];
    float value = 0.0f;
    if (e >= 0 && e < num_experts) {
      const int64_t d = e / num_local;
      const int32_t pos = send_pos[t * g.num_ranks + d];
      if (pos >= 0 && pos < g.max_tokens) {
        value = __ldcg(dots + (d * g.max_tokens + pos) * num_topk + k);
      }
    }
    d_weights[q] = value;
  }
}

// ---------------------------------------------------------------------------
// Launch helpers.
// ---------------------------------------------------------------------------

int64_t ElementBytes(ElementType dtype) {
  return dtype == ElementType::kF32 ? 4 : 2;
}

bool ValidView(const GroupView& g, ElementType dtype) {
  return g.peers != nullptr && g.own != nullptr && g.state != nullptr &&
         g.mailbox != nullptr && g.num_ranks >= 1 && g.num_ranks <= kMaxR &&
         g.rank >= 0 && g.rank < g.num_ranks && g.num_topk >= 1 &&
         g.num_topk <= kMaxK && g.max_tokens >= 1 && g.hidden >= 1 &&
         g.hidden % kHiddenMultiple == 0 && g.num_blocks >= 1 &&
         g.itemsize == ElementBytes(dtype) &&
         g.num_ranks * g.max_tokens * g.num_topk <= INT32_MAX &&
         g.hidden * g.itemsize / 16 <= INT32_MAX;  // 32-bit vector indices
}

bool ValidTokens(const GroupView& g, int64_t num_tokens) {
  return num_tokens >= 0 && num_tokens <= g.max_tokens;
}

template <typename Kernel>
cudaError_t ElementwiseGrid(Kernel kernel, int block, int64_t num_items,
                            unsigned* grid) {
  const int64_t blocks = (num_items + block - 1) / block;
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
      kernel, block, kMaxBlocksPerSm, /*max_waves=*/2, blocks, grid));
  if (*grid == 0) *grid = 1;
  return cudaSuccess;
}

// The device's SMs outside the group's budget (as many as the budget when
// there are none), in SMs: where a send kernel's local roles run.
cudaError_t SmsOutsideBudget(const GroupView& g, int64_t* sms) {
  int num_sms = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::NumSms(&num_sms));
  *sms = num_sms > g.num_blocks ? num_sms - g.num_blocks : g.num_blocks;
  return cudaSuccess;
}

cudaError_t LaunchWait(const GroupView& g, OpCode op, int region,
                       int32_t* counts_out, cudaStream_t stream) {
  WaitArrivalsKernel<<<1, kWaitThreads, 0, stream>>>(g, op, region,
                                                     counts_out);
  return cudaGetLastError();
}

cudaError_t LaunchWaitConsumed(const GroupView& g, OpCode op, int region,
                               cudaStream_t stream) {
  WaitConsumedKernel<<<1, kWaitThreads, 0, stream>>>(g, op, region);
  return cudaGetLastError();
}

cudaError_t LaunchFinish(const GroupView& g, unsigned region_mask,
                         int32_t* status, cudaStream_t stream) {
  FinishKernel<<<1, 32, 0, stream>>>(g, region_mask, status);
  return cudaGetLastError();
}

cudaError_t LaunchRowsSend(const GroupView& g, OpCode op, const void* x,
                           const int32_t* send_pos, int64_t num_tokens,
                           cudaStream_t stream) {
  JAX_EP_CUDA_RETURN_IF_ERROR(
      LaunchWaitConsumed(g, op, kDispatchRegion, stream));
  // NOTES: always the same grid for this kernel (the counters rely on it).
  RowsSendKernel<<<g.num_blocks * kRowsSendBlocksPerSm, kCommThreads, 0,
                   stream>>>(g, static_cast<const uint4*>(x), send_pos,
                             static_cast<int32_t>(num_tokens),
                             &g.state->blocks_done[kRowsSendCounter]);
  return cudaGetLastError();
}

template <typename T>
struct CombineLaunch {
  static cudaError_t Run(const GroupView& g, const void* expert_out,
                         const int32_t* entry_row, const float* entry_weights,
                         const int32_t* recv_counts, const int32_t* send_pos,
                         int64_t num_tokens, int64_t capacity, bool weighted,
                         void* out, int32_t* status, cudaStream_t stream) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        LaunchWaitConsumed(g, OpCode::kCombine, kCombineRegion, stream));
    // NOTES: the local blocks take the SMs outside the budget, with no cap:
    // their reads compete with the senders' for HBM only while they last,
    // and the sooner they are done the sooner the senders have it to
    // themselves.
    const int32_t num_senders = g.num_blocks * kCombineSendBlocksPerSm;
    int64_t num_local = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(SmsOutsideBudget(g, &num_local));
    num_local *= kCombineSendBlocksPerSm;
    CombineSendKernel<T><<<static_cast<unsigned>(num_senders + num_local),
                           kCombineThreads, 0, stream>>>(
        g, static_cast<const uint4*>(expert_out), entry_row, entry_weights,
        recv_counts, capacity, weighted, num_senders);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    JAX_EP_CUDA_RETURN_IF_ERROR(
        LaunchWait(g, OpCode::kCombine, kCombineRegion, nullptr, stream));
    if (num_tokens > 0) {
      unsigned grid = 0;
      JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
          CombineReduceKernel<T>, kReduceThreads, kMaxBlocksPerSm, kMaxWaves,
          num_tokens, &grid));
      CombineReduceKernel<T><<<grid, kReduceThreads, 0, stream>>>(
          g, send_pos, static_cast<uint4*>(out),
          static_cast<int32_t>(num_tokens));
      JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    return LaunchFinish(g, 1u << kCombineRegion, status, stream);
  }
};

template <typename T>
struct DotsLaunch {
  static cudaError_t Run(const GroupView& g, const void* expert_out,
                         const int32_t* entry_row, const int32_t* recv_counts,
                         int64_t capacity, cudaStream_t stream) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        LaunchWaitConsumed(g, OpCode::kCombineVjp, kDotsRegion, stream));
    DotsSendKernel<T><<<g.num_blocks * kDotsSendBlocksPerSm, kDotsThreads, 0,
                        stream>>>(
        g, static_cast<const uint4*>(expert_out), entry_row, recv_counts,
        capacity);
    return cudaGetLastError();
  }
};

template <template <typename> class Launch, typename... Args>
cudaError_t DispatchDtype(ElementType dtype, Args&&... args) {
  switch (dtype) {
    case ElementType::kBF16:
      return Launch<__nv_bfloat16>::Run(args...);
    case ElementType::kF16:
      return Launch<__half>::Run(args...);
    case ElementType::kF32:
      return Launch<float>::Run(args...);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t PreloadDtype() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, CombineSendKernel<T>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, CombineReduceKernel<T>));
  return cudaFuncGetAttributes(&attr, DotsSendKernel<T>);
}

}  // namespace

cudaError_t PreloadKernels() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SendCountKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SendPosKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NotifyKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, WaitCountsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchSendKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, RowsSendKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, WaitArrivalsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, WaitConsumedKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, EntryRowsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, FinishKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, WeightGradKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDtype<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDtype<__half>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDtype<float>());
  JAX_EP_CUDA_RETURN_IF_ERROR(layout::PreloadKernels());
  return local::PreloadKernels();
}

cudaError_t Dispatch(const GroupView& g, ElementType dtype, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     int64_t num_tokens, int64_t num_experts, int64_t capacity,
                     void* recv_x, int32_t* group_sizes, int32_t* num_dropped,
                     int32_t* num_invalid, int32_t* send_pos,
                     int32_t* entry_row, float* entry_weights,
                     int32_t* recv_counts, int32_t* status, int32_t* workspace,
                     cudaStream_t stream) {
  if (!ValidView(g, dtype) || !ValidTokens(g, num_tokens) ||
      num_experts < g.num_ranks || num_experts % g.num_ranks != 0 ||
      num_experts / g.num_ranks > kMaxExperts || capacity < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_local = num_experts / g.num_ranks;
  const int64_t num_rows = g.num_ranks * g.max_tokens;  // N
  const int64_t chunk_stride = g.max_tokens + 1;
  // Workspace: see DispatchWorkspaceElems.
  int32_t* count_to = workspace;
  int32_t* layout_dropped = count_to + g.num_ranks;  // never drops (INT32_MAX)
  int32_t* layout_invalid = layout_dropped + g.num_ranks;  // counted in 1.
  int32_t* source_chunks = layout_invalid + g.num_ranks;
  int32_t* chunk_start = source_chunks + g.num_ranks;
  int32_t* dest_ids = chunk_start + g.num_ranks * chunk_stride;
  int32_t* slot_rank = dest_ids + g.num_ranks * g.max_tokens * g.num_topk;
  int32_t* dest_counts = slot_rank + g.num_ranks * g.max_tokens * g.num_topk;
  int32_t* offset = dest_counts + num_experts;
  const int64_t max_tiles = DispatchSendTiles(g.max_tokens);
  int32_t* tile_count = offset + num_experts;
  int32_t* invalid_count = tile_count + g.num_ranks * max_tiles;
  int32_t* layout_workspace = invalid_count + max_tiles;
  // NOTES: the senders' grid is the same every call (the counter relies on
  // it). A chunk holds whole rounds of it (one token per sender each), about
  // kTargetChunks chunks a call: each costs every sender a system fence, and
  // the receivers trail the last one.
  const int32_t num_senders = g.num_blocks * kRowsSendBlocksPerSm;
  const int64_t rounds = (num_tokens + num_senders - 1) / num_senders;
  const int32_t chunk_tokens = static_cast<int32_t>(
      std::max<int64_t>((rounds + kTargetChunks - 1) / kTargetChunks, 1) *
      num_senders);
  const int32_t num_chunks =
      static_cast<int32_t>((num_tokens + chunk_tokens - 1) / chunk_tokens);

  // 1. Send lists (local): send_pos, count_to, chunk starts, num_invalid, and
  //    each slot's local expert per destination.
  const int32_t num_tiles =
      static_cast<int32_t>(DispatchSendTiles(num_tokens));  // >= 1
  const dim3 tiles_by_rank(num_tiles, g.num_ranks);
  SendCountKernel<<<tiles_by_rank, kLayoutThreads, 0, stream>>>(
      topk_idx, dest_ids, tile_count, invalid_count,
      static_cast<int32_t>(num_tokens), g.num_topk,
      static_cast<int32_t>(num_experts), static_cast<int32_t>(num_local),
      num_tiles);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  SendPosKernel<<<tiles_by_rank, kLayoutThreads, 0, stream>>>(
      topk_idx, tile_count, invalid_count, send_pos, count_to, chunk_start,
      num_invalid, static_cast<int32_t>(num_tokens), g.num_topk,
      static_cast<int32_t>(num_experts), static_cast<int32_t>(num_local),
      g.num_ranks, num_tiles, chunk_tokens, chunk_stride);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 2. Per destination, the slots' rows in this rank's expert-grouped order
  //    of what it sends there, and the counts per local expert (the batched
  //    local layout, one batch element per destination, nothing dropped).
  JAX_EP_CUDA_RETURN_IF_ERROR(layout::LocalLayout(
      dest_ids, slot_rank, dest_counts, layout_dropped, layout_invalid,
      layout_workspace, /*num_batches=*/g.num_ranks, num_tokens, g.num_topk,
      num_local, /*capacity=*/INT32_MAX, stream));
  // 3. Notify: counts and chunk starts into every rank's region, once it
  //    released it.
  NotifyKernel<<<1, kNotifyThreads, 0, stream>>>(
      g, dest_counts, chunk_start, static_cast<int32_t>(num_local),
      num_chunks);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 4. Every source's counts: receive offsets, group_sizes, num_dropped.
  WaitCountsKernel<<<1, kCountsThreads, 0, stream>>>(
      g, static_cast<int32_t>(num_local), capacity, offset, group_sizes,
      num_dropped, source_chunks);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 5. Rows + meta into the other ranks' regions, then their flags; this
  //    rank's own tokens straight into recv_x meanwhile; with GPUs of their
  //    own, the other sources' rows too, chunk by chunk as they land.
  // NOTES: the placers and receivers take the SMs outside the budget (at
  // least as many as the budget), the placers 1/R of them (their share of
  // the rows), no more placers than tokens. While receiving, neither role
  // gets more blocks than the senders: the rows arrive at the senders' pace,
  // and more blocks only contend with the senders for the SMs they share.
  const bool receive = g.receive_while_sending != 0;
  int64_t others = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(SmsOutsideBudget(g, &others));
  others *= kRowsSendBlocksPerSm;
  int64_t num_placers = receive ? others / g.num_ranks : others;
  if (receive && num_placers > num_senders) num_placers = num_senders;
  if (num_placers < 1) num_placers = 1;
  const int64_t num_receivers =
      receive && g.num_ranks > 1
          ? std::min<int64_t>(others - num_placers, num_senders)
          : 0;
  if (!receive && num_placers > num_tokens) num_placers = num_tokens;
  DispatchSendKernel<<<static_cast<unsigned>(num_senders + num_placers +
                                             num_receivers),
                       kCommThreads, 0, stream>>>(
      g, static_cast<const uint4*>(x), send_pos, topk_idx, topk_weights,
      count_to, slot_rank, offset, group_sizes, source_chunks,
      static_cast<uint4*>(recv_x), capacity,
      static_cast<int32_t>(num_tokens), static_cast<int32_t>(num_experts),
      static_cast<int32_t>(num_local), num_senders, chunk_tokens,
      static_cast<int32_t>(num_placers), receive);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 6. Every source's flag: recv_counts.
  JAX_EP_CUDA_RETURN_IF_ERROR(LaunchWait(g, OpCode::kDispatch, kDispatchRegion,
                                         recv_counts, stream));
  // 7. Rows and weights of the N*K received entries; chunk counters reset.
  unsigned grid = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(ElementwiseGrid(
      EntryRowsKernel, 256, num_rows * g.num_topk, &grid));
  EntryRowsKernel<<<grid, 256, 0, stream>>>(
      g, recv_counts, offset, static_cast<int32_t>(num_local), capacity,
      entry_row, entry_weights);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 8. Without receivers: the other sources' rows from the receive buffer
  //    into recv_x, and the zero tail (the own tokens were placed in 5).
  if (!receive) {
    local::PlacedTokens placed;
    placed.begin = static_cast<int64_t>(g.rank) * g.max_tokens;
    placed.count = g.max_tokens;
    JAX_EP_CUDA_RETURN_IF_ERROR(local::Dispatch(
        dtype, g.own + g.layout.dispatch_rows, entry_row, group_sizes,
        /*slot_weights=*/nullptr, recv_x, /*num_batches=*/1, num_rows,
        g.num_topk, num_local, g.hidden, capacity, /*weighted=*/false, stream,
        /*x_from_peers=*/true, placed));
  }
  // 9. Release the region, advance seq, status.
  return LaunchFinish(g, 1u << kDispatchRegion, status, stream);
}

cudaError_t DispatchCached(const GroupView& g, ElementType dtype, const void* x,
                           const int32_t* send_pos, const int32_t* entry_row,
                           const float* entry_weights,
                           const int32_t* recv_counts,
                           const int32_t* group_sizes, int64_t num_tokens,
                           int64_t num_local_experts, int64_t capacity,
                           bool weighted, void* recv_x, int32_t* status,
                           cudaStream_t stream) {
  (void)recv_counts;  // entry_row already masks rows past each count
  if (!ValidView(g, dtype) || !ValidTokens(g, num_tokens) ||
      num_local_experts < 1 || num_local_experts > kMaxExperts ||
      capacity < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_rows = g.num_ranks * g.max_tokens;
  JAX_EP_CUDA_RETURN_IF_ERROR(LaunchRowsSend(
      g, OpCode::kDispatchCached, x, send_pos, num_tokens, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(LaunchWait(g, OpCode::kDispatchCached,
                                         kDispatchRegion, nullptr, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(local::Dispatch(
      dtype, g.own + g.layout.dispatch_rows, entry_row, group_sizes,
      entry_weights, recv_x, /*num_batches=*/1, num_rows, g.num_topk,
      num_local_experts, g.hidden, capacity, weighted, stream,
      /*x_from_peers=*/true));
  return LaunchFinish(g, 1u << kDispatchRegion, status, stream);
}

cudaError_t Combine(const GroupView& g, ElementType dtype,
                    const void* expert_out, const int32_t* entry_row,
                    const float* entry_weights, const int32_t* recv_counts,
                    const int32_t* send_pos, int64_t num_tokens,
                    int64_t capacity, bool weighted, void* out,
                    int32_t* status, cudaStream_t stream) {
  if (!ValidView(g, dtype) || !ValidTokens(g, num_tokens) || capacity < 0) {
    return cudaErrorInvalidValue;
  }
  return DispatchDtype<CombineLaunch>(dtype, g, expert_out, entry_row,
                                      entry_weights, recv_counts, send_pos,
                                      num_tokens, capacity, weighted, out,
                                      status, stream);
}

cudaError_t CombineVjp(const GroupView& g, ElementType dtype, const void* d_out,
                       const void* expert_out, const int32_t* topk_idx,
                       const int32_t* send_pos, const int32_t* entry_row,
                       const float* entry_weights, const int32_t* recv_counts,
                       const int32_t* group_sizes, int64_t num_tokens,
                       int64_t num_experts, int64_t capacity,
                       void* d_expert_out, float* d_weights, int32_t* status,
                       cudaStream_t stream) {
  if (!ValidView(g, dtype) || !ValidTokens(g, num_tokens) ||
      num_experts < g.num_ranks || num_experts % g.num_ranks != 0 ||
      num_experts / g.num_ranks > kMaxExperts || capacity < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_local = num_experts / g.num_ranks;
  const int64_t num_rows = g.num_ranks * g.max_tokens;
  // d_out rows travel like a cached dispatch (dispatch region).
  JAX_EP_CUDA_RETURN_IF_ERROR(LaunchRowsSend(
      g, OpCode::kCombineVjp, d_out, send_pos, num_tokens, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(LaunchWait(g, OpCode::kCombineVjp,
                                         kDispatchRegion, nullptr, stream));
  // d_expert_out: the weighted placement of the received d_out rows.
  JAX_EP_CUDA_RETURN_IF_ERROR(local::Dispatch(
      dtype, g.own + g.layout.dispatch_rows, entry_row, group_sizes,
      entry_weights, d_expert_out, /*num_batches=*/1, num_rows, g.num_topk,
      num_local, g.hidden, capacity, /*weighted=*/true, stream,
      /*x_from_peers=*/true));
  // Slot dots on the expert side, sent home (dots region).
  JAX_EP_CUDA_RETURN_IF_ERROR(DispatchDtype<DotsLaunch>(
      dtype, g, expert_out, entry_row, recv_counts, capacity, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      LaunchWait(g, OpCode::kCombineVjp, kDotsRegion, nullptr, stream));
  if (num_tokens > 0) {
    unsigned grid = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(ElementwiseGrid(
        WeightGradKernel, 256, num_tokens * g.num_topk, &grid));
    WeightGradKernel<<<grid, 256, 0, stream>>>(
        g, topk_idx, send_pos, d_weights, static_cast<int32_t>(num_tokens),
        static_cast<int32_t>(num_experts), static_cast<int32_t>(num_local));
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return LaunchFinish(g, (1u << kDispatchRegion) | (1u << kDotsRegion),
                      status, stream);
}

}  // namespace jax_ep::intranode
