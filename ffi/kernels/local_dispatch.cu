// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::local::Dispatch: rows from token order `[T, H]` into the
// expert-grouped `[capacity, H]` (dispatch at one rank, the peer
// dispatch's placement of received rows, and the weighted transpose of
// combine). Rows past the placed ones are not written: they are unspecified
// (nothing in jax_ep reads them), so a worst-case capacity costs no time.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/local_kernels.h"
#include "ffi/kernels/local_rows.cuh"

namespace jax_ep::local {
namespace {

template <typename T>
__device__ __forceinline__ uint4 Scale(const uint4& v, float w) {
  constexpr int kE = Vec16<T>::kElems;
  float f[kE];
  Vec16<T>::Unpack(v, f);
#pragma unroll
  for (int i = 0; i < kE; ++i) f[i] *= w;
  return Vec16<T>::Pack(f);
}

// Items: every (token (b, t), row part) (a token's row is split into `splits`
// parts when there are too few tokens to fill the GPU, see RowSplits).
// kPeerRows: `x` is a peer-transport receive buffer written by other GPUs
// before this launch; read it through L2 (ld.global.cg), never through the
// non-coherent path.
// kSplitRows: splits > 1. NOTES: a template parameter, so that the unsplit
// instantiation (large T) carries none of the split arithmetic, which showed
// in its time when it did.
// placed (kPeerRows): see PlacedTokens in local_kernels.h.
// Stores: evict-first (st.global.cs) in the unsplit bf16 instantiations
// only (kStreamRows). NOTES: rows written once and read once by a later
// kernel; marking them evict-first keeps the rows still to be read cached.
// In the other instantiations st.global.cs raised the register count enough
// to cost more than it saved, so they keep plain stores.
template <typename T, bool kPeerRows, bool kSplitRows>
__global__ void __launch_bounds__(kRowBlock)
    DispatchKernel(const uint4* __restrict__ x,
                   const int32_t* __restrict__ slot_row,
                   const float* __restrict__ slot_weights,
                   uint4* __restrict__ recv_x, RowDims d, bool weighted,
                   int32_t splits, PlacedTokens placed) {
  constexpr bool kStreamRows = !kSplitRows && std::is_same_v<T, __nv_bfloat16>;
  __shared__ int32_t s_row[kMaxK];
  __shared__ float s_weight[kMaxK];
  const int64_t num_items =
      d.num_batches * d.num_tokens * (kSplitRows ? splits : 1);
  const int64_t rv = d.row_vecs;
  [[maybe_unused]] const int64_t part_vecs =
      kSplitRows ? PartVecs(rv, splits) : rv;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    // Token rows: read the part of x[t] once into registers, then one store
    // per slot.
    const int64_t token = kSplitRows ? item / splits : item;
    const int64_t j_begin =
        kSplitRows ? (item - token * splits) * part_vecs : 0;
    const int64_t j_end =
        !kSplitRows ? rv
                    : (j_begin + part_vecs < rv ? j_begin + part_vecs : rv);
    const int64_t b = token / d.num_tokens;
    if constexpr (kPeerRows) {
      // Block-uniform: the caller placed these rows already.
      if (token >= placed.begin && token < placed.begin + placed.count) {
        continue;
      }
    }
    __syncthreads();  // the previous token's readers of s_row are done
    int32_t my_row = -1;
    if (threadIdx.x < d.num_topk) {
      const int64_t s = token * d.num_topk + threadIdx.x;
      my_row = CheckedRow(slot_row[s], d.capacity);
      s_row[threadIdx.x] = my_row;
      s_weight[threadIdx.x] = weighted ? slot_weights[s] : 1.0f;
    }
    // NOTES: a token without any row is not read (block-uniform skip):
    // most of a peer receive buffer's rows are unused.
    if (!__syncthreads_or(my_row >= 0)) continue;
    const uint4* src = x + token * rv;
    uint4* dst_batch = recv_x + b * d.capacity * rv;
    for (int64_t v0 = j_begin; v0 < j_end; v0 += kRowBlock * kDispatchVecs) {
      uint4 v[kDispatchVecs];
#pragma unroll
      for (int u = 0; u < kDispatchVecs; ++u) {
        const int64_t j = v0 + u * kRowBlock + threadIdx.x;
        if (j < j_end) v[u] = kPeerRows ? __ldcg(src + j) : LoadVec(src + j);
      }
      for (int k = 0; k < d.num_topk; ++k) {
        const int32_t row = s_row[k];
        if (row < 0) continue;  // block-uniform
        uint4* dst = dst_batch + row * rv;
        if (weighted) {
          const float w = s_weight[k];
#pragma unroll
          for (int u = 0; u < kDispatchVecs; ++u) {
            const int64_t j = v0 + u * kRowBlock + threadIdx.x;
            if (j < j_end) {
              StoreMaybeStreaming<kStreamRows>(dst + j, Scale<T>(v[u], w));
            }
          }
        } else {
#pragma unroll
          for (int u = 0; u < kDispatchVecs; ++u) {
            const int64_t j = v0 + u * kRowBlock + threadIdx.x;
            if (j < j_end) StoreMaybeStreaming<kStreamRows>(dst + j, v[u]);
          }
        }
      }
    }
  }
}

template <typename T, bool kPeerRows, bool kSplitRows>
cudaError_t LaunchDispatchKernel(const void* x, const int32_t* slot_row,
                                 const float* slot_weights, void* recv_x,
                                 const RowDims& d, bool weighted,
                                 int32_t splits, const PlacedTokens& placed,
                                 cudaStream_t stream) {
  const int64_t num_items =
      d.num_batches * d.num_tokens * splits;
  if (num_items == 0) return cudaSuccess;
  unsigned grid = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      detail::BoundedGrid(DispatchKernel<T, kPeerRows, kSplitRows>, kRowBlock,
                          kMaxBlocksPerSm, kMaxWaves, num_items, &grid));
  DispatchKernel<T, kPeerRows, kSplitRows><<<grid, kRowBlock, 0, stream>>>(
      static_cast<const uint4*>(x), slot_row, slot_weights,
      static_cast<uint4*>(recv_x), d, weighted, splits, placed);
  return cudaGetLastError();
}

