// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// low_latency::DispatchSend and DispatchWait: the decode dispatch over an
// native group's low-latency buffers (protocol: the NOTES of
// low_latency_protocol.cuh). The send puts every token's row straight into
// its expert's region on the expert's rank (or the outbox, for the network
// transport) and then each (rank, expert)'s count as its arrival flag; the
// wait spins on the flags in one block and packs the rows in a grid that
// never spins.

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
#include "ffi/kernels/low_latency_protocol.cuh"
#include "ffi/kernels/peer_protocol.cuh"

namespace jax_ep::low_latency {
namespace {

using launch::ValidView;

// NOTES: without a minimum of blocks per SM in its launch bounds, ptxas spilled
// a few bytes of the fp8 row copy to local memory (nvcc 13.0); see SpinArrival
// for why no wait-side kernel may use local memory.
constexpr int kWaitBlocksPerSmBound = 4;
constexpr int kPackVecs = 8;  // row vectors each lane of a packing warp holds

// Relaxed system-scope store (callers fence before it).
__device__ __forceinline__ void StoreRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v)
               : "memory");
}

// ---------------------------------------------------------------------------
// Dispatch send.
// ---------------------------------------------------------------------------

// One token's rows, kSendVecs vectors per thread per pass: the plain rows, or
// e4m3 with one scale per 128 channels. The Q = 128 / kElems vectors of one
// scale block are Q consecutive lanes of one warp (pass starts are multiples
// of kSendThreads vectors), so the block's amax is a Q-lane shuffle reduction.
template <typename T, RowFormat kFormat>
__global__ void __launch_bounds__(kSendThreads, kSendBlocksPerSm)
    DispatchSendKernel(GroupView g, const uint4* __restrict__ x,
                       const int32_t* __restrict__ topk,
                       const float* __restrict__ slot_scale, int32_t num_tokens,
                       int32_t* num_invalid, unsigned long long* counter) {
  constexpr int kElems = Vec16<T>::kElems;
  constexpr int kQ = kScaleBlock / kElems;  // vectors per scale block
  static_assert(32 % kQ == 0, "a scale block spans whole lanes of one warp");
  constexpr bool kFp8 = kFormat != RowFormat::kPlain;
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_expert[kMaxK];
  __shared__ int32_t s_pos[kMaxK];
  const int op = kLowLatencyDispatch;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  if (blockIdx.x == 0 && threadIdx.x == 0) StartSend(g, op, seq);
  if (peer::BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  const int me = g.rank;
  const int32_t num_topk = g.num_topk;
  const int32_t num_local = g.num_local;
  const int32_t num_experts = num_local * g.num_ranks;
  const int64_t t_max = g.max_tokens;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t rv = static_cast<int32_t>(g.hidden / kElems);  // x vectors
  int32_t* send_counts =
      reinterpret_cast<int32_t*>(g.own + g.layout.ll_send_counts);
  int32_t invalid = 0;
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      const int32_t bad =
          StageExperts(topk, t, num_topk, num_experts, s_expert);
      if (threadIdx.x == 0) {
        invalid += bad;
        for (int k = 0; k < num_topk; ++k) {
          if (s_expert[k] >= 0) atomicAdd(send_counts + s_expert[k], 1);
        }
      }
    }
    __syncthreads();
    StagePositions<kSendThreads>(topk, t, num_topk, s_expert, s_pos);
    __syncthreads();
    const uint4* src = x + static_cast<int64_t>(t) * rv;
    for (int32_t v0 = 0; v0 < rv; v0 += kSendThreads * kSendVecs) {
      // fp8: quantise once per token, then send the same bytes everywhere.
      uint4 v[kSendVecs];
      uint32_t q[kSendVecs][kElems / 4];
      float scale[kSendVecs];
      LoadRowVecs<T, kFormat, kSendThreads>(src, v0, rv, v, q, scale);
      for (int k = 0; k < num_topk; ++k) {
        const int32_t e = s_expert[k];  // block-uniform
        if (e < 0) continue;
        const int d = e / num_local;
        const int l = e - d * num_local;
        // A rank on another host (no pointer): the row goes to the outbox at
        // (l, d, j), and the network transport's put kernel moves it.
        char* const base = s_peer[d];
        const int64_t slot =
            (static_cast<int64_t>(l) * g.num_ranks + (base ? me : d)) * t_max +
            s_pos[k];
        char* row = base ? base + g.layout.ll_dispatch_rows[set]
                         : g.own + g.layout.ll_outbox_rows[op];
        row += slot * row_bytes;
        if (v0 == 0 && threadIdx.x == 0) {
          char* meta = base ? base + g.layout.ll_dispatch_meta[set]
                            : g.own + g.layout.ll_outbox_meta;
          reinterpret_cast<int32_t*>(meta)[slot] = t * num_topk + k;
        }
        float w = 1.0f;
        if (!kFp8 && slot_scale != nullptr) w = slot_scale[t * num_topk + k];
#pragma unroll
        for (int u = 0; u < kSendVecs; ++u) {
          const int32_t j = v0 + u * kSendThreads + threadIdx.x;
          if (j >= rv) continue;
          if constexpr (kFp8) {
            if constexpr (kElems == 8) {
              reinterpret_cast<uint2*>(row)[j] = make_uint2(q[u][0], q[u][1]);
            } else {
              reinterpret_cast<uint32_t*>(row)[j] = q[u][0];
            }
            if (j % kQ == 0) {
              reinterpret_cast<float*>(row + g.hidden)[j / kQ] = scale[u];
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
            reinterpret_cast<uint4*>(row)[j] = out;
          }
        }
      }
    }
  }
  if (threadIdx.x == 0 && invalid != 0) {
    atomicAdd(&g.state->ll_invalid, static_cast<unsigned>(invalid));
  }
  if (!peer::ArriveLastBlock(counter, gridDim.x)) return;
  // Every block's rows and counts are visible (ArriveLastBlock's fences). One
  // fence per thread, then relaxed flag stores: the order of a release store
  // per flag at one fence (the reset of a count needs no order: the flag
  // carries its value).
  __threadfence_system();
  int32_t* outbox_counts =
      reinterpret_cast<int32_t*>(g.own + g.layout.ll_outbox_counts);
  for (int32_t e = threadIdx.x; e < num_experts; e += kSendThreads) {
    const int32_t rows = atomicExch(send_counts + e, 0);
    const int d = e / num_local;
    if (s_peer[d] == nullptr) {  // the put kernel sends it after the rows
      outbox_counts[e] = rows;
      continue;
    }
    StoreRelaxedSys(DispatchFlag(s_peer[d], g, set, e - d * num_local, me),
                    FlagValue(seq, rows));
  }
  if (threadIdx.x == 0)
    *num_invalid = static_cast<int32_t>(atomicExch(&g.state->ll_invalid, 0u));
}

