// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer, Combine: the expert side reduces each received token's
// rows (weighted, fp32) and sends one partial row home per (token, rank); the
// home rank waits for every rank's partials and adds them in rank order
// (docs/intranode.md).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/kernels/peer_launch.h"
#include "ffi/kernels/peer_protocol.cuh"

namespace jax_ep::peer {
namespace {

// Expert side. Items: received (s, i). partial = sum over k ascending of
// w * expert_out[entry_row[s, i, k]] (fp32, one fmaf each, rows < 0 skipped),
// written to rank s's combine_rows[this rank][i] in CombineWire<T>.
// Two roles:
// * Senders, blocks [0, num_senders) (the group's SM budget): the other
//   sources' items, whose partials cross to their ranks.
// * Local blocks, the rest of the grid: this rank's own items, whose partials
//   stay in its own region. NOTES: every item reads its slots' expert rows
//   from HBM (at R=2 the reads, not the wire, bound the send: 470 MB against
//   58 MB on the wire), so the own 1/R of the reads runs on the SMs outside
//   the budget, beside the senders, as the dispatch's placers do.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads, kCombineSendBlocksPerSm)
    CombineSendKernel(GroupView g, const uint4* __restrict__ expert_out,
                      const int32_t* __restrict__ entry_row,
                      const float* __restrict__ entry_weights,
                      const int32_t* __restrict__ recv_counts, int64_t capacity,
                      bool weighted, int32_t num_senders) {
  using Wire = typename CombineWire<T>::Type;
  constexpr int kE = Vec16<T>::kElems;
  [[maybe_unused]] constexpr int kF4 = kE / 4;  // fp32 float4s per X vector
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_start[kMaxR + 1];
  __shared__ int32_t s_row[kMaxK];
  __shared__ float s_w[kMaxK];
  __shared__ int32_t s_num;
  const uint64_t seq = CurrentSeq(g, kCombineRegion);
  if (BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  StageItemStarts(recv_counts, g, s_start);
  __syncthreads();
  const int me = g.rank;
  const int64_t t_max = g.max_tokens;
  const int32_t num_topk = g.num_topk;
  const int64_t rv = g.hidden * static_cast<int64_t>(sizeof(T)) / 16;
  const int32_t block = blockIdx.x;
  const bool sender = block < num_senders;
  for (int32_t k = sender ? block : block - num_senders;;
       k += sender ? num_senders : gridDim.x - num_senders) {
    __syncthreads();  // the previous item's readers of s_row are done
    // A sender's k-th item skips the own range; a local block's k-th is in
    // it. NOTES: the range is read from shared memory each item, not held:
    // the kernel is at its register bound (kCombineSendBlocksPerSm); held,
    // they spilled 28 bytes, and now one register is saved and restored once
    // per item, outside the row loop.
    const int32_t own_begin = s_start[me];
    const int32_t own_items = s_start[me + 1] - own_begin;
    if (k >= (sender ? s_start[g.num_ranks] - own_items : own_items)) break;
    const int32_t item =
        sender ? (k < own_begin ? k : k + own_items) : own_begin + k;
    const int s = ItemSource(s_start, item);
    const int64_t i = item - s_start[s];
    const int64_t n = s * t_max + i;
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int64_t q = n * num_topk + lane;
      const bool in_topk = lane < num_topk;
      // The weight is loaded beside the row id, not after the ballot (one
      // dependent memory latency fewer; see CombineKernel).
      const int32_t row = in_topk ? CheckedRow(entry_row[q], capacity) : -1;
      const float w = in_topk && weighted ? entry_weights[q] : 1.0f;
      const unsigned valid = __ballot_sync(kFullMask, row >= 0);
      if (row >= 0) {
        const int at = __popc(valid & LaneMaskLt());
        s_row[at] = row;
        s_w[at] = w;
      }
      if (lane == 0) s_num = __popc(valid);
    }
    __syncthreads();
    const int nv = s_num;
    char* dst_row =
        s_peer[s] + g.layout.combine_rows +
        (me * t_max + i) * g.hidden * static_cast<int64_t>(sizeof(Wire));
    for (int64_t j0 = threadIdx.x; j0 < rv;
         j0 += kCombineThreads * kCombinePasses) {
      float acc[kCombinePasses][kE];
      detail::WeightedRowSums<T, kCombineLoads, kCombinePasses>(
          expert_out, s_row, s_w, nv, rv, j0, kCombineThreads, acc);
#pragma unroll
      for (int p = 0; p < kCombinePasses; ++p) {
        const int64_t j = j0 + p * kCombineThreads;
        if (j >= rv) break;
        if constexpr (std::is_same_v<Wire, float>) {
          float4* dst = reinterpret_cast<float4*>(dst_row);
#pragma unroll
          for (int c = 0; c < kF4; ++c) {
            dst[j * kF4 + c] =
                make_float4(acc[p][4 * c], acc[p][4 * c + 1], acc[p][4 * c + 2],
                            acc[p][4 * c + 3]);
          }
        } else {
          reinterpret_cast<uint4*>(dst_row)[j] = Vec16<T>::Pack(acc[p]);
        }
      }
    }
  }
  if (!ArriveLastBlock(&g.state->blocks_done[kCombineSendCounter], gridDim.x)) {
    return;
  }
  if (threadIdx.x < g.num_ranks) {
    const int s = threadIdx.x;
    StoreReleaseSys(ArrivalFlag(s_peer[s], g, kCombineRegion, me),
                    FlagValue(seq, s_start[s + 1] - s_start[s]));
  }
}

// Home side. Items: tokens. out[t] = sum over d ascending with send_pos[t, d]
// >= 0 of combine_rows[d][send_pos[t, d]] (in CombineWire<T>, widened to
// fp32; fp32 adds, rounded once); zeros
// for tokens sent nowhere.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    CombineReduceKernel(GroupView g, const int32_t* __restrict__ send_pos,
                        uint4* __restrict__ out, int32_t num_tokens) {
  constexpr int kE = Vec16<T>::kElems;
  [[maybe_unused]] constexpr int kF4 = kE / 4;
  __shared__ int32_t s_src[kMaxR];
  __shared__ int32_t s_pos[kMaxR];
  __shared__ int32_t s_num;
  // NOTES: one decision per block (the loop below has barriers): `aborted`
  // is a volatile read that a concurrent kernel of the group could flip
  // between two threads' reads.
  if (__syncthreads_or(Aborted(g)))
    return;  // outputs are garbage; status says so
  using Wire = typename CombineWire<T>::Type;
  // One of the two views is used, depending on the wire dtype.
  [[maybe_unused]] const float4* region =
      reinterpret_cast<const float4*>(g.own + g.layout.combine_rows);
  [[maybe_unused]] const uint4* region16 =
      reinterpret_cast<const uint4*>(g.own + g.layout.combine_rows);
  const int64_t t_max = g.max_tokens;
  [[maybe_unused]] const int64_t row_f4 = g.hidden / 4;
  const int64_t rv = g.hidden * static_cast<int64_t>(sizeof(T)) / 16;
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      StageDestinations(send_pos, t, g, s_src, s_pos, &s_num);
    }
    __syncthreads();
    const int n = s_num;
    uint4* dst = out + static_cast<int64_t>(t) * rv;
    for (int64_t j = threadIdx.x; j < rv; j += kReduceThreads) {
      float acc[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[e] = 0.0f;
      for (int q0 = 0; q0 < n; q0 += kReduceLoads) {
        if constexpr (std::is_same_v<Wire, float>) {
          float4 v[kReduceLoads][kF4];
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
              const float4* src =
                  region + (s_src[q0 + u] * t_max + s_pos[q0 + u]) * row_f4 +
                  j * kF4;
#pragma unroll
              for (int c = 0; c < kF4; ++c) v[u][c] = __ldcg(src + c);
            }
          }
          // NOTES: fixed order — ranks d ascending, one fp32 add each.
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
#pragma unroll
              for (int c = 0; c < kF4; ++c) {
                acc[4 * c] = __fadd_rn(acc[4 * c], v[u][c].x);
                acc[4 * c + 1] = __fadd_rn(acc[4 * c + 1], v[u][c].y);
                acc[4 * c + 2] = __fadd_rn(acc[4 * c + 2], v[u][c].z);
                acc[4 * c + 3] = __fadd_rn(acc[4 * c + 3], v[u][c].w);
              }
            }
          }
        } else {
          uint4 v[kReduceLoads];
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
              v[u] = __ldcg(region16 +
                            (s_src[q0 + u] * t_max + s_pos[q0 + u]) * rv + j);
            }
          }
          // NOTES: fixed order — ranks d ascending, one fp32 add each.
