// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// low_latency::CombineSend and CombineWait: the decode combine over an
// native group's low-latency buffers (protocol: the NOTES of
// low_latency_protocol.cuh). The send returns every row a dispatch delivered
// to its token's home rank (or the outbox, for the network transport), then
// one flag per home; the wait spins on the R flags in one block and reduces
// (or gathers) each token's rows in a grid that never spins.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

constexpr int kCombineRows = 2;  // rows a combine send block moves at a time

// ---------------------------------------------------------------------------
// Combine send: items are the valid rows (l, i < count[l]) in expert order.
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kSendThreads, kSendBlocksPerSm)
    CombineSendKernel(GroupView g, const uint4* __restrict__ expert_out,
                      const int32_t* __restrict__ recv_src,
                      const int32_t* __restrict__ count,
                      unsigned long long* counter) {
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_start[kMaxExperts + 1];
  __shared__ int32_t s_warp[kSendThreads / 32];
  const int op = kLowLatencyCombine;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  if (blockIdx.x == 0 && threadIdx.x == 0) StartSend(g, op, seq);
  if (peer::BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  const int me = g.rank;
  const int32_t num_local = g.num_local;
  const int64_t t_max = g.max_tokens;
  const int64_t slab = g.num_ranks * t_max;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t rv = static_cast<int32_t>(row_bytes / 16);
  const int32_t code_stride = static_cast<int32_t>(t_max * g.num_topk);
  // s_start[l] = valid rows of experts < l (counts clamped to the slab).
  int32_t run = 0;
  for (int32_t l0 = 0; l0 < num_local; l0 += kSendThreads) {
    const int32_t l = l0 + threadIdx.x;
    const int32_t c =
        l < num_local ? min(max(count[l], 0), static_cast<int32_t>(slab)) : 0;
    int32_t all = 0;
    const int32_t before =
        detail::BlockExclusiveScan<kSendThreads>(c, s_warp, &all);
    if (l < num_local) s_start[l] = run + before;
    run += all;
    __syncthreads();  // s_warp is reused by the next chunk
  }
  if (threadIdx.x == 0) s_start[num_local] = run;
  __syncthreads();
  const int32_t total = run;
  // kCombineRows rows per block at a time: twice the loads in flight.
  for (int32_t item0 = blockIdx.x * kCombineRows; item0 < total;
       item0 += gridDim.x * kCombineRows) {
    uint4* dst[kCombineRows];
    const uint4* src[kCombineRows];
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) {
      const int32_t item = item0 + r;
      dst[r] = nullptr;
      src[r] = nullptr;
      if (item >= total) continue;  // block-uniform
      int lo = 0, hi = num_local;   // the l: s_start[l] <= item < s_start[l+1]
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s_start[mid] <= item)
          lo = mid;
        else
          hi = mid;
      }
      const int64_t in_row = lo * slab + (item - s_start[lo]);
      const int32_t code = recv_src[in_row];
      if (code < 0 || code >= g.num_ranks * code_stride) continue;
      const int s = code / code_stride;
      const int64_t tk = code - s * code_stride;
      // A home on another host: staged in the outbox at the row's own place,
      // for the network transport's put kernel (the source of a put must be
      // memory the network can read).
      dst[r] = reinterpret_cast<uint4*>(
          s_peer[s] != nullptr
              ? s_peer[s] + g.layout.ll_combine_rows[set] + tk * row_bytes
              : g.own + g.layout.ll_outbox_rows[op] + in_row * row_bytes);
      src[r] = expert_out + in_row * rv;
    }
    for (int32_t v0 = 0; v0 < rv; v0 += kSendThreads * kSendVecs) {
      uint4 v[kCombineRows][kSendVecs];
#pragma unroll
      for (int r = 0; r < kCombineRows; ++r) {
#pragma unroll
        for (int u = 0; u < kSendVecs; ++u) {
          const int32_t j = v0 + u * kSendThreads + threadIdx.x;
          if (src[r] != nullptr && j < rv)
            v[r][u] = detail::LoadVec(src[r] + j);
        }
      }
#pragma unroll
      for (int r = 0; r < kCombineRows; ++r) {
#pragma unroll
        for (int u = 0; u < kSendVecs; ++u) {
          const int32_t j = v0 + u * kSendThreads + threadIdx.x;
          if (dst[r] != nullptr && j < rv) dst[r][j] = v[r][u];
        }
      }
    }
  }
  if (!peer::ArriveLastBlock(counter, gridDim.x)) return;
  if (threadIdx.x < g.num_ranks && s_peer[threadIdx.x] != nullptr) {
    peer::StoreReleaseSys(CombineFlag(s_peer[threadIdx.x], g, set, me),
                               FlagValue(seq, 0));
  }
}

// ---------------------------------------------------------------------------
// Combine wait: one block waits for the R flags, then a bounded grid that
// never spins reduces (or gathers) tokens t = blockIdx.x, + gridDim.x, ...
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kMaxR) CombineFlagsKernel(GroupView g) {
  const int op = kLowLatencyCombine;
  const uint64_t seq = CurrentSeq(g, op);
  if (threadIdx.x == 0) CheckWaitHasSend(g, op, seq);
  __syncthreads();
  if (threadIdx.x < g.num_ranks && !peer::Aborted(g)) {
    SpinArrival(g, CombineFlag(g.own, g, BufferSet(seq), threadIdx.x), seq, op,
                threadIdx.x);
  }
}