// ---------------------------------------------------------------------------
// Dispatch wait, in two kernels: one block spins on the flags (so that a rank
// never holds more than one spinning block: with ranks sharing a GPU, many
// spinning blocks could hold the SMs a peer's send needs), then a bounded
// grid that never spins packs the rows.
// ---------------------------------------------------------------------------

// One block of kFlagsThreads: thread i waits for the flags (l, s) with
// l * R + s = i, i + kFlagsThreads, ...; then ll_recv_start[l][s] = rows of
// sources < s, [R] = the expert's total, and count[l].
constexpr int kFlagsThreads = 1024;

__global__ void __launch_bounds__(kFlagsThreads)
    DispatchFlagsKernel(GroupView g, int32_t* __restrict__ count) {
  const int op = kLowLatencyDispatch;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  if (threadIdx.x == 0) CheckWaitHasSend(g, op, seq);
  __syncthreads();
  const int num_ranks = g.num_ranks;
  const int32_t num_local = g.num_local;
  int32_t* start = reinterpret_cast<int32_t*>(g.own + g.layout.ll_recv_start);
  for (int32_t i = threadIdx.x; i < num_local * num_ranks; i += kFlagsThreads) {
    const int l = i / num_ranks;
    const int s = i - l * num_ranks;
    start[l * (num_ranks + 1) + s + 1] =
        peer::Aborted(g)
            ? 0
            : SpinArrival(g, DispatchFlag(g.own, g, set, l, s), seq, op, s);
  }
  __syncthreads();
  for (int32_t l = threadIdx.x; l < num_local; l += kFlagsThreads) {
    int32_t* row = start + l * (num_ranks + 1);
    row[0] = 0;
    for (int s = 0; s < num_ranks; ++s) row[s + 1] += row[s];
    count[l] = row[num_ranks];
  }
}

