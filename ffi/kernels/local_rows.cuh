// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::local — row movement between token order `[T, H]` and the
// expert-grouped order `[capacity, H]` on one rank: local::Dispatch (dispatch,
// and the weighted transpose of combine), local::Combine and
// local::CombineVjp (the gradient of combine w.r.t. the router weights).
//
// All three are bandwidth kernels: one item per token (a 128-thread block for
// dispatch / combine, a warp for combine_vjp; grid-stride over batch x tokens
// on a bounded grid), rows moved as 16-byte vectors, coalesced, several
// independent loads in flight per thread before any of them is consumed.
// At decode sizes combine runs as CombineVectorKernel instead: a block per
// (token, row part), one vector per thread, no shared memory.
// Reductions (combine's sum over k, combine_vjp's sum over h) have a fixed
// order, so results are bit-identical run to run.
//
// This header: what the three translation units share (local_dispatch.cu,
// local_combine.cu, local_combine_vjp.cu): constants, the row dimensions and
// how rows are split into parts at decode sizes.

#ifndef JAX_EP_FFI_KERNELS_LOCAL_ROWS_CUH_
#define JAX_EP_FFI_KERNELS_LOCAL_ROWS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/local_kernels.h"

namespace jax_ep::local {
namespace {

using detail::kFullMask;
using detail::LoadVec;
using detail::LoadVecNoL1;
using detail::StoreMaybeStreaming;
using detail::Vec16;

// NOTES: dispatch and combine use one 128-thread block per token (the whole
// row per item, read or written as one contiguous stream, which keeps the DRAM
// accesses of one item together); slot dots uses one warp per token (no block
// barrier around its reduction). Smaller items (a warp per row segment) were
// slower at large T (docs/performance.md).
constexpr int kRowBlock = 128;        // dispatch / combine threads per token
constexpr int kWarpBlock = 256;       // slot dots: 8 independent warps
constexpr int kMaxBlocksPerSm = 16;   // upper bound; occupancy decides
constexpr int kMaxWaves = 8;          // grid cap in resident waves
constexpr int kDispatchVecs = 8;      // x vectors each thread holds
constexpr int kCombineLoads = 8;      // expert rows in flight per thread
constexpr int kSplitBlocksPerSm = 8;  // row parts wanted per SM at small T
constexpr int kDotsGroup = 8;         // slots reduced together in slot dots
constexpr int kMaxK = static_cast<int>(kMaxTopk);
static_assert(kMaxK <= 32, "slot staging uses one warp, lane k = slot k");

struct RowDims {
  int64_t num_batches;
  int64_t num_tokens;
  int32_t num_topk;
  int32_t num_experts;
  int64_t row_vecs;  // 16-byte vectors per row: H * sizeof(T) / 16
  int64_t capacity;  // rows of the expert-grouped buffer
};

// NOTES: slot rows outside [0, capacity) are treated as "no row" everywhere,
// so a corrupt slot_row can never cause an out-of-bounds access.
__device__ __forceinline__ int32_t CheckedRow(int32_t row, int64_t capacity) {
  return (row >= 0 && row < capacity) ? row : -1;
}

// Vectors in each of the `splits` parts of a row of `row_vecs` vectors: whole
// multiples of kRowBlock, so every thread of a part's block has the same
// number of vectors (see RowSplits).
__host__ __device__ __forceinline__ int64_t PartVecs(int64_t row_vecs,
                                                     int64_t splits) {
  return ((row_vecs + splits - 1) / splits + kRowBlock - 1) / kRowBlock *
         kRowBlock;
}

inline bool ValidRowDims(int64_t num_tokens, int64_t num_topk, int64_t hidden,
                         int64_t capacity) {
  return num_tokens >= 0 && num_topk >= 1 && num_topk <= kMaxTopk &&
         num_tokens * num_topk <= kMaxSlots && hidden >= 0 &&
         hidden % kHiddenMultiple == 0 && capacity >= 0;
}

inline RowDims MakeRowDims(int64_t num_batches, int64_t num_tokens,
                           int64_t num_topk, int64_t num_experts,
                           int64_t row_vecs, int64_t capacity) {
  RowDims d;
  d.num_batches = num_batches;
  d.num_tokens = num_tokens;
  d.num_topk = static_cast<int32_t>(num_topk);
  d.num_experts = static_cast<int32_t>(num_experts);
  d.row_vecs = row_vecs;
  d.capacity = capacity;
  return d;
}

// NOTES: with few tokens (decode-sized T) one block per token leaves most SMs
// idle and the rest latency-bound; split rows into parts until
// there are kSplitBlocksPerSm blocks per SM, down to kRowBlock vectors a part.
// Parts are whole multiples of kRowBlock vectors (PartVecs); the parts that
// rounding left empty are dropped, and PartVecs gives the same part size for
// the reduced count (checked for every row_vecs <= 8192). `wanted_blocks`
// (optional): the blocks it aims for, kSplitBlocksPerSm per SM (0 when there
// is nothing to split).
inline cudaError_t RowSplits(int64_t row_vecs, int64_t num_rows,
                             int32_t* splits,
                             int64_t* wanted_blocks = nullptr) {
  *splits = 1;
  if (wanted_blocks != nullptr) *wanted_blocks = 0;
  if (num_rows == 0 || row_vecs == 0) return cudaSuccess;
  int num_sms = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::NumSms(&num_sms));
  const int64_t wanted = static_cast<int64_t>(num_sms) * kSplitBlocksPerSm;
  if (wanted_blocks != nullptr) *wanted_blocks = wanted;
  const int64_t max_splits = (row_vecs + kRowBlock - 1) / kRowBlock;
  int64_t n = (wanted + num_rows - 1) / num_rows;
  if (n > max_splits) n = max_splits;
  if (n < 1) n = 1;
  const int64_t part_vecs = PartVecs(row_vecs, n);
  *splits = static_cast<int32_t>((row_vecs + part_vecs - 1) / part_vecs);
  return cudaSuccess;
}

}  // namespace

namespace launch {
// Loads the kernels of each translation unit (see local::PreloadKernels).
cudaError_t PreloadDispatchKernels();
cudaError_t PreloadDispatchFp8Kernels();
cudaError_t PreloadCombineKernels();
cudaError_t PreloadCombineVjpKernels();
}  // namespace launch

}  // namespace jax_ep::local

#endif  // JAX_EP_FFI_KERNELS_LOCAL_ROWS_CUH_
