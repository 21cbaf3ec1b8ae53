// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::local — row movement between token order `[T, H]` and the
// expert-grouped order `[capacity, H]` on one rank: permute (dispatch and the
// weighted transpose of combine), unpermute (combine) and slot dots (the
// gradient of combine w.r.t. the router weights).
//
// All three are bandwidth kernels: one item per token (a 128-thread block for
// permute / unpermute, a warp for slot dots; grid-stride over batch x tokens
// on a bounded grid), rows moved as 16-byte vectors, coalesced, several
// independent loads in flight per thread before any of them is consumed.
// At decode sizes unpermute runs as CombineVectorKernel instead: a block per
// (token, row part), one vector per thread, no shared memory.
// Reductions (unpermute's sum over k, slot dots' sum over h) have a fixed
// order, so results are bit-identical run to run.

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ffi/kernels/ep_kernels.h"
#include "ffi/kernels/kernel_utils.cuh"

namespace jax_ep::local {
namespace {

using detail::kFullMask;
using detail::LoadVec;
using detail::LoadVecNoL1;
using detail::StoreMaybeStreaming;
using detail::Vec16;

// NOTES: permute and unpermute use one 128-thread block per token (the whole
// row per item, read or written as one contiguous stream, which keeps the DRAM
// accesses of one item together); slot dots uses one warp per token (no block
// barrier around its reduction). Smaller items (a warp per row segment) were
// slower at large T (docs/performance.md).
constexpr int kRowBlock = 128;          // permute / unpermute threads per token
constexpr int kWarpBlock = 256;         // slot dots: 8 independent warps
constexpr int kMaxBlocksPerSm = 16;     // upper bound; occupancy decides
constexpr int kMaxWaves = 8;            // grid cap in resident waves
constexpr int kDispatchVecs = 8;         // x vectors each thread holds
constexpr int kCombineLoads = 8;      // expert rows in flight per thread
constexpr int kSplitBlocksPerSm = 8;  // row parts wanted per SM at small T
constexpr int kDotsGroup = 8;           // slots reduced together in slot dots
constexpr int kMaxK = static_cast<int>(kMaxTopk);
static_assert(kMaxK <= 32, "slot staging uses one warp, lane k = slot k");

struct RowDims {
  int64_t num_batches;
  int64_t num_tokens;
  int32_t num_topk;
  int32_t num_experts;
  int64_t row_vecs;   // 16-byte vectors per row: H * sizeof(T) / 16
  int64_t capacity;   // rows of the expert-grouped buffer
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
// parts when there are too few tokens to fill the GPU, see RowSplits), then
// every row (b, r) as a zero-tail candidate.
// kPeerRows: `x` is a peer-transport receive buffer written by other GPUs
// before this launch; read it through L2 (ld.global.cg), never through the
// non-coherent path.
// kSplitRows: splits > 1. NOTES: a template parameter, so that the unsplit
// instantiation (large T) carries none of the split arithmetic, which showed
// in its time when it did.
// placed (kPeerRows): see PlacedTokens in ep_kernels.h.
// Stores: evict-first (st.global.cs) in the unsplit bf16 instantiations
// only (kStreamRows). NOTES: rows written once and read once by a later
// kernel; marking them evict-first keeps the rows still to be read cached.
// In the other instantiations st.global.cs raised the register count enough
// to cost more than it saved, so they keep plain stores.
template <typename T, bool kPeerRows, bool kSplitRows>
__global__ void __launch_bounds__(kRowBlock)
    DispatchKernel(const uint4* __restrict__ x,
                  const int32_t* __restrict__ slot_row,
                  const int32_t* __restrict__ group_sizes,
                  const float* __restrict__ slot_weights,
                  uint4* __restrict__ recv_x, RowDims d, bool weighted,
                  int32_t splits, PlacedTokens placed) {
  constexpr bool kStreamRows =
      !kSplitRows && std::is_same_v<T, __nv_bfloat16>;
  __shared__ int32_t s_row[kMaxK];
  __shared__ float s_weight[kMaxK];
  __shared__ int64_t s_red[kRowBlock / 32];
  const int64_t num_token_items =
      d.num_batches * d.num_tokens * (kSplitRows ? splits : 1);
  const int64_t num_items = num_token_items + d.num_batches * d.capacity;
  const int64_t rv = d.row_vecs;
  [[maybe_unused]] const int64_t part_vecs =
      kSplitRows ? PartVecs(rv, splits) : rv;
  int64_t used_batch = -1;  // batch element whose `used` is cached below
  int64_t used = 0;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    if (item < num_token_items) {
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
    } else {
      // Zero tail: rows [used, capacity) of each batch element.
      const int64_t z = item - num_token_items;
      const int64_t b = z / d.capacity;
      const int64_t row = z % d.capacity;
      if (b != used_batch) {  // block-uniform
        used = detail::UsedRows<kRowBlock>(group_sizes + b * d.num_experts,
                                           d.num_experts, d.capacity, s_red);
        used_batch = b;
      }
      if (row < used) continue;
      uint4* dst = recv_x + z * rv;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      for (int64_t j = threadIdx.x; j < rv; j += kRowBlock) {
        StoreMaybeStreaming<kStreamRows>(dst + j, zero);
      }
    }
  }
}

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
  if (in_row) out[static_cast<int64_t>(item) * row_vecs + j] = Vec16<T>::Pack(acc);
}

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

bool ValidRowDims(int64_t num_tokens, int64_t num_topk, int64_t hidden,
                  int64_t capacity) {
  return num_tokens >= 0 && num_topk >= 1 && num_topk <= kMaxTopk &&
         num_tokens * num_topk <= kMaxSlots && hidden >= 0 &&
         hidden % kHiddenMultiple == 0 && capacity >= 0;
}

RowDims MakeRowDims(int64_t num_batches, int64_t num_tokens, int64_t num_topk,
                    int64_t num_experts, int64_t row_vecs, int64_t capacity) {
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
cudaError_t RowSplits(int64_t row_vecs, int64_t num_rows, int32_t* splits,
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

template <typename T, bool kPeerRows, bool kSplitRows>
cudaError_t LaunchDispatchKernel(const void* x, const int32_t* slot_row,
                                const int32_t* group_sizes,
                                const float* slot_weights, void* recv_x,
                                const RowDims& d, bool weighted,
                                int32_t splits, const PlacedTokens& placed,
                                cudaStream_t stream) {
  const int64_t num_items =
      d.num_batches * d.num_tokens * splits + d.num_batches * d.capacity;
  if (num_items == 0) return cudaSuccess;
  unsigned grid = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
      DispatchKernel<T, kPeerRows, kSplitRows>, kRowBlock, kMaxBlocksPerSm,
      kMaxWaves, num_items, &grid));
  DispatchKernel<T, kPeerRows, kSplitRows><<<grid, kRowBlock, 0, stream>>>(
      static_cast<const uint4*>(x), slot_row, group_sizes, slot_weights,
      static_cast<uint4*>(recv_x), d, weighted, splits, placed);
  return cudaGetLastError();
}

template <typename T, bool kPeerRows>
cudaError_t LaunchDispatch(const void* x, const int32_t* slot_row,
                          const int32_t* group_sizes, const float* slot_weights,
                          void* recv_x, const RowDims& d, bool weighted,
                          const PlacedTokens& placed, cudaStream_t stream) {
  int32_t splits = 1;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      RowSplits(d.row_vecs, d.num_batches * d.num_tokens, &splits));
  return splits > 1
             ? LaunchDispatchKernel<T, kPeerRows, true>(
                   x, slot_row, group_sizes, slot_weights, recv_x, d, weighted,
                   splits, placed, stream)
             : LaunchDispatchKernel<T, kPeerRows, false>(
                   x, slot_row, group_sizes, slot_weights, recv_x, d, weighted,
                   1, placed, stream);
}