// A warp per output row (l, i) of the [L, R*T_max] slabs: rows past the
// expert's total get recv_src = -1, the others their source's row.
template <RowFormat kFormat, bool kUe8m0>
__global__ void __launch_bounds__(kWaitThreads, kWaitBlocksPerSmBound)
    DispatchPackKernel(GroupView g, char* __restrict__ recv_x,
                       void* __restrict__ scales,
                       int32_t* __restrict__ recv_src, int32_t* status,
                       unsigned long long* counter) {
  constexpr bool kFp8 = kFormat != RowFormat::kPlain;
  const int op = kLowLatencyDispatch;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  const int lane = threadIdx.x & 31;
  const int num_ranks = g.num_ranks;
  const int64_t t_max = g.max_tokens;
  const int64_t slab = num_ranks * t_max;
  const int64_t hidden = g.hidden;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int64_t out_bytes = kFp8 ? hidden : row_bytes;
  const int32_t out_vecs = static_cast<int32_t>(out_bytes / 16);
  const int32_t num_scales = static_cast<int32_t>(hidden / kScaleBlock);
  const char* rows = g.own + g.layout.ll_dispatch_rows[set];
  const int32_t* meta =
      reinterpret_cast<const int32_t*>(g.own + g.layout.ll_dispatch_meta[set]);
  const int32_t* start =
      reinterpret_cast<const int32_t*>(g.own + g.layout.ll_recv_start);
  const int32_t code_stride = static_cast<int32_t>(t_max * g.num_topk);
  const int64_t num_rows = static_cast<int64_t>(g.num_local) * slab;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kWaitThreads / 32);
  for (int64_t out_row =
           (static_cast<int64_t>(blockIdx.x) * kWaitThreads + threadIdx.x) / 32;
       out_row < num_rows; out_row += warps) {
    const int64_t l = out_row / slab;
    const int32_t i = static_cast<int32_t>(out_row - l * slab);
    const int32_t* st = start + l * (num_ranks + 1);
    if (i >= st[num_ranks]) {  // warp-uniform
      if (lane == 0) recv_src[out_row] = -1;
      continue;
    }
    // The source: the number of sources s >= 1 whose rows start at or before i.
    int s = 0;
    for (int s0 = 1; s0 <= num_ranks; s0 += 32) {
      const int q = s0 + lane;
      s += __popc(__ballot_sync(kFullMask, q < num_ranks && st[q] <= i));
    }
    const int64_t slot = (l * num_ranks + s) * t_max + (i - st[s]);
    const uint4* src = reinterpret_cast<const uint4*>(rows + slot * row_bytes);
    uint4* dst = reinterpret_cast<uint4*>(recv_x + out_row * out_bytes);
    // kPackVecs loads in flight per lane (a row is 14 to 28 of its vectors).
    for (int32_t j0 = lane; j0 < out_vecs; j0 += 32 * kPackVecs) {
      uint4 v[kPackVecs];
#pragma unroll
      for (int u = 0; u < kPackVecs; ++u) {
        const int32_t j = j0 + 32 * u;
        if (j < out_vecs) v[u] = __ldcg(src + j);
      }
#pragma unroll
      for (int u = 0; u < kPackVecs; ++u) {
        const int32_t j = j0 + 32 * u;
        if (j < out_vecs) dst[j] = v[u];
      }
    }
    if constexpr (kFp8) {
      const float* src_scales =
          reinterpret_cast<const float*>(rows + slot * row_bytes + hidden);
      if constexpr (kUe8m0) {
        int32_t* dst_scales =
            static_cast<int32_t*>(scales) + out_row * (num_scales / 4);
        for (int32_t c = lane; c < num_scales / 4; c += 32) {
          uint32_t packed = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const uint32_t bits =
                __float_as_uint(__ldcg(src_scales + 4 * c + b));
            packed |= ((bits >> 23) & 0xffu) << (8 * b);
          }
          dst_scales[c] = static_cast<int32_t>(packed);
        }
      } else {
        float* dst_scales = static_cast<float*>(scales) + out_row * num_scales;
        for (int32_t c = lane; c < num_scales; c += 32)
          dst_scales[c] = __ldcg(src_scales + c);
      }
    }
    if (lane == 0) {
      const int32_t code = __ldcg(meta + slot);
      recv_src[out_row] = s * code_stride + min(max(code, 0), code_stride - 1);
    }
  }
  if (LastBlockOfGrid(counter) && threadIdx.x == 0) {
    FinishWait(g, op, seq, status);
  }
}