template <typename T, bool kGather>
__global__ void __launch_bounds__(kWaitThreads)
    CombineReduceKernel(GroupView g, const int32_t* __restrict__ topk,
                        const float* __restrict__ weights, int32_t num_tokens,
                        int32_t num_experts, uint4* __restrict__ out,
                        int32_t* status, unsigned long long* counter) {
  constexpr int kElems = Vec16<T>::kElems;
  __shared__ int32_t s_first[kMaxK];
  __shared__ float s_w[kMaxK];
  const int op = kLowLatencyCombine;
  const uint64_t seq = CurrentSeq(g, op);
  const int set = BufferSet(seq);
  const int32_t num_topk = g.num_topk;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t rv = static_cast<int32_t>(row_bytes / 16);
  const char* rows = g.own + g.layout.ll_combine_rows[set];
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int32_t e = lane < num_topk ? topk[t * num_topk + lane] : -1;
      const bool valid = e >= 0 && e < num_experts;
      const unsigned same = __match_any_sync(kFullMask, e);
      if (lane < num_topk) {
        s_first[lane] = valid ? __ffs(same) - 1 : -1;
        s_w[lane] = (!kGather && valid) ? weights[t * num_topk + lane] : 0.0f;
      }
    }
    __syncthreads();
    if constexpr (kGather) {
      for (int k = 0; k < num_topk; ++k) {
        const int32_t first = s_first[k];
        uint4* dst = out + (static_cast<int64_t>(t) * num_topk + k) * rv;
        const uint4* src = reinterpret_cast<const uint4*>(
            rows +
            (static_cast<int64_t>(t) * num_topk + max(first, 0)) * row_bytes);
        for (int32_t j = threadIdx.x; j < rv; j += kWaitThreads) {
          dst[j] = first >= 0 ? __ldcg(src + j) : make_uint4(0, 0, 0, 0);
        }
      }
    } else {
      for (int32_t j = threadIdx.x; j < rv; j += kWaitThreads) {
        float acc[kElems];
#pragma unroll
        for (int i = 0; i < kElems; ++i) acc[i] = 0.0f;
        for (int k = 0; k < num_topk; ++k) {
          const int32_t first = s_first[k];
          if (first < 0) continue;
          const uint4* src = reinterpret_cast<const uint4*>(
              rows + (static_cast<int64_t>(t) * num_topk + first) * row_bytes);
          float f[kElems];
          Vec16<T>::Unpack(__ldcg(src + j), f);
          const float w = s_w[k];
#pragma unroll
          for (int i = 0; i < kElems; ++i) acc[i] = fmaf(w, f[i], acc[i]);
        }
        out[static_cast<int64_t>(t) * rv + j] = Vec16<T>::Pack(acc);
      }
    }
  }
  if (LastBlockOfGrid(counter) && threadIdx.x == 0) {
    FinishWait(g, op, seq, status);
  }
}

template <typename T>
struct LaunchCombineWait {
  static cudaError_t Run(const GroupView& g, const int32_t* topk,
                         const float* weights, int32_t num_tokens,
                         int32_t num_experts, bool gather, void* out,
                         int32_t* status, cudaStream_t stream) {
    CombineFlagsKernel<<<1, kMaxR, 0, stream>>>(g);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    uint4* o = static_cast<uint4*>(out);
    unsigned long long* counter =
        &g.state->blocks_done[group::kLowLatencyCombineReduceCounter];
    unsigned grid = 0;
    if (gather) {
      JAX_EP_CUDA_RETURN_IF_ERROR(peer::ElementwiseGrid(
          CombineReduceKernel<T, true>, kWaitThreads,
          static_cast<int64_t>(num_tokens) * kWaitThreads, &grid));
      CombineReduceKernel<T, true><<<grid, kWaitThreads, 0, stream>>>(
          g, topk, weights, num_tokens, num_experts, o, status, counter);
    } else {
      JAX_EP_CUDA_RETURN_IF_ERROR(peer::ElementwiseGrid(
          CombineReduceKernel<T, false>, kWaitThreads,
          static_cast<int64_t>(num_tokens) * kWaitThreads, &grid));
      CombineReduceKernel<T, false><<<grid, kWaitThreads, 0, stream>>>(
          g, topk, weights, num_tokens, num_experts, o, status, counter);
    }
    return cudaGetLastError();
  }
};

template <typename T>
cudaError_t PreloadReduceKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::Load(CombineReduceKernel<T, true>));
  return launch::Load(CombineReduceKernel<T, false>);
}

}  // namespace

cudaError_t CombineSend(const GroupView& g, ElementType dtype,
                        const void* expert_out, const int32_t* recv_src,
                        const int32_t* count, cudaStream_t stream) {
  if (!ValidView(g, dtype)) return cudaErrorInvalidValue;
  CombineSendKernel<<<SendGrid(g), kSendThreads, 0, stream>>>(
      g, static_cast<const uint4*>(expert_out), recv_src, count,
      &g.state->blocks_done[group::kLowLatencyCombineSendCounter]);
  return cudaGetLastError();
}

cudaError_t CombineWait(const GroupView& g, ElementType dtype,
                        const int32_t* topk_idx, const float* weights,
                        int64_t num_tokens, int64_t num_experts, bool gather,
                        void* out, int32_t* status, cudaStream_t stream) {
  if (!ValidView(g, dtype) || num_tokens < 0 || num_tokens > g.max_tokens ||
      num_experts != static_cast<int64_t>(g.num_local) * g.num_ranks) {
    return cudaErrorInvalidValue;
  }
  return detail::DispatchDtype<LaunchCombineWait>(
      dtype, g, topk_idx, weights, static_cast<int32_t>(num_tokens),
      static_cast<int32_t>(num_experts), gather, out, status, stream);
}

namespace launch {

cudaError_t PreloadCombineKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(CombineSendKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(Load(CombineFlagsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadReduceKernels<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadReduceKernels<__half>());
  return PreloadReduceKernels<float>();
}

}  // namespace launch
}  // namespace jax_ep::low_latency
