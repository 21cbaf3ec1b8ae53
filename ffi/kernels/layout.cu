// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::layout — slot -> row assignment of the expert-grouped buffer.
//
// One pass over `topk_idx`, no sort. When the slots fit one chunk (decode-
// sized T * K) a single launch of AssignRowsKernel<true> does everything in one
// block per batch element (at decode sizes the gaps between launches would
// be a large part of the dispatch). Otherwise three small launches per call:
//   1. ChunkHistogramKernel: per chunk of consecutive (t, k) slots, a shared-
//      memory histogram over experts (column E counts invalid ids), written to
//      workspace `counts[chunk, E + 1]`.
//   2. ChunkScanKernel: per expert, an exclusive scan of the counts over
//      chunks (in place) and the expert's total into workspace `totals[E + 1]`.
//   3. AssignRowsKernel: per chunk, expert bases (exclusive scan of totals,
//      each rounded up to a multiple of expert_alignment) plus the chunk's
//      offset, then each warp walks its slice of the chunk in
//      (t, k) order, ranking equal experts with __match_any_sync and advancing
//      warp-private running counters. The chunk-0 block of each batch element
//      also writes group_sizes / num_dropped / num_invalid.
// Every count is an integer, so the shared-memory atomics of step 1 cannot
// change a result: the output is bit-identical run to run.

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/layout_kernels.h"