template <typename T>
struct LaunchDispatchSend {
  static cudaError_t Run(const GroupView& g, RowFormat format, const void* x,
                         const int32_t* topk, const float* slot_scale,
                         int32_t num_tokens, int32_t* num_invalid,
                         cudaStream_t stream) {
    unsigned long long* counter =
        &g.state->blocks_done[group::kLowLatencyDispatchSendCounter];
    const uint4* xv = static_cast<const uint4*>(x);
    // NOTES: always the same grid per kernel (the counters rely on it).
    switch (format) {
      case RowFormat::kPlain:
        DispatchSendKernel<T, RowFormat::kPlain>
            <<<SendGrid(g), kSendThreads, 0, stream>>>(
                g, xv, topk, slot_scale, num_tokens, num_invalid, counter);
        break;
      case RowFormat::kFp8:
        DispatchSendKernel<T, RowFormat::kFp8>
            <<<SendGrid(g), kSendThreads, 0, stream>>>(
                g, xv, topk, nullptr, num_tokens, num_invalid, counter);
        break;
      case RowFormat::kFp8PowerOfTwo:
        DispatchSendKernel<T, RowFormat::kFp8PowerOfTwo>
            <<<SendGrid(g), kSendThreads, 0, stream>>>(
                g, xv, topk, nullptr, num_tokens, num_invalid, counter);
        break;
    }
    return cudaGetLastError();
  }
};

template <typename T>
cudaError_t PreloadSendKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(
      launch::Load(DispatchSendKernel<T, RowFormat::kPlain>));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      launch::Load(DispatchSendKernel<T, RowFormat::kFp8>));
  return launch::Load(DispatchSendKernel<T, RowFormat::kFp8PowerOfTwo>);
}

}  // namespace

cudaError_t DispatchSend(const GroupView& g, ElementType dtype,
                         RowFormat format, const void* x,
                         const int32_t* topk_idx, const float* slot_scale,
                         int64_t num_tokens, int32_t* num_invalid,
                         cudaStream_t stream) {
  if (!ValidView(g, dtype) || num_tokens < 0 || num_tokens > g.max_tokens ||
      (format != RowFormat::kPlain && g.hidden % kScaleBlock != 0)) {
    return cudaErrorInvalidValue;
  }
  return detail::DispatchDtype<LaunchDispatchSend>(
      dtype, g, format, x, topk_idx, slot_scale,
      static_cast<int32_t>(num_tokens), num_invalid, stream);
}

cudaError_t DispatchWait(const GroupView& g, ElementType dtype,
                         RowFormat format, bool ue8m0, void* recv_x,
                         void* scales, int32_t* count, int32_t* recv_src,
                         int32_t* status, cudaStream_t stream) {
  if (!ValidView(g, dtype) ||
      (format != RowFormat::kPlain && g.hidden % kScaleBlock != 0) ||
      (ue8m0 && (format != RowFormat::kFp8PowerOfTwo ||
                 g.hidden % (4 * kScaleBlock) != 0))) {
    return cudaErrorInvalidValue;
  }
  DispatchFlagsKernel<<<1, kFlagsThreads, 0, stream>>>(g, count);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  char* out = static_cast<char*>(recv_x);
  unsigned long long* counter =
      &g.state->blocks_done[group::kLowLatencyDispatchPackCounter];
  const int64_t rows =
      static_cast<int64_t>(g.num_local) * g.num_ranks * g.max_tokens;
  unsigned grid = 0;
  if (format == RowFormat::kPlain) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        peer::ElementwiseGrid(DispatchPackKernel<RowFormat::kPlain, false>,
                                   kWaitThreads, rows * 32, &grid));
    DispatchPackKernel<RowFormat::kPlain, false>
        <<<grid, kWaitThreads, 0, stream>>>(g, out, scales, recv_src, status,
                                            counter);
  } else if (ue8m0) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        peer::ElementwiseGrid(DispatchPackKernel<RowFormat::kFp8, true>,
                                   kWaitThreads, rows * 32, &grid));
    DispatchPackKernel<RowFormat::kFp8, true>
        <<<grid, kWaitThreads, 0, stream>>>(g, out, scales, recv_src, status,
                                            counter);
  } else {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        peer::ElementwiseGrid(DispatchPackKernel<RowFormat::kFp8, false>,
                                   kWaitThreads, rows * 32, &grid));
    DispatchPackKernel<RowFormat::kFp8, false>
        <<<grid, kWaitThreads, 0, stream>>>(g, out, scales, recv_src, status,
                                            counter);
  }
  return cudaGetLastError();
}

namespace launch {

cudaError_t PreloadDispatchKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchFlagsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      Load(DispatchPackKernel<RowFormat::kPlain, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchPackKernel<RowFormat::kFp8, false>));
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(DispatchPackKernel<RowFormat::kFp8, true>));
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadSendKernels<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadSendKernels<__half>());
  return PreloadSendKernels<float>();
}

}  // namespace launch
}  // namespace jax_ep::low_latency
