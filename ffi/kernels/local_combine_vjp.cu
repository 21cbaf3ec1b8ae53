// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::local::CombineVjp: the router weights' cotangent of combine, one
// dot <d_out[t], expert_out[row(t, k)]> per slot; and PreloadKernels for the
// local family.

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

__device__ __forceinline__ int64_t GlobalWarp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}

__device__ __forceinline__ int64_t NumGridWarps() {
  return (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
}

// Items: tokens, one warp each. Per lane fixed order (j ascending by 32,
// elements in order, one fmaf each), then a fixed xor-shuffle tree.
template <typename T>
__global__ void __launch_bounds__(kWarpBlock)
    CombineVjpKernel(const uint4* __restrict__ d_out,
                     const uint4* __restrict__ expert_out,
                     const int32_t* __restrict__ slot_row,
                     float* __restrict__ dots, RowDims d) {
  constexpr int kE = Vec16<T>::kElems;
  const int lane = threadIdx.x & 31;
  const int64_t rv = d.row_vecs;
  const int64_t num_items = d.num_batches * d.num_tokens;
  for (int64_t token = GlobalWarp(); token < num_items;
       token += NumGridWarps()) {
    const int64_t b = token / d.num_tokens;
    const int32_t my_row =
        lane < d.num_topk
            ? CheckedRow(slot_row[token * d.num_topk + lane], d.capacity)
            : -1;
    const uint4* g = d_out + token * rv;
    const uint4* src = expert_out + b * d.capacity * rv;
    for (int k0 = 0; k0 < d.num_topk; k0 += kDotsGroup) {
      int32_t rows[kDotsGroup];
      float part[kDotsGroup];
#pragma unroll
      for (int u = 0; u < kDotsGroup; ++u) {
        rows[u] = __shfl_sync(kFullMask, my_row, (k0 + u) & 31);
        if (k0 + u >= d.num_topk) rows[u] = -1;
        part[u] = 0.0f;
      }
      for (int64_t j = lane; j < rv; j += 32) {
        const uint4 gv = LoadVec(g + j);
        uint4 v[kDotsGroup];
#pragma unroll
        for (int u = 0; u < kDotsGroup; ++u) {
          if (rows[u] >= 0) v[u] = LoadVec(src + rows[u] * rv + j);
        }
        float gf[kE];
        Vec16<T>::Unpack(gv, gf);
#pragma unroll
        for (int u = 0; u < kDotsGroup; ++u) {
          if (rows[u] < 0) continue;
          float f[kE];
          Vec16<T>::Unpack(v[u], f);
#pragma unroll
          for (int i = 0; i < kE; ++i) {
            part[u] = __fmaf_rn(gf[i], f[i], part[u]);
          }
        }
      }
      float mine = 0.0f;
#pragma unroll
      for (int u = 0; u < kDotsGroup; ++u) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          part[u] += __shfl_xor_sync(kFullMask, part[u], off);
        }
        if (lane == u) mine = rows[u] >= 0 ? part[u] : 0.0f;
      }
      if (lane < kDotsGroup && k0 + lane < d.num_topk) {
        dots[token * d.num_topk + k0 + lane] = mine;
      }
    }
  }
}

template <typename T>
struct CombineVjpLaunch {
  static cudaError_t Run(const void* d_out, const void* expert_out,
                         const int32_t* slot_row, float* dots, const RowDims& d,
                         cudaStream_t stream) {
    constexpr int kWarps = kWarpBlock / 32;
    const int64_t num_tokens = d.num_batches * d.num_tokens;
    if (num_tokens == 0) return cudaSuccess;
    unsigned grid = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
        CombineVjpKernel<T>, kWarpBlock, kMaxBlocksPerSm, kMaxWaves,
        (num_tokens + kWarps - 1) / kWarps, &grid));
    CombineVjpKernel<T><<<grid, kWarpBlock, 0, stream>>>(
        static_cast<const uint4*>(d_out), static_cast<const uint4*>(expert_out),
        slot_row, dots, d);
    return cudaGetLastError();
  }
};

template <typename T>
cudaError_t PreloadCombineVjpDtype() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, CombineVjpKernel<T>);
}

}  // namespace

namespace launch {

cudaError_t PreloadCombineVjpKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadCombineVjpDtype<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadCombineVjpDtype<__half>());
  return PreloadCombineVjpDtype<float>();
}

}  // namespace launch

cudaError_t CombineVjp(ElementType dtype, const void* d_out,
                       const void* expert_out, const int32_t* slot_row,
                       float* dots, int64_t num_batches, int64_t num_tokens,
                       int64_t num_topk, int64_t hidden, int64_t capacity,
                       cudaStream_t stream) {
  if (num_batches <= 0) return cudaSuccess;
  if (!ValidRowDims(num_tokens, num_topk, hidden, capacity)) {
    return cudaErrorInvalidValue;
  }
  const RowDims d = MakeRowDims(
      num_batches, num_tokens, num_topk,
      /*num_experts=*/0, hidden * detail::ElementBytes(dtype) / 16, capacity);
  return detail::DispatchDtype<CombineVjpLaunch>(dtype, d_out, expert_out,
                                                 slot_row, dots, d, stream);
}

cudaError_t PreloadKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadDispatchKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadDispatchFp8Kernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadCombineKernels());
  return launch::PreloadCombineVjpKernels();
}

}  // namespace jax_ep::local
