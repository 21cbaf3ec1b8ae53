// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::local::Combine: expert-grouped rows back to token order, each token
// the weighted fp32 sum of its slots' rows (CombineKernel; CombineVectorKernel
// at decode sizes).

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

// Items: tokens (b, t), grid-stride on x; a token's row is split into
// `splits` contiguous parts of `part_vecs` vectors, one per grid y, when
// there are too few tokens to fill the GPU (see RowSplits).
// Each thread owns output vectors j (stride kRowBlock) of its part and sums
// the token's valid slots, k ascending, kCombineLoads rows in flight; every
// output element is still computed by one thread in the same order, so the
// split does not change a bit of the result.
template <typename T>
__global__ void __launch_bounds__(kRowBlock)
    CombineKernel(const uint4* __restrict__ expert_out,
                  const int32_t* __restrict__ slot_row,
                  const float* __restrict__ slot_weights,
                  uint4* __restrict__ out, RowDims d, bool weighted,
                  int64_t part_vecs) {
  constexpr int kE = Vec16<T>::kElems;
  // 16-byte aligned so that a thread reads its kCombineLoads pointers and
  // weights with vector shared loads (see the row loop).
  __shared__ __align__(16) const uint4* s_src[kMaxK];
  __shared__ __align__(16) float s_weight[kMaxK];
  __shared__ int s_num;
  const int64_t rv = d.row_vecs;
  const int64_t num_items = d.num_batches * d.num_tokens;
  // The part is blockIdx.y (gridDim.y == splits): no division on the way to
  // the first load, and none at all for one batch element.
  const int64_t j_begin = blockIdx.y * part_vecs;
  const int64_t j_end = j_begin + part_vecs < rv ? j_begin + part_vecs : rv;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int64_t b = d.num_batches == 1 ? 0 : item / d.num_tokens;
    const uint4* src = expert_out + b * d.capacity * rv;
    // Stage the valid slots' row pointers in k order (compacted by warp 0).
    // NOTES: a pointer per slot, not a row id: with ids every thread redid
    // the 64-bit row address arithmetic for each of its 8 loads (~12 SASS
    // instructions each, its constants reloaded under register pressure),
    // which at decode sizes sat on the one chain that is the kernel's time.
    __syncthreads();  // the previous token's readers are done
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int64_t s = item * d.num_topk + lane;
      const bool in_topk = lane < d.num_topk;
      // NOTES: the weight is loaded beside the row id, not after the ballot
      // that reads it: at decode sizes every block runs this once, and a
      // second dependent global load puts one more memory latency in front of
      // the row loads.
      const int32_t row = in_topk ? CheckedRow(slot_row[s], d.capacity) : -1;
      const float weight = in_topk && weighted ? slot_weights[s] : 1.0f;
      const unsigned valid = __ballot_sync(kFullMask, row >= 0);
      if (row >= 0) {
        const int pos = __popc(valid & detail::LaneMaskLt());
        s_src[pos] = src + static_cast<int64_t>(row) * rv;
        s_weight[pos] = weight;
      }
      if (lane == 0) s_num = __popc(valid);
    }
    __syncthreads();
    const int n = s_num;
    uint4* dst = out + item * rv;
    // NOTES: the same sum as detail::WeightedRowSums (bit for bit), written
    // out: through the helper ptxas spills in the bf16 instance.
    for (int64_t j = j_begin + threadIdx.x; j < j_end; j += kRowBlock) {
      float acc[kE];
#pragma unroll
      for (int i = 0; i < kE; ++i) acc[i] = 0.0f;
      for (int k0 = 0; k0 < n; k0 += kCombineLoads) {
        // NOTES: the pointers and weights are read whether or not the slot
        // is valid (k0 + u < kMaxK always: k0 is a multiple of
        // kCombineLoads below n <= kMaxK), so the reads are vector shared
        // loads issued together; reading them under the validity test made
        // every row load wait on its own shared load, eight in a row on the
        // chain that is the kernel's time at decode sizes.
        const uint4* src_row[kCombineLoads];
        float weight[kCombineLoads];
#pragma unroll
        for (int u = 0; u < kCombineLoads; ++u) {
          src_row[u] = s_src[k0 + u];
          weight[u] = s_weight[k0 + u];
        }
        uint4 v[kCombineLoads];
#pragma unroll
        for (int u = 0; u < kCombineLoads; ++u) {
          if (k0 + u < n) v[u] = LoadVec(src_row[u] + j);
        }
        // NOTES: fixed order — slots k ascending, one fmaf per element each.
#pragma unroll
        for (int u = 0; u < kCombineLoads; ++u) {
          if (k0 + u < n) {
            float f[kE];
            Vec16<T>::Unpack(v[u], f);
            const float w = weight[u];
#pragma unroll
            for (int i = 0; i < kE; ++i) acc[i] = __fmaf_rn(w, f[i], acc[i]);
          }
        }
      }
      dst[j] = Vec16<T>::Pack(acc);
    }
  }
}