template <typename T>
struct DispatchLaunch {
  static cudaError_t Run(const void* x, const int32_t* slot_row,
                         const int32_t* group_sizes, const float* slot_weights,
                         void* recv_x, const RowDims& d, bool weighted,
                         bool x_from_peers, const PlacedTokens& placed,
                         cudaStream_t stream) {
    return x_from_peers
               ? LaunchDispatch<T, true>(x, slot_row, group_sizes, slot_weights,
                                        recv_x, d, weighted, placed, stream)
               : LaunchDispatch<T, false>(x, slot_row, group_sizes,
                                         slot_weights, recv_x, d, weighted,
                                         PlacedTokens{}, stream);
  }
};

// Whether the combine may run as CombineVectorKernel: decode sizes, where
// RowSplits split rows into parts of at most kRowBlock vectors and the whole
// grid is no more than the `wanted_blocks` it aims for (larger grids stay on
// CombineKernel, whose loop over rows suits them); its 32-bit capacity, row
// offsets and grid rows sufficing; and the slot arrays 16-byte aligned where
// it reads them as vectors. The top-k must also be one it is built for (the
// cases of CombineLaunch's switch).
bool CombineVectorsFit(const RowDims& d, int32_t splits,
                         int64_t wanted_blocks, const int32_t* slot_row,
                         const float* slot_weights, bool weighted) {
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
#define JAX_EP_COMBINE_VECTORS(k)                                          \
  case k:                                                                    \
    return LaunchCombineVectors<T, k>(expert_out, slot_row, slot_weights, \
                                        out, d, weighted, splits, stream);
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
    JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
        CombineKernel<T>, kRowBlock, kMaxBlocksPerSm, kMaxWaves,
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

int64_t ElementBytes(ElementType dtype) {
  return dtype == ElementType::kF32 ? 4 : 2;
}

}  // namespace

