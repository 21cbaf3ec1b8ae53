// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer, the backward ops: DispatchCached (rows placed by an
// earlier dispatch's layout, optionally weighted: the transposes of combine)
// and CombineVjp (d_out's rows travel as in DispatchCached; the weight
// gradient's slot dots are taken on the expert side and sent home)
// (docs/intranode.md).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/local_kernels.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/kernels/peer_launch.h"
#include "ffi/kernels/peer_protocol.cuh"

namespace jax_ep::peer {
namespace {

// Expert side. Items: received (s, i), one warp each. dots[k] = <d_out row
// received from s (dispatch_rows[s][i]), expert_out[entry_row[s, i, k]]> in
// fp32 (per lane j ascending by 32, elements in order, one fmaf each, then a
// fixed xor tree), 0 where the row is < 0; written to rank s's
// dots[this rank][i][k].
template <typename T>
__global__ void __launch_bounds__(kDotsThreads, kDotsSendBlocksPerSm)
    DotsSendKernel(GroupView g, const uint4* __restrict__ expert_out,
                   const int32_t* __restrict__ entry_row,
                   const int32_t* __restrict__ recv_counts, int64_t capacity) {
  constexpr int kE = Vec16<T>::kElems;
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_start[kMaxR + 1];
  const uint64_t seq = CurrentSeq(g, kDotsRegion);
  if (BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  StageItemStarts(recv_counts, g, s_start);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int me = g.rank;
  const int64_t t_max = g.max_tokens;
  const int32_t num_topk = g.num_topk;
  const int64_t rv = g.hidden * static_cast<int64_t>(sizeof(T)) / 16;
  const uint4* rows =
      reinterpret_cast<const uint4*>(g.own + g.layout.dispatch_rows);
  const int32_t total = s_start[g.num_ranks];
  const int32_t warps_per_block = kDotsThreads / 32;
  for (int32_t item = blockIdx.x * warps_per_block + (threadIdx.x >> 5);
       item < total; item += gridDim.x * warps_per_block) {
    const int s = ItemSource(s_start, item);
    const int64_t i = item - s_start[s];
    const int64_t n = s * t_max + i;
    const int32_t my_row =
        lane < num_topk ? CheckedRow(entry_row[n * num_topk + lane], capacity)
                        : -1;
    const uint4* grad = rows + n * rv;
    float* dst = reinterpret_cast<float*>(s_peer[s] + g.layout.dots) +
                 (me * t_max + i) * num_topk;
    for (int k0 = 0; k0 < num_topk; k0 += kDotsGroup) {
      int32_t row[kDotsGroup];
      float part[kDotsGroup];
#pragma unroll
      for (int u = 0; u < kDotsGroup; ++u) {
        row[u] = __shfl_sync(kFullMask, my_row, (k0 + u) & 31);
        if (k0 + u >= num_topk) row[u] = -1;
        part[u] = 0.0f;
      }
      for (int64_t j = lane; j < rv; j += 32) {
        const uint4 gv = __ldcg(grad + j);
        uint4 v[kDotsGroup];
#pragma unroll
        for (int u = 0; u < kDotsGroup; ++u) {
          if (row[u] >= 0) v[u] = LoadVec(expert_out + row[u] * rv + j);
        }
        float gf[kE];
        Vec16<T>::Unpack(gv, gf);
#pragma unroll
        for (int u = 0; u < kDotsGroup; ++u) {
          if (row[u] < 0) continue;
          float f[kE];
          Vec16<T>::Unpack(v[u], f);
#pragma unroll
          for (int e = 0; e < kE; ++e)
            part[u] = __fmaf_rn(gf[e], f[e], part[u]);
        }
      }
      float mine = 0.0f;
#pragma unroll
      for (int u = 0; u < kDotsGroup; ++u) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          part[u] += __shfl_xor_sync(kFullMask, part[u], off);
        }
        if (lane == u) mine = row[u] >= 0 ? part[u] : 0.0f;
      }
      if (lane < kDotsGroup && k0 + lane < num_topk) dst[k0 + lane] = mine;
    }
  }
  if (!ArriveLastBlock(&g.state->blocks_done[kDotsSendCounter], gridDim.x)) {
    return;
  }
  if (threadIdx.x < g.num_ranks) {
    const int s = threadIdx.x;
    StoreReleaseSys(ArrivalFlag(s_peer[s], g, kDotsRegion, me),
                    FlagValue(seq, s_start[s + 1] - s_start[s]));
  }
}

// Home side: d_weights[t, k] = dots[d][send_pos[t, d]][k] with d the rank of
// expert topk_idx[t, k]; 0 for slots that select nothing.
__global__ void WeightGradKernel(GroupView g,
                                 const int32_t* __restrict__ topk_idx,
                                 const int32_t* __restrict__ send_pos,
                                 float* __restrict__ d_weights,
                                 int32_t num_tokens, int32_t num_experts,
                                 int32_t num_local) {
  if (Aborted(g)) return;  // outputs are garbage then; status says so
  const float* dots = reinterpret_cast<const float*>(g.own + g.layout.dots);
  const int64_t num_topk = g.num_topk;
  const int64_t total = num_tokens * num_topk;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       q < total; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = q / num_topk;
    const int64_t k = q - t * num_topk;
    const int32_t e = topk_idx[q];
    float value = 0.0f;
    if (e >= 0 && e < num_experts) {
      const int64_t d = e / num_local;
      const int32_t pos = send_pos[t * g.num_ranks + d];
      if (pos >= 0 && pos < g.max_tokens) {
        value = __ldcg(dots + (d * g.max_tokens + pos) * num_topk + k);
      }
    }
    d_weights[q] = value;
  }
}