namespace jax_ep::layout {
namespace {

using detail::kFullMask;
using detail::LaneMaskLt;

constexpr int kBlock = static_cast<int>(kThreads);
constexpr int kNumWarps = static_cast<int>(kWarps);
constexpr int kMaxE = static_cast<int>(kMaxExperts);
constexpr int kScanRows = kNumWarps;  // chunk groups in kernel 2
constexpr int kScanItemsPerThread = kMaxE / kBlock;
static_assert(kMaxE % kBlock == 0, "expert scan assumes E <= 4 * kBlock");
static_assert(kMinChunkSlots % kThreads == 0, "chunk must fill every warp");

struct LayoutDims {
  int64_t num_batches;
  int32_t num_slots;         // T * K of one batch element
  int32_t chunk_slots;       // slots per chunk, multiple of kBlock
  int32_t num_chunks;        // ceil(num_slots / chunk_slots), may be 0
  int32_t num_experts;       // E
  int32_t capacity;          // clamped to int32: rows never exceed T * K
  int32_t alignment;         // expert_alignment: each expert's first row is
                             // a multiple of it
  int64_t workspace_stride;  // workspace elements per batch element
};

__device__ __forceinline__ bool IsValidExpert(int32_t e, int32_t num_experts) {
  return e >= 0 && e < num_experts;
}

__device__ __forceinline__ bool IsInvalidId(int32_t e, int32_t num_experts) {
  return e < -1 || e >= num_experts;
}

__global__ void __launch_bounds__(kBlock)
    ChunkHistogramKernel(const int32_t* __restrict__ topk_idx,
                         int32_t* __restrict__ workspace, LayoutDims d) {
  __shared__ int32_t s_hist[kMaxE + 1];
  const int lane = threadIdx.x & 31;
  const int num_cols = d.num_experts + 1;
  const int64_t num_items = d.num_batches * d.num_chunks;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int64_t b = item / d.num_chunks;
    const int32_t c = static_cast<int32_t>(item % d.num_chunks);
    __syncthreads();  // the previous item's readers of s_hist are done
    for (int e = threadIdx.x; e < num_cols; e += kBlock) s_hist[e] = 0;
    __syncthreads();
    const int32_t* idx = topk_idx + b * d.num_slots;
    const int32_t begin = c * d.chunk_slots;
    const int32_t end = min(begin + d.chunk_slots, d.num_slots);
    // NOTES: the loop bound is block-uniform so every lane reaches the
    // warp-synchronous intrinsics.
    for (int32_t base = begin; base < end; base += kBlock) {
      const int32_t s = base + static_cast<int32_t>(threadIdx.x);
      const int32_t e = s < end ? idx[s] : -1;
      const bool valid = IsValidExpert(e, d.num_experts);
      const unsigned peers = __match_any_sync(kFullMask, valid ? e : -1);
      if (valid && lane == __ffs(peers) - 1) {
        atomicAdd(&s_hist[e], __popc(peers));
      }
      const unsigned bad =
          __ballot_sync(kFullMask, IsInvalidId(e, d.num_experts));
      if (lane == 0 && bad != 0) {
        atomicAdd(&s_hist[d.num_experts], __popc(bad));
      }
    }
    __syncthreads();
    int32_t* counts =
        workspace + b * d.workspace_stride + static_cast<int64_t>(c) * num_cols;
    for (int e = threadIdx.x; e < num_cols; e += kBlock) counts[e] = s_hist[e];
  }
}

// Block = 32 columns (experts) x kScanRows chunk groups. Column x of the tile
// is scanned by kScanRows threads, each over a contiguous range of chunks.
__global__ void __launch_bounds__(kBlock)
    ChunkScanKernel(int32_t* __restrict__ workspace, LayoutDims d) {
  __shared__ int32_t s_part[kScanRows][32];
  const int x = threadIdx.x & 31;
  const int y = threadIdx.x >> 5;
  const int num_cols = d.num_experts + 1;
  const int num_tiles = (num_cols + 31) / 32;
  const int32_t per_row = (d.num_chunks + kScanRows - 1) / kScanRows;
  const int32_t c_begin = min(y * per_row, d.num_chunks);
  const int32_t c_end = min(c_begin + per_row, d.num_chunks);
  const int64_t num_items = d.num_batches * num_tiles;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int64_t b = item / num_tiles;
    const int col = static_cast<int>(item % num_tiles) * 32 + x;
    const bool active = col < num_cols;
    int32_t* counts = workspace + b * d.workspace_stride;
    int32_t sum = 0;
    if (active) {
#pragma unroll 8
      for (int32_t c = c_begin; c < c_end; ++c) {
        sum += counts[static_cast<int64_t>(c) * num_cols + col];
      }
    }
    __syncthreads();  // the previous item's readers of s_part are done
    s_part[y][x] = sum;
    __syncthreads();
    int32_t run = 0;
    for (int r = 0; r < y; ++r) run += s_part[r][x];
    if (active) {
#pragma unroll 8
      for (int32_t c = c_begin; c < c_end; ++c) {
        const int64_t i = static_cast<int64_t>(c) * num_cols + col;
        const int32_t v = counts[i];
        counts[i] = run;
        run += v;
      }
      if (y == kScanRows - 1) {
        counts[static_cast<int64_t>(d.num_chunks) * num_cols + col] = run;
      }
    }
  }
}

// s_base[e] = sum over e' < e of totals[e'] rounded up to a multiple of
// `alignment`, for e in [0, E] (each expert's first row; s_base[E] is where
// the rows end, the last expert's padding included).
__device__ __forceinline__ void ExpertBases(const int32_t* __restrict__ totals,
                                            int32_t num_experts,
                                            int32_t alignment, int32_t* s_base,
                                            int32_t* s_warp) {
  int32_t v[kScanItemsPerThread];
  int32_t thread_sum = 0;
#pragma unroll
  for (int i = 0; i < kScanItemsPerThread; ++i) {
    const int e = threadIdx.x * kScanItemsPerThread + i;
    v[i] = e < num_experts ? totals[e] : 0;
    if (alignment > 1) v[i] = (v[i] + alignment - 1) / alignment * alignment;
    thread_sum += v[i];
  }
  int32_t all = 0;
  int32_t run = detail::BlockExclusiveScan<kBlock>(thread_sum, s_warp, &all);
#pragma unroll
  for (int i = 0; i < kScanItemsPerThread; ++i) {
    const int e = threadIdx.x * kScanItemsPerThread + i;
    if (e < num_experts) s_base[e] = run;
    run += v[i];
  }
  if (threadIdx.x == 0) s_base[num_experts] = all;
}