cudaError_t Dispatch(ElementType dtype, const void* x, const int32_t* slot_row,
                    const int32_t* group_sizes, const float* slot_weights,
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
                  hidden * ElementBytes(dtype) / 16, capacity);
  return DispatchDtype<DispatchLaunch>(dtype, x, slot_row, group_sizes,
                                      slot_weights, recv_x, d, weighted,
                                      x_from_peers, placed, stream);
}

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
  const RowDims d = MakeRowDims(num_batches, num_tokens, num_topk,
                                /*num_experts=*/0,
                                hidden * ElementBytes(dtype) / 16, capacity);
  return DispatchDtype<CombineLaunch>(dtype, expert_out, slot_row,
                                        slot_weights, out, d, weighted, stream);
}

cudaError_t CombineVjp(ElementType dtype, const void* d_out,
                     const void* expert_out, const int32_t* slot_row,
                     float* dots, int64_t num_batches, int64_t num_tokens,
                     int64_t num_topk, int64_t hidden, int64_t capacity,
                     cudaStream_t stream) {
  if (num_batches <= 0) return cudaSuccess;
  if (!ValidRowDims(num_tokens, num_topk, hidden, capacity)) {
    return cudaErrorInvalidValue;
  }
  const RowDims d = MakeRowDims(num_batches, num_tokens, num_topk,
                                /*num_experts=*/0,
                                hidden * ElementBytes(dtype) / 16, capacity);
  return DispatchDtype<CombineVjpLaunch>(dtype, d_out, expert_out, slot_row, dots,
                                       d, stream);
}

namespace {

template <typename T>
cudaError_t PreloadDtype() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchKernel<T, false, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchKernel<T, false, true>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchKernel<T, true, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, DispatchKernel<T, true, true>));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, CombineKernel<T>));
  // Every top-k CombineLaunch's switch builds the vector combine for.
  for (const auto kernel :
       {CombineVectorKernel<T, 1>, CombineVectorKernel<T, 2>,
        CombineVectorKernel<T, 4>, CombineVectorKernel<T, 6>,
        CombineVectorKernel<T, 8>}) {
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  }
  return cudaFuncGetAttributes(&attr, CombineVjpKernel<T>);
}

}  // namespace

cudaError_t PreloadKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDtype<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDtype<__half>());
  return PreloadDtype<float>();
}

}  // namespace jax_ep::local