// The token's kK slots as (row or -1, weight), read by every thread itself:
// the same addresses across the block, so one request serves a warp. With kK
// a multiple of 4 as 16-byte loads (the launcher checks the alignment).
template <int kK>
__device__ __forceinline__ void LoadSlots(const int32_t* ids, const float* wts,
                                          bool weighted, int32_t capacity,
                                          int32_t* row, float* weight) {
  if constexpr (kK % 4 == 0) {
#pragma unroll
    for (int q = 0; q < kK / 4; ++q) {
      const int4 r = __ldg(reinterpret_cast<const int4*>(ids) + q);
      row[4 * q] = r.x;
      row[4 * q + 1] = r.y;
      row[4 * q + 2] = r.z;
      row[4 * q + 3] = r.w;
      if (weighted) {
        const float4 w = __ldg(reinterpret_cast<const float4*>(wts) + q);
        weight[4 * q] = w.x;
        weight[4 * q + 1] = w.y;
        weight[4 * q + 2] = w.z;
        weight[4 * q + 3] = w.w;
      }
    }
  } else {
#pragma unroll
    for (int u = 0; u < kK; ++u) {
      row[u] = __ldg(ids + u);
      if (weighted) weight[u] = __ldg(wts + u);
    }
  }
#pragma unroll
  for (int u = 0; u < kK; ++u) {
    row[u] = CheckedRow(row[u], capacity);
    if (!weighted) weight[u] = 1.0f;
  }
}

// Combine at decode sizes (few tokens, see CombineVectorsFit): one block
// per (token (b, t), kRowBlock-vector part of its row), one 16-byte vector
// per thread; the part is blockIdx.x, so a token's parts are neighbouring
// blocks. Every thread reads its token's kK slots itself and has all kK row
// loads in flight: no shared memory, no barrier, no division on the way to the
// first load (the batch is only divided out when there is one). Sum: slots k
// ascending, one fmaf per element each, as CombineKernel (bit for bit).
// NOTES: at decode sizes the op is one dependent chain (slot ids, then rows)
// per block, so what matters is how early the row loads issue: CombineKernel
// stages the slots through shared memory between two barriers, which puts
// them later. The row loads use L1::no_allocate (each row is read once); the
// slot loads do not (with it ptxas ordered the weight loads after the rows).
// The variants tried and the DRAM floor both this kernel and XLA's fused
// gather sit on: docs/performance.md.
template <typename T, int kK>
__global__ void __launch_bounds__(kRowBlock)
    CombineVectorKernel(const uint4* __restrict__ expert_out,
                        const int32_t* __restrict__ slot_row,
                        const float* __restrict__ slot_weights,
                        uint4* __restrict__ out, uint32_t num_tokens,
                        uint32_t row_vecs, int32_t capacity, bool weighted) {
  constexpr int kE = Vec16<T>::kElems;
  // The slot loads come first: everything before them is on the kernel's one
  // dependent chain (slots, then rows). Threads past the row's end (its last
  // part may be short) load nothing else and store nothing; they do not
  // return early, since the compiler then sinks the slot loads below the
  // bound check. NOTES: the entry is on that chain too: keep instructions
  // out of it (even a loop that runs zero times shows at T=128).
  const uint32_t item = blockIdx.y;
  int32_t row[kK];
  float weight[kK];
  LoadSlots<kK>(slot_row + item * kK, slot_weights + item * kK, weighted,
                capacity, row, weight);
  const uint32_t j = blockIdx.x * kRowBlock + threadIdx.x;
  const bool in_row = j < row_vecs;
  const uint4* src = expert_out + j;
  if (gridDim.y != num_tokens) {  // batched: this item's expert rows
    src += static_cast<int64_t>(item / num_tokens) * capacity * row_vecs;
  }
  // 32-bit row offsets: the launcher checks capacity * row_vecs < 2^32.
  uint4 v[kK];
#pragma unroll
  for (int u = 0; u < kK; ++u) {
    if (in_row && row[u] >= 0) {
      v[u] = LoadVecNoL1(src + static_cast<uint32_t>(row[u]) * row_vecs);
    }
  }
  float acc[kE];
#pragma unroll
  for (int i = 0; i < kE; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int u = 0; u < kK; ++u) {
    if (row[u] >= 0) {
      float f[kE];
      Vec16<T>::Unpack(v[u], f);
#pragma unroll
      for (int i = 0; i < kE; ++i) acc[i] = __fmaf_rn(weight[u], f[i], acc[i]);
    }
  }
  if (in_row)
    out[static_cast<int64_t>(item) * row_vecs + j] = Vec16<T>::Pack(acc);
}