// Step 2 of AssignRowsKernel for 32 consecutive slots of one warp (expert ids
// `e`, -1 past the end): add them to the warp's histogram; with kCountInvalid,
// returns how many of them are invalid ids (same value in every lane).
template <bool kCountInvalid>
__device__ __forceinline__ int CountSlots(int32_t e, int32_t num_experts,
                                          int32_t* warp_hist) {
  const int lane = threadIdx.x & 31;
  const bool valid = IsValidExpert(e, num_experts);
  const unsigned peers = __match_any_sync(kFullMask, valid ? e : -1);
  if (valid && lane == __ffs(peers) - 1) warp_hist[e] += __popc(peers);
  int bad = 0;
  if constexpr (kCountInvalid) {
    bad = __popc(__ballot_sync(kFullMask, IsInvalidId(e, num_experts)));
  }
  __syncwarp();
  return bad;
}

// Step 4 for 32 consecutive slots: the row of each (ranked by lane among equal
// experts; the lowest lane advances the warp's counter), -1 if none.
__device__ __forceinline__ int32_t AssignSlots(int32_t e, int32_t num_experts,
                                               int32_t* warp_next) {
  const int lane = threadIdx.x & 31;
  const bool valid = IsValidExpert(e, num_experts);
  const unsigned peers = __match_any_sync(kFullMask, valid ? e : -1);
  int32_t row = -1;
  if (valid) row = warp_next[e] + __popc(peers & LaneMaskLt());
  __syncwarp();
  if (valid && lane == __ffs(peers) - 1) warp_next[e] += __popc(peers);
  __syncwarp();
  return row;
}

// Ids per lane when a single chunk (at most kMinChunkSlots slots) is split
// over the block's warps.
constexpr int kSingleChunkLaneIds = static_cast<int>(kMinChunkSlots) / kBlock;