#pragma unroll
          for (int u = 0; u < kReduceLoads; ++u) {
            if (q0 + u < n) {
              float f[kE];
              Vec16<T>::Unpack(v[u], f);
#pragma unroll
              for (int e = 0; e < kE; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
            }
          }
        }
      }
      dst[j] = Vec16<T>::Pack(acc);
    }
  }
}

using namespace launch;  // NOLINT: the shared launch helpers

template <typename T>
struct CombineLaunch {
  static cudaError_t Run(const GroupView& g, const void* expert_out,
                         const int32_t* entry_row, const float* entry_weights,
                         const int32_t* recv_counts, const int32_t* send_pos,
                         int64_t num_tokens, int64_t capacity, bool weighted,
                         void* out, int32_t* status, cudaStream_t stream) {
    JAX_EP_CUDA_RETURN_IF_ERROR(
        LaunchWaitConsumed(g, OpCode::kCombine, kCombineRegion, stream));
    // NOTES: the local blocks take the SMs outside the budget, with no cap:
    // their reads compete with the senders' for HBM only while they last,
    // and the sooner they are done the sooner the senders have it to
    // themselves.
    const int32_t num_senders = g.num_blocks * kCombineSendBlocksPerSm;
    int64_t num_local = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(SmsOutsideBudget(g, &num_local));
    num_local *= kCombineSendBlocksPerSm;
    CombineSendKernel<T><<<static_cast<unsigned>(num_senders + num_local),
                           kCombineThreads, 0, stream>>>(
        g, static_cast<const uint4*>(expert_out), entry_row, entry_weights,
        recv_counts, capacity, weighted, num_senders);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    JAX_EP_CUDA_RETURN_IF_ERROR(
        LaunchWait(g, OpCode::kCombine, kCombineRegion, nullptr, stream));
    if (num_tokens > 0) {
      unsigned grid = 0;
      JAX_EP_CUDA_RETURN_IF_ERROR(
          detail::BoundedGrid(CombineReduceKernel<T>, kReduceThreads,
                              kMaxBlocksPerSm, kMaxWaves, num_tokens, &grid));
      CombineReduceKernel<T><<<grid, kReduceThreads, 0, stream>>>(
          g, send_pos, static_cast<uint4*>(out),
          static_cast<int32_t>(num_tokens));
      JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    return LaunchFinish(g, 1u << kCombineRegion, status, stream);
  }
};

}  // namespace

namespace launch {

template <typename T>
cudaError_t PreloadCombineDtype() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attr, CombineSendKernel<T>));
  return cudaFuncGetAttributes(&attr, CombineReduceKernel<T>);
}

cudaError_t PreloadCombineKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadCombineDtype<__nv_bfloat16>());
  JAX_EP_CUDA_RETURN_IF_ERROR(PreloadCombineDtype<__half>());
  return PreloadCombineDtype<float>();
}

}  // namespace launch

cudaError_t Combine(const GroupView& g, ElementType dtype,
                    const void* expert_out, const int32_t* entry_row,
                    const float* entry_weights, const int32_t* recv_counts,
                    const int32_t* send_pos, int64_t num_tokens,
                    int64_t capacity, bool weighted, void* out, int32_t* status,
                    cudaStream_t stream) {
  if (!launch::ValidView(g, dtype) || !launch::ValidTokens(g, num_tokens) ||
      capacity < 0) {
    return cudaErrorInvalidValue;
  }
  return detail::DispatchDtype<CombineLaunch>(
      dtype, g, expert_out, entry_row, entry_weights, recv_counts, send_pos,
      num_tokens, capacity, weighted, out, status, stream);
}

}  // namespace jax_ep::peer
