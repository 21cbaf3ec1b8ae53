// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::local::DispatchFp8: token rows into the expert-grouped rows as fp8
// (the high-throughput dispatch's fp8 wire formats, fp8_rows.h): the
// dispatch at one rank, and the peer dispatch's placement of received
// packed rows. Each token's row is read once (and quantised once) and
// written, split, to recv_x `[capacity, H]` e4m3 and recv_scales; rows past
// the placed ones are not written (unspecified), as local::Dispatch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/fp8_quantize.cuh"
#include "ffi/kernels/fp8_rows.h"
#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/local_kernels.h"
#include "ffi/kernels/local_rows.cuh"

namespace jax_ep::local {
namespace {

// Source vectors each thread holds: fewer when each is quantised (its fp32
// lanes and e4m3 words are live with it).
template <fp8::Source kSource>
constexpr int kFp8Vecs = kSource == fp8::Source::kQuantize ? 4 : kDispatchVecs;

// Items: tokens (b, t), grid-stride, a block each (as DispatchKernel's
// unsplit form). kPeerRows: `rows.x` is a peer staging buffer written by
// other GPUs before this launch (kPacked rows, read through L2); `placed`
// names the tokens the caller placed already (PlacedTokens).
template <typename T, fp8::Source kSource, bool kPeerRows>
__global__ void __launch_bounds__(kRowBlock)
    DispatchFp8Kernel(fp8::Rows rows, const int32_t* __restrict__ slot_row,
                      char* __restrict__ recv_x, char* __restrict__ recv_scales,
                      RowDims d, int32_t hidden, PlacedTokens placed) {
  __shared__ int32_t s_row[kMaxK];
  const int64_t num_items = d.num_batches * d.num_tokens;
  const int64_t scale_bytes = fp8::ScaleBytes(hidden, rows.format);
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    if constexpr (kPeerRows) {
      // Block-uniform: the caller placed these rows already.
      if (item >= placed.begin && item < placed.begin + placed.count) continue;
    }
    const int64_t b = item / d.num_tokens;
    __syncthreads();  // the previous token's readers of s_row are done
    int32_t my_row = -1;
    if (threadIdx.x < d.num_topk) {
      my_row =
          CheckedRow(slot_row[item * d.num_topk + threadIdx.x], d.capacity);
      s_row[threadIdx.x] = my_row;
    }
    // A token without any row is not read (block-uniform skip).
    if (!__syncthreads_or(my_row >= 0)) continue;
    char* q_batch = recv_x + b * d.capacity * hidden;
    char* s_batch = recv_scales + b * d.capacity * scale_bytes;
    fp8::MoveRow<T, kSource, kRowBlock, kFp8Vecs<kSource>, kPeerRows>(
        rows, item, hidden, d.num_topk, [&](int k, char** q, char** s) {
          const int32_t row = s_row[k];
          if (row < 0) return false;
          *q = q_batch + static_cast<int64_t>(row) * hidden;
          *s = s_batch + static_cast<int64_t>(row) * scale_bytes;
          return true;
        });
  }
}

template <typename T, fp8::Source kSource, bool kPeerRows>
cudaError_t LaunchDispatchFp8(const fp8::Rows& rows, const int32_t* slot_row,
                              void* recv_x, void* recv_scales, const RowDims& d,
                              int32_t hidden, const PlacedTokens& placed,
                              cudaStream_t stream) {
  const int64_t num_items = d.num_batches * d.num_tokens;
  if (num_items == 0) return cudaSuccess;
  unsigned grid = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
      DispatchFp8Kernel<T, kSource, kPeerRows>, kRowBlock, kMaxBlocksPerSm,
      kMaxWaves, num_items, &grid));
  DispatchFp8Kernel<T, kSource, kPeerRows><<<grid, kRowBlock, 0, stream>>>(
      rows, slot_row, static_cast<char*>(recv_x),
      static_cast<char*>(recv_scales), d, hidden, placed);
  return cudaGetLastError();
}

template <typename T>
struct QuantizeLaunch {
  static cudaError_t Run(const fp8::Rows& rows, const int32_t* slot_row,
                         void* recv_x, void* recv_scales, const RowDims& d,
                         int32_t hidden, cudaStream_t stream) {
    return LaunchDispatchFp8<T, fp8::Source::kQuantize, false>(
        rows, slot_row, recv_x, recv_scales, d, hidden, PlacedTokens{},
        stream);
  }
};

// The copies of given or packed rows read no element type.
using Bytes = uint8_t;

template <typename Kernel>
cudaError_t Load(Kernel kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace

namespace launch {

cudaError_t PreloadDispatchFp8Kernels() {
  using fp8::Source;
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(
      DispatchFp8Kernel<__nv_bfloat16, Source::kQuantize, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      Load(DispatchFp8Kernel<__half, Source::kQuantize, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      Load(DispatchFp8Kernel<float, Source::kQuantize, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      Load(DispatchFp8Kernel<Bytes, Source::kGiven, false>));
  return Load(DispatchFp8Kernel<Bytes, Source::kPacked, true>);
}

}  // namespace launch

cudaError_t DispatchFp8(const fp8::Rows& rows, const int32_t* slot_row,
                        void* recv_x, void* recv_scales, int64_t num_batches,
                        int64_t num_tokens, int64_t num_topk, int64_t hidden,
                        int64_t capacity, cudaStream_t stream,
                        bool x_from_peers, const PlacedTokens& placed) {
  if (num_batches <= 0) return cudaSuccess;
  // Without tokens the rows are zero-byte operands, which XLA may pass as null.
  const bool has_rows = num_tokens > 0;
  if (!ValidRowDims(num_tokens, num_topk, hidden, capacity) ||
      !fp8::ValidHidden(hidden, rows.format) || hidden > INT32_MAX ||
      (has_rows && rows.x == nullptr) ||
      (has_rows && rows.source == fp8::Source::kGiven &&
       rows.scales == nullptr) ||
      // Packed rows are a peer staging buffer, and only they are.
      (rows.source == fp8::Source::kPacked) != x_from_peers ||
      (placed.count != 0 &&
       (!x_from_peers || num_batches != 1 || placed.begin < 0 ||
        placed.count < 0 || placed.begin + placed.count > num_tokens))) {
    return cudaErrorInvalidValue;
  }
  if (!has_rows) return cudaSuccess;  // no token: nothing to place
  // The kernels take no expert count; row_vecs is unused (MoveRow sizes the
  // rows from `hidden` and the format).
  const RowDims d = MakeRowDims(num_batches, num_tokens, num_topk,
                                /*num_experts=*/1, /*row_vecs=*/0, capacity);
  const int32_t h = static_cast<int32_t>(hidden);
  switch (rows.source) {
    case fp8::Source::kQuantize:
      return detail::DispatchDtype<QuantizeLaunch>(
          rows.dtype, rows, slot_row, recv_x, recv_scales, d, h, stream);
    case fp8::Source::kGiven:
      return LaunchDispatchFp8<Bytes, fp8::Source::kGiven, false>(
          rows, slot_row, recv_x, recv_scales, d, h, PlacedTokens{}, stream);
    case fp8::Source::kPacked:
      return LaunchDispatchFp8<Bytes, fp8::Source::kPacked, true>(
          rows, slot_row, recv_x, recv_scales, d, h, placed, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_ep::local