// kSingleChunk: the batch element's slots are one chunk (num_chunks <= 1) and
// this block does the whole layout alone: the expert totals are the sums of
// its own warp histograms (step 2), so kernels 1 and 2 are not launched and
// the workspace is not touched.
template <bool kSingleChunk>
__global__ void __launch_bounds__(kBlock)
    AssignRowsKernel(const int32_t* __restrict__ topk_idx,
                     int32_t* __restrict__ slot_row,
                     int32_t* __restrict__ group_sizes,
                     int32_t* __restrict__ num_dropped,
                     int32_t* __restrict__ num_invalid,
                     const int32_t* __restrict__ workspace, LayoutDims d) {
  // s_next[w][e]: next row warp w gives to expert e (a count before step 3).
  __shared__ int32_t s_next[kNumWarps][kMaxE];
  __shared__ int32_t s_base[kMaxE + 1];
  __shared__ int32_t s_scan[kNumWarps];
  // kSingleChunk only: expert totals [0, E), the invalid count at [E];
  // per-warp invalid counts.
  __shared__ int32_t s_total[kSingleChunk ? kMaxE + 1 : 1];
  __shared__ int32_t s_invalid[kSingleChunk ? kNumWarps : 1];
  __shared__ int32_t s_dropped;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int32_t num_experts = d.num_experts;
  const int num_cols = num_experts + 1;
  const int32_t grid_chunks = max(d.num_chunks, 1);  // chunk 0 always runs
  const int32_t warp_slots = d.chunk_slots / kNumWarps;
  const int64_t num_items = d.num_batches * grid_chunks;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int64_t b = item / grid_chunks;
    const int32_t c = static_cast<int32_t>(item % grid_chunks);
    const int32_t* counts = workspace + b * d.workspace_stride;
    const int32_t* idx = topk_idx + b * d.num_slots;
    int32_t* rows = slot_row + b * d.num_slots;
    const int32_t begin = c * d.chunk_slots + warp * warp_slots;
    const int32_t end = min(begin + warp_slots, d.num_slots);
    const int32_t* totals;
    __syncthreads();  // the previous item's readers of shared memory are done
    for (int i = threadIdx.x; i < kNumWarps * num_experts; i += kBlock) {
      s_next[i / num_experts][i % num_experts] = 0;
    }
    __syncthreads();

    // Step 2: warp-private histogram of this warp's slice. The single-chunk
    // block loads its ids once, all at the same time (one load latency, not
    // one per 32 slots), and also counts the invalid ones.
    [[maybe_unused]] int32_t ids[kSingleChunk ? kSingleChunkLaneIds : 1];
    if constexpr (kSingleChunk) {
#pragma unroll
      for (int u = 0; u < kSingleChunkLaneIds; ++u) {
        const int32_t s = begin + u * 32 + lane;
        ids[u] = s < end ? idx[s] : -1;
      }
      int bad = 0;
#pragma unroll
      for (int u = 0; u < kSingleChunkLaneIds; ++u) {
        bad += CountSlots<true>(ids[u], num_experts, s_next[warp]);
      }
      if (lane == 0) s_invalid[warp] = bad;
      __syncthreads();
      for (int e = threadIdx.x; e < num_cols; e += kBlock) {
        int32_t sum = 0;
#pragma unroll
        for (int w = 0; w < kNumWarps; ++w) {
          sum += e < num_experts ? s_next[w][e] : s_invalid[w];
        }
        s_total[e] = sum;
      }
      __syncthreads();
      totals = s_total;
    } else {
      for (int32_t base = begin; base < end; base += 32) {
        const int32_t s = base + lane;
        CountSlots<false>(s < end ? idx[s] : -1, num_experts, s_next[warp]);
      }
      totals = counts + static_cast<int64_t>(d.num_chunks) * num_cols;
    }
    ExpertBases(totals, num_experts, d.alignment, s_base, s_scan);
    if (threadIdx.x == 0) s_dropped = 0;
    __syncthreads();

    if (c == 0) {  // block-uniform
      // Row j of expert e is s_base[e] + j; the rows at or past the capacity
      // drop (with alignment, the padding before an expert can push its rows
      // there, so the drops are summed per expert).
      int32_t dropped = 0;
      for (int e = threadIdx.x; e < num_experts; e += kBlock) {
        const int32_t room = max(d.capacity - s_base[e], 0);
        const int32_t kept = min(room, totals[e]);
        group_sizes[b * num_experts + e] = kept;
        dropped += totals[e] - kept;
      }
      if (dropped != 0) atomicAdd(&s_dropped, dropped);  // integer: exact
      __syncthreads();
      if (threadIdx.x == 0) {
        num_dropped[b] = s_dropped;
        num_invalid[b] = totals[num_experts];
      }
    }
    if (c >= d.num_chunks) continue;  // block-uniform (T * K == 0)

    // Step 3: counts -> first row of each (warp, expert):
    // expert base + this chunk's offset + the earlier warps of this chunk.
    for (int e = threadIdx.x; e < num_experts; e += kBlock) {
      int32_t run = s_base[e];
      if constexpr (!kSingleChunk) {
        run += counts[static_cast<int64_t>(c) * num_cols + e];
      }
#pragma unroll
      for (int w = 0; w < kNumWarps; ++w) {
        const int32_t n = s_next[w][e];
        s_next[w][e] = run;
        run += n;
      }
    }
    __syncthreads();

    // Step 4: rows in (t, k) order.
    if constexpr (kSingleChunk) {
#pragma unroll
      for (int u = 0; u < kSingleChunkLaneIds; ++u) {
        const int32_t s = begin + u * 32 + lane;
        const int32_t row = AssignSlots(ids[u], num_experts, s_next[warp]);
        if (s < end) rows[s] = row < d.capacity ? row : -1;
      }
    } else {
      for (int32_t base = begin; base < end; base += 32) {
        const int32_t s = base + lane;
        const int32_t e = s < end ? idx[s] : -1;
        const int32_t row = AssignSlots(e, num_experts, s_next[warp]);
        if (s < end) rows[s] = row < d.capacity ? row : -1;
      }
    }
  }
}

}  // namespace