// Whether the combine may run as CombineVectorKernel: decode sizes, where
// RowSplits split rows into parts of at most kRowBlock vectors and the whole
// grid is no more than the `wanted_blocks` it aims for (larger grids stay on
// CombineKernel, whose loop over rows suits them); its 32-bit capacity, row
// offsets and grid rows sufficing; and the slot arrays 16-byte aligned where
// it reads them as vectors. The top-k must also be one it is built for (the
// cases of CombineLaunch's switch).
bool CombineVectorsFit(const RowDims& d, int32_t splits, int64_t wanted_blocks,
                       const int32_t* slot_row, const float* slot_weights,
                       bool weighted) {
  const int64_t num_items = d.num_batches * d.num_tokens;
  const bool vector_slots = d.num_topk % 4 == 0;
  const auto aligned = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  return num_items * splits <= wanted_blocks &&
         splits == (d.row_vecs + kRowBlock - 1) / kRowBlock &&
         num_items <= 65535 && d.capacity <= INT32_MAX &&
         d.capacity * d.row_vecs < (int64_t{1} << 32) &&
         (!vector_slots ||
          (aligned(slot_row) && (!weighted || aligned(slot_weights))));
}

template <typename T, int kK>
cudaError_t LaunchCombineVectors(const void* expert_out,
                                 const int32_t* slot_row,
                                 const float* slot_weights, void* out,
                                 const RowDims& d, bool weighted,
                                 int32_t splits, cudaStream_t stream) {
  const dim3 blocks(static_cast<unsigned>(splits),
                    static_cast<unsigned>(d.num_batches * d.num_tokens));
  CombineVectorKernel<T, kK><<<blocks, kRowBlock, 0, stream>>>(
      static_cast<const uint4*>(expert_out), slot_row, slot_weights,
      static_cast<uint4*>(out), static_cast<uint32_t>(d.num_tokens),
      static_cast<uint32_t>(d.row_vecs), static_cast<int32_t>(d.capacity),
      weighted);
  return cudaGetLastError();
}

template <typename T>
struct CombineLaunch {
  static cudaError_t Run(const void* expert_out, const int32_t* slot_row,
                         const float* slot_weights, void* out, const RowDims& d,
                         bool weighted, cudaStream_t stream) {
    const int64_t num_items = d.num_batches * d.num_tokens;
    if (num_items == 0) return cudaSuccess;
    int32_t splits = 1;
    int64_t wanted_blocks = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(
        RowSplits(d.row_vecs, num_items, &splits, &wanted_blocks));
    if (CombineVectorsFit(d, splits, wanted_blocks, slot_row, slot_weights,
                          weighted)) {
      // The top-k counts CombineVectorKernel is built for (an instance
      // each, every slot's row load unrolled); others fall through.
      switch (d.num_topk) {
#define JAX_EP_COMBINE_VECTORS(k)                                              \
  case k:                                                                      \
    return LaunchCombineVectors<T, k>(expert_out, slot_row, slot_weights, out, \
                                      d, weighted, splits, stream);
        JAX_EP_COMBINE_VECTORS(1)
        JAX_EP_COMBINE_VECTORS(2)
        JAX_EP_COMBINE_VECTORS(4)
        JAX_EP_COMBINE_VECTORS(6)
        JAX_EP_COMBINE_VECTORS(8)
#undef JAX_EP_COMBINE_VECTORS
        default:
          break;
      }
    }
    unsigned grid = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(CombineKernel<T>, kRowBlock,
                                                    kMaxBlocksPerSm, kMaxWaves,
                                                    num_items * splits, &grid));
    // Parts on y; items grid-stride on x, so every (item, part) is covered
    // whether or not the grid is bounded (with splits > 1 there are so few
    // tokens that it is not: each (item, part) gets its own block).
    const dim3 blocks((grid + splits - 1) / splits, splits);
    CombineKernel<T><<<blocks, kRowBlock, 0, stream>>>(
        static_cast<const uint4*>(expert_out), slot_row, slot_weights,
        static_cast<uint4*>(out), d, weighted, PartVecs(d.row_vecs, splits));
    return cudaGetLastError();
  }
};

template <typename T>
cudaError_t PreloadCombineDtype() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, CombineKernel<T>));
  // Every top-k CombineLaunch's switch builds the vector combine for.
  for (const auto kernel :
       {CombineVectorKernel<T, 1>, CombineVectorKernel<T, 2>,
        CombineVectorKernel<T, 4>, CombineVectorKernel<T, 6>,
        CombineVectorKernel<T, 8>}) {
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  }
  return cudaSuccess;
}

}  // namespace

namespace launch {

cudaError_t PreloadCombineKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadCombineDtype<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadCombineDtype<__half>());
  return PreloadCombineDtype<float>();
}

}  // namespace launch

cudaError_t Combine(ElementType dtype, const void* expert_out,
                    const int32_t* slot_row, const float* slot_weights,
                    void* out, int64_t num_batches, int64_t num_tokens,
                    int64_t num_topk, int64_t hidden, int64_t capacity,
                    bool weighted, cudaStream_t stream) {
  if (num_batches <= 0) return cudaSuccess;
  if (!ValidRowDims(num_tokens, num_topk, hidden, capacity) ||
      (weighted && slot_weights == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const RowDims d = MakeRowDims(
      num_batches, num_tokens, num_topk,
      /*num_experts=*/0, hidden * detail::ElementBytes(dtype) / 16, capacity);
  return detail::DispatchDtype<CombineLaunch>(
      dtype, expert_out, slot_row, slot_weights, out, d, weighted, stream);
}

}  // namespace jax_ep::local