using namespace launch;  // NOLINT: the shared launch helpers

template <typename T>
struct DotsLaunch {
  static cudaError_t Run(const GroupView& g, const void* expert_out,
                         const int32_t* entry_row, const int32_t* recv_counts,
                         int64_t capacity, cudaStream_t stream) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        LaunchWaitConsumed(g, OpCode::kCombineVjp, kDotsRegion, stream));
    DotsSendKernel<T>
        <<<g.num_blocks * kDotsSendBlocksPerSm, kDotsThreads, 0, stream>>>(
            g, static_cast<const uint4*>(expert_out), entry_row, recv_counts,
            capacity);
    return cudaGetLastError();
  }
};

}  // namespace

namespace launch {

template <typename T>
cudaError_t PreloadDotsDtype() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, DotsSendKernel<T>);
}

cudaError_t PreloadBackwardKernels() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, WeightGradKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDotsDtype<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadDotsDtype<__half>());
  return PreloadDotsDtype<float>();
}

}  // namespace launch

using namespace launch;  // NOLINT: the shared launch helpers

cudaError_t DispatchCached(const GroupView& g, ElementType dtype, const void* x,
                           const int32_t* send_pos, const int32_t* entry_row,
                           const float* entry_weights,
                           const int32_t* group_sizes, int64_t num_tokens,
                           int64_t num_local_experts, int64_t capacity,
                           bool weighted, void* recv_x, int32_t* status,
                           cudaStream_t stream) {
  if (!ValidView(g, dtype) || !ValidTokens(g, num_tokens) ||
      num_local_experts < 1 || num_local_experts > kMaxExperts ||
      capacity < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_rows = g.num_ranks * g.max_tokens;
  JAX_EP_CUDA_RETURN_IF_ERROR(LaunchRowsSend(g, OpCode::kDispatchCached, x,
                                             send_pos, num_tokens, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      LaunchWait(g, OpCode::kDispatchCached, kDispatchRegion, nullptr, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(local::Dispatch(
      dtype, g.own + g.layout.dispatch_rows, entry_row,
      entry_weights, recv_x, /*num_batches=*/1, num_rows, g.num_topk,
      num_local_experts, g.hidden, capacity, weighted, stream,
      /*x_from_peers=*/true));
  return LaunchFinish(g, 1u << kDispatchRegion, status, stream);
}

cudaError_t CombineVjp(const GroupView& g, ElementType dtype, const void* d_out,
                       const void* expert_out, const int32_t* topk_idx,
                       const int32_t* send_pos, const int32_t* entry_row,
                       const float* entry_weights, const int32_t* recv_counts,
                       const int32_t* group_sizes, int64_t num_tokens,
                       int64_t num_experts, int64_t capacity,
                       void* d_expert_out, float* d_weights, int32_t* status,
                       cudaStream_t stream) {
  if (!ValidView(g, dtype) || !ValidTokens(g, num_tokens) ||
      num_experts < g.num_ranks || num_experts % g.num_ranks != 0 ||
      num_experts / g.num_ranks > kMaxExperts || capacity < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_local = num_experts / g.num_ranks;
  const int64_t num_rows = g.num_ranks * g.max_tokens;
  // d_out rows travel like a cached dispatch (dispatch region).
  JAX_EP_CUDA_RETURN_IF_ERROR(LaunchRowsSend(g, OpCode::kCombineVjp, d_out,
                                             send_pos, num_tokens, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      LaunchWait(g, OpCode::kCombineVjp, kDispatchRegion, nullptr, stream));
  // d_expert_out: the weighted placement of the received d_out rows.
  JAX_EP_CUDA_RETURN_IF_ERROR(local::Dispatch(
      dtype, g.own + g.layout.dispatch_rows, entry_row,
      entry_weights, d_expert_out, /*num_batches=*/1, num_rows, g.num_topk,
      num_local, g.hidden, capacity, /*weighted=*/true, stream,
      /*x_from_peers=*/true));
  // Slot dots on the expert side, sent home (dots region).
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::DispatchDtype<DotsLaunch>(
      dtype, g, expert_out, entry_row, recv_counts, capacity, stream));
  JAX_EP_CUDA_RETURN_IF_ERROR(
      LaunchWait(g, OpCode::kCombineVjp, kDotsRegion, nullptr, stream));
  if (num_tokens > 0) {
    unsigned grid = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(
        ElementwiseGrid(WeightGradKernel, 256, num_tokens * g.num_topk, &grid));
    WeightGradKernel<<<grid, 256, 0, stream>>>(
        g, topk_idx, send_pos, d_weights, static_cast<int32_t>(num_tokens),
        static_cast<int32_t>(num_experts), static_cast<int32_t>(num_local));
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return LaunchFinish(g, (1u << kDispatchRegion) | (1u << kDotsRegion), status,
                      stream);
}

}  // namespace jax_ep::peer