cudaError_t LocalLayout(const int32_t* topk_idx, int32_t* slot_row,
                        int32_t* group_sizes, int32_t* num_dropped,
                        int32_t* num_invalid, int32_t* workspace,
                        int64_t num_batches, int64_t num_tokens,
                        int64_t num_topk, int64_t num_experts, int64_t capacity,
                        int64_t expert_alignment, cudaStream_t stream) {
  if (num_batches <= 0) return cudaSuccess;
  if (num_experts < 1 || num_experts > kMaxExperts || num_tokens < 0 ||
      num_topk < 0 || num_tokens * num_topk > kMaxSlots || capacity < 0 ||
      expert_alignment < 1 || expert_alignment > kMaxExpertAlignment) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_slots = num_tokens * num_topk;
  LayoutDims d;
  d.num_batches = num_batches;
  d.num_slots = static_cast<int32_t>(num_slots);
  d.chunk_slots = static_cast<int32_t>(LocalLayoutChunkSlots(num_slots));
  d.num_chunks = static_cast<int32_t>(LocalLayoutNumChunks(num_slots));
  d.num_experts = static_cast<int32_t>(num_experts);
  d.capacity =
      static_cast<int32_t>(capacity < INT32_MAX ? capacity : INT32_MAX);
  d.alignment = static_cast<int32_t>(expert_alignment);
  d.workspace_stride =
      LocalLayoutWorkspaceElems(num_tokens, num_topk, num_experts);

  // NOTES: one resident wave at most (max_waves = 1): every item is small
  // and equal-sized, and kernel 3 re-derives the expert bases per item.
  unsigned grid = 0;
  if (d.num_chunks <= 1) {
    // One chunk means at most kMinChunkSlots slots in a chunk of exactly
    // that size, kSingleChunkLaneIds ids per lane.
    if (d.chunk_slots != kMinChunkSlots) return cudaErrorInvalidValue;
    JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
        AssignRowsKernel<true>, kBlock, /*max_blocks_per_sm=*/8,
        /*max_waves=*/1, num_batches, &grid));
    AssignRowsKernel<true>
        <<<grid, kBlock, 0, stream>>>(topk_idx, slot_row, group_sizes,
                                      num_dropped, num_invalid, workspace, d);
    return cudaGetLastError();
  }
  JAX_EP_CUDA_RETURN_IF_ERROR(
      detail::BoundedGrid(ChunkHistogramKernel, kBlock, /*max_blocks_per_sm=*/8,
                          /*max_waves=*/1, num_batches * d.num_chunks, &grid));
  ChunkHistogramKernel<<<grid, kBlock, 0, stream>>>(topk_idx, workspace, d);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int64_t num_tiles = (num_experts + 1 + 31) / 32;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      detail::BoundedGrid(ChunkScanKernel, kBlock, /*max_blocks_per_sm=*/8,
                          /*max_waves=*/1, num_batches * num_tiles, &grid));
  ChunkScanKernel<<<grid, kBlock, 0, stream>>>(workspace, d);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
      AssignRowsKernel<false>, kBlock, /*max_blocks_per_sm=*/8,
      /*max_waves=*/1, num_batches * d.num_chunks, &grid));
  AssignRowsKernel<false><<<grid, kBlock, 0, stream>>>(
      topk_idx, slot_row, group_sizes, num_dropped, num_invalid, workspace, d);
  return cudaGetLastError();
}

cudaError_t PreloadKernels() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, ChunkHistogramKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, ChunkScanKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, AssignRowsKernel<true>));
  return cudaFuncGetAttributes(&attr, AssignRowsKernel<false>);
}

}  // namespace jax_ep::layout
