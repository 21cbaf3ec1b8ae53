// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Device helpers shared by the .cu files of ffi/kernels/. Internal: included
// only by kernel translation units, never by the FFI handlers.

#ifndef JAX_EP_FFI_KERNELS_KERNEL_UTILS_CUH_
#define JAX_EP_FFI_KERNELS_KERNEL_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/launch_budget.h"

namespace jax_ep::detail {

inline constexpr unsigned kFullMask = 0xffffffffu;

// Returns on the first failed CUDA runtime call.
#define JAX_EP_CUDA_RETURN_IF_ERROR(expr)   \
  do {                                      \
    const cudaError_t jax_ep_err_ = (expr); \
    if (jax_ep_err_ != cudaSuccess) {       \
      return jax_ep_err_;                   \
    }                                       \
  } while (0)

// Number of SMs a launch sizes its grid to: the current device's (the one XLA
// made current for the handler's stream), or the op's budget where smaller
// (launch_budget.h: an op beside XLA's kernels on jax_ep's own stream).
// Host-only property query, no sync.
// NOTES: not cudaStreamGetDevice: during CUDA-graph capture (XLA command
// buffers) it fails with cudaErrorStreamCaptureUnsupported and invalidates
// the capture (seen on CUDA 13.0, H200); cudaGetDevice,
// cudaDeviceGetAttribute and cudaOccupancy* are capture-safe.
inline cudaError_t NumSms(int* num_sms) {
  int device = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      num_sms, cudaDevAttrMultiProcessorCount, device));
  if (launch::sm_budget > 0 && launch::sm_budget < *num_sms) {
    *num_sms = launch::sm_budget;
  }
  return cudaSuccess;
}

// Bounded 1-D grid for a grid-stride loop over `num_items` block items:
// at most `max_waves` times as many blocks as can be resident at once
// (occupancy of `kernel` at `block` threads, capped at `max_blocks_per_sm`
// per SM), never more than the items. Several waves, rather than exactly one
// resident wave, let the hardware scheduler balance uneven items (a one-wave
// persistent grid loses its tail to the slowest blocks on the row kernels).
// Host-only queries, no sync: safe inside command-buffer capture.
template <typename Kernel>
cudaError_t BoundedGrid(Kernel kernel, int block, int max_blocks_per_sm,
                        int max_waves, int64_t num_items, unsigned* grid) {
  int num_sms = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(NumSms(&num_sms));
  int per_sm = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, kernel, block, /*dynamicSMemSize=*/0));
  if (per_sm < 1) per_sm = 1;
  if (per_sm > max_blocks_per_sm) per_sm = max_blocks_per_sm;
  const int64_t cap = static_cast<int64_t>(num_sms) * per_sm * max_waves;
  *grid = static_cast<unsigned>(num_items < cap ? num_items : cap);
  return cudaSuccess;
}

// Whether this block is the last of its grid to get here; that block resets
// the counter, so a later call may launch another grid size on it. Thread 0's
// fence orders what the block did before (its reads of the call's sequence,
// its quieted puts) before its count.
__device__ __forceinline__ bool LastBlockOfGrid(unsigned long long* counter) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const bool last = atomicAdd(counter, 1ull) + 1ull == gridDim.x;
    if (last) atomicExch(counter, 0ull);
    s_last = last ? 1 : 0;
  }
  __syncthreads();
  return s_last != 0;
}

__device__ __forceinline__ unsigned LaneMaskLt() {
  unsigned mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

// 16-byte vector <-> fp32 lanes for each element type. Conversions to fp32
// are exact; conversions back round to nearest even, once.
template <typename T>
struct Vec16;

template <>
struct Vec16<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void Unpack(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static uint4 Pack(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct Vec16<__half> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void Unpack(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static uint4 Pack(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct Vec16<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void Unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 Pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]),
                      __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};

// Read-only, non-coherent 16-byte load (inputs never alias outputs).
__device__ __forceinline__ uint4 LoadVec(const uint4* p) { return __ldg(p); }

// LoadVec that leaves the line out of L1 (ld.global.nc.L1::no_allocate): for
// data this SM reads once.
__device__ __forceinline__ uint4 LoadVecNoL1(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// 16-byte store; with kStreaming marked evict-first (st.global.cs), for rows
// this kernel writes once and a later kernel reads once (a permute's rows, the
// rows a sender pushes into peer buffers). NOTES: a cache hint only; ordering
// and visibility are those of a plain store.
template <bool kStreaming>
__device__ __forceinline__ void StoreMaybeStreaming(uint4* p, const uint4& v) {
  if constexpr (kStreaming) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// acc[p] = sum over k < n, ascending, of weight[k] * (vector j0 + p * stride
// of row row[k], widened to fp32), for every p < kPasses whose vector is below
// row_vecs (the others are left at zero). kLoads loads in flight: kLoads /
// kPasses slots at a time, each for all passes.
// NOTES: fixed order — slots k ascending, one fmaf per element each — so the
// one-rank combine and the peer combine's partial sums agree bit for bit.
// Several passes per thread keep loads in flight when a token has few slots
// on this rank (about 1.5 of 8 at R=8): with one pass at a time the peer
// combine's send is bound by memory latency, not bandwidth.
template <typename T, int kLoads, int kPasses>
__device__ __forceinline__ void WeightedRowSums(
    const uint4* __restrict__ rows, const int32_t* row, const float* weight,
    int n, int64_t row_vecs, int64_t j0, int64_t stride,
    float (&acc)[kPasses][Vec16<T>::kElems]) {
  static_assert(kLoads % kPasses == 0, "whole slots per batch");
  constexpr int kE = Vec16<T>::kElems;
  constexpr int kSlots = kLoads / kPasses;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[p][e] = 0.0f;
  }
  for (int k0 = 0; k0 < n; k0 += kSlots) {
    uint4 v[kSlots][kPasses];
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      if (k0 + u < n) {
        const uint4* src = rows + row[k0 + u] * row_vecs;
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
          const int64_t j = j0 + p * stride;
          if (j < row_vecs) v[u][p] = LoadVec(src + j);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      if (k0 + u < n) {
        const float w = weight[k0 + u];
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
          if (j0 + p * stride < row_vecs) {
            float f[kE];
            Vec16<T>::Unpack(v[u][p], f);
#pragma unroll
            for (int e = 0; e < kE; ++e) {
              acc[p][e] = __fmaf_rn(w, f[e], acc[p][e]);
            }
          }
        }
      }
    }
  }
}

// Exclusive scan of one value per thread over a block of kThreads threads, in
// thread order: returns the sum of the values of the threads before this one;
// *all = the block's sum. s_warp: kThreads / 32 shared int32 (free to reuse
// after the next barrier). Whole block.
template <int kThreads>
__device__ __forceinline__ int32_t BlockExclusiveScan(int32_t value,
                                                      int32_t* s_warp,
                                                      int32_t* all) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int32_t inclusive = value;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t up = __shfl_up_sync(kFullMask, inclusive, off);
    if (lane >= off) inclusive += up;
  }
  if (lane == 31) s_warp[warp] = inclusive;
  __syncthreads();
  int32_t before = inclusive - value;
  int32_t sum = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) before += s_warp[w];
    sum += s_warp[w];
  }
  *all = sum;
  return before;
}

// Bytes of one activation element.
inline int64_t ElementBytes(ElementType dtype) {
  return dtype == ElementType::kF32 ? 4 : 2;
}

// Launch<T>::Run(args...) with T the activation dtype's element type.
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

}  // namespace jax_ep::detail

#endif  // JAX_EP_FFI_KERNELS_KERNEL_UTILS_CUH_
