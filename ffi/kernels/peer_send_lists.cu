// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer, the dispatch's first phase: the send lists (which tokens
// go to which rank, at which position), the notify (this rank's counts into
// every rank's buffer) and the wait for every source's counts, from which the
// receive offsets follow before any row moves (docs/intranode.md).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/kernels/peer_launch.h"
#include "ffi/kernels/peer_protocol.cuh"

namespace jax_ep::peer {
namespace {

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
__global__ void __launch_bounds__(kLayoutThreads) SendPosKernel(
    const int32_t* __restrict__ topk_idx,
    const int32_t* __restrict__ tile_count,
    const int32_t* __restrict__ invalid_count, int32_t* __restrict__ send_pos,
    int32_t* __restrict__ count_to, int32_t* __restrict__ chunk_start,
    int32_t* __restrict__ num_invalid, int32_t num_tokens, int32_t num_topk,
    int32_t num_experts, int32_t num_local, int32_t num_ranks,
    int32_t num_tiles, int32_t chunk_tokens, int64_t chunk_stride) {
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
  const bool goes = t < num_tokens &&
                    TokenGoesTo(topk_idx + static_cast<int64_t>(t) * num_topk,
                                num_topk, num_experts, num_local, d);
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
    reinterpret_cast<int32_t*>(
        s_peer[d] +
        g.layout.notify_counts)[static_cast<int64_t>(me) * kMaxExperts + l] =
        counts[q];
  }
  const int64_t stride = g.max_tokens + 1;
  const int32_t per_rank = num_chunks + 1;
  for (int32_t q = threadIdx.x; q < g.num_ranks * per_rank;
       q += kNotifyThreads) {
    const int32_t d = q / per_rank;
    const int32_t c = q - d * per_rank;
    reinterpret_cast<int32_t*>(s_peer[d] +
                               g.layout.notify_chunks)[me * stride + c] =
        chunk_start[d * stride + c];
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
// c[s][l] its slot count for local expert l and A the group's
// expert_alignment,
//   total[l] = sum_s c[s][l]; base[l] = sum_{l' < l} roundup(total[l'], A)
//   (the expert's first row, a multiple of A); group_sizes[l] =
//   min(max(capacity - base[l], 0), total[l]);
//   num_dropped = sum_l (total[l] - group_sizes[l]);
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
  const int32_t align = g.expert_alignment > 1 ? g.expert_alignment : 1;
  const int32_t padded = (total + align - 1) / align * align;
  int32_t all = 0;
  const int32_t base =
      detail::BlockExclusiveScan<kCountsThreads>(padded, s_warp, &all);
  int32_t dropped = 0;
  if (l < num_local) {
    const int64_t room = capacity - base > 0 ? capacity - base : 0;
    const int32_t kept = static_cast<int32_t>(room < total ? room : total);
    group_sizes[l] = kept;
    dropped = total - kept;
    int32_t prefix = base;
    for (int s = 0; s < g.num_ranks; ++s) {
      offset[s * num_local + l] += prefix;
      prefix += __ldcg(counts + static_cast<int64_t>(s) * kMaxExperts + l);
    }
  }
  // With alignment the padding before an expert can push its rows past the
  // capacity, so the drops are summed per expert (a second scan; its first
  // barrier orders the first scan's reads of s_warp before its writes).
  __syncthreads();
  int32_t num_drops = 0;
  detail::BlockExclusiveScan<kCountsThreads>(dropped, s_warp, &num_drops);
  if (threadIdx.x == 0) *num_dropped = num_drops;
}

}  // namespace

namespace launch {

cudaError_t LaunchSendLists(const int32_t* topk_idx, int32_t* dest_ids,
                            int32_t* tile_count, int32_t* invalid_count,
                            int32_t* send_pos, int32_t* count_to,
                            int32_t* chunk_start, int32_t* num_invalid,
                            int32_t num_tokens, int32_t num_topk,
                            int32_t num_experts, int32_t num_local,
                            int32_t num_ranks, int32_t chunk_tokens,
                            int64_t chunk_stride, cudaStream_t stream) {
  const int32_t num_tiles =
      static_cast<int32_t>(DispatchSendTiles(num_tokens));  // >= 1
  const dim3 tiles_by_rank(num_tiles, num_ranks);
  SendCountKernel<<<tiles_by_rank, kLayoutThreads, 0, stream>>>(
      topk_idx, dest_ids, tile_count, invalid_count, num_tokens, num_topk,
      num_experts, num_local, num_tiles);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  SendPosKernel<<<tiles_by_rank, kLayoutThreads, 0, stream>>>(
      topk_idx, tile_count, invalid_count, send_pos, count_to, chunk_start,
      num_invalid, num_tokens, num_topk, num_experts, num_local, num_ranks,
      num_tiles, chunk_tokens, chunk_stride);
  return cudaGetLastError();
}

cudaError_t LaunchNotify(const GroupView& g, const int32_t* dest_counts,
                         const int32_t* chunk_start, int32_t num_local,
                         int32_t num_chunks, cudaStream_t stream) {
  NotifyKernel<<<1, kNotifyThreads, 0, stream>>>(g, dest_counts, chunk_start,
                                                 num_local, num_chunks);
  return cudaGetLastError();
}

cudaError_t LaunchWaitCounts(const GroupView& g, int32_t num_local,
                             int64_t capacity, int32_t* offset,
                             int32_t* group_sizes, int32_t* num_dropped,
                             int32_t* source_chunks, cudaStream_t stream) {
  WaitCountsKernel<<<1, kCountsThreads, 0, stream>>>(
      g, num_local, capacity, offset, group_sizes, num_dropped, source_chunks);
  return cudaGetLastError();
}

cudaError_t PreloadSendListKernels() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SendCountKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SendPosKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, NotifyKernel));
  return cudaFuncGetAttributes(&attr, WaitCountsKernel);
}

}  // namespace launch
}  // namespace jax_ep::peer
