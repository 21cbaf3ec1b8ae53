// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// low_latency::DispatchLocal and CombineLocal: the fused low-latency ops of a
// one-rank group, straight into their outputs. With one source the packed
// slab order (source rank, source token) is the token order, so a token's row
// for expert e goes to recv_x[e][j] at once (j as in the send: the tokens
// before it that select e); no buffer, no flags, no copy. The combine finds
// each slot's row in expert_out the same way. Results and semantics: those
// of DispatchWait and CombineWait (low_latency_kernels.h).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/low_latency_common.cuh"
#include "ffi/kernels/low_latency_kernels.h"
#include "ffi/kernels/low_latency_launch.h"

namespace jax_ep::low_latency {
namespace {

using launch::ValidView;

constexpr int kLocalVecs = 2;     // row vectors per thread, one-rank dispatch
constexpr int kCombineSlots = 8;  // slots' loads in flight, one-rank combine

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

template <typename T>
cudaError_t PreloadTyped() {
  JAX_EP_CUDA_RETURN_IF_ERROR(
      launch::Load(DispatchLocalKernel<T, RowFormat::kPlain, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      launch::Load(DispatchLocalKernel<T, RowFormat::kFp8, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      launch::Load(DispatchLocalKernel<T, RowFormat::kFp8PowerOfTwo, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      launch::Load(DispatchLocalKernel<T, RowFormat::kFp8PowerOfTwo, true>));
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::Load(CombineLocalKernel<T, true>));
  return launch::Load(CombineLocalKernel<T, false>);
}

}  // namespace

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

namespace launch {

cudaError_t PreloadLocalKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadTyped<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadTyped<__half>());
  return PreloadTyped<float>();
}

}  // namespace launch
}  // namespace jax_ep::low_latency