template <typename T, bool kPeerRows>
cudaError_t LaunchDispatch(const void* x, const int32_t* slot_row,
                           const float* slot_weights, void* recv_x,
                           const RowDims& d, bool weighted,
                           const PlacedTokens& placed, cudaStream_t stream) {
  int32_t splits = 1;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      RowSplits(d.row_vecs, d.num_batches * d.num_tokens, &splits));
  return splits > 1 ? LaunchDispatchKernel<T, kPeerRows, true>(
                          x, slot_row, slot_weights, recv_x, d,
                          weighted, splits, placed, stream)
                    : LaunchDispatchKernel<T, kPeerRows, false>(
                          x, slot_row, slot_weights, recv_x, d,
                          weighted, 1, placed, stream);
}

template <typename T>
struct DispatchLaunch {
  static cudaError_t Run(const void* x, const int32_t* slot_row,
                         const float* slot_weights,
                         void* recv_x, const RowDims& d, bool weighted,
                         bool x_from_peers, const PlacedTokens& placed,
                         cudaStream_t stream) {
    return x_from_peers
               ? LaunchDispatch<T, true>(x, slot_row, slot_weights,
                                         recv_x, d, weighted, placed, stream)
               : LaunchDispatch<T, false>(x, slot_row,
                                          slot_weights, recv_x, d, weighted,
                                          PlacedTokens{}, stream);
  }
};

template <typename T>
cudaError_t PreloadDispatchDtype() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchKernel<T, false, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchKernel<T, false, true>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchKernel<T, true, false>));
  return cudaFuncGetAttributes(&attr, DispatchKernel<T, true, true>);
}

}  // namespace

namespace launch {

cudaError_t PreloadDispatchKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDispatchDtype<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDispatchDtype<__half>());
  return PreloadDispatchDtype<float>();
}

}  // namespace launch

cudaError_t Dispatch(ElementType dtype, const void* x, const int32_t* slot_row,
                     const float* slot_weights,
                     void* recv_x, int64_t num_batches, int64_t num_tokens,
                     int64_t num_topk, int64_t num_experts, int64_t hidden,
                     int64_t capacity, bool weighted, cudaStream_t stream,
                     bool x_from_peers, const PlacedTokens& placed) {
  if (num_batches <= 0) return cudaSuccess;
  if (!ValidRowDims(num_tokens, num_topk, hidden, capacity) ||
      num_experts < 1 || num_experts > kMaxExperts ||
      (weighted && slot_weights == nullptr) ||
      // The placed range describes one batch element's tokens.
      (placed.count != 0 &&
       (!x_from_peers || num_batches != 1 || placed.begin < 0 ||
        placed.count < 0 || placed.begin + placed.count > num_tokens))) {
    return cudaErrorInvalidValue;
  }
  const RowDims d =
      MakeRowDims(num_batches, num_tokens, num_topk, num_experts,
                  hidden * detail::ElementBytes(dtype) / 16, capacity);
  return detail::DispatchDtype<DispatchLaunch>(
      dtype, x, slot_row, slot_weights, recv_x, d, weighted,
      x_from_peers, placed, stream);
}

}  // namespace jax_ep::local
