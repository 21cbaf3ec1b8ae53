// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer, the kernels every op shares: the consumed and arrival
// waits, the op's last kernel (FinishKernel) and the rows-only send; their
// launch helpers; and PreloadKernels for the whole transport.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/layout_kernels.h"
#include "ffi/kernels/local_kernels.h"
#include "ffi/kernels/low_latency_kernels.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/kernels/peer_launch.h"
#include "ffi/kernels/peer_protocol.cuh"
#include "ffi/kernels/rail_kernels.h"

namespace jax_ep::peer {
namespace {

// Runs (one block) before every send kernel: thread d < R waits for rank d to
// have released `region` from the previous call.
// NOTES: the wait is a kernel of its own, not a prologue of the send kernel,
// so that at most one spinning block per rank exists. Ranks sharing one GPU
// (MPS) would otherwise fill the SMs with send blocks spinning on a peer whose
// release (its FinishKernel, or the reduce before it) then never gets an SM.
__global__ void __launch_bounds__(kWaitThreads)
    WaitConsumedKernel(GroupView g, OpCode op, int region) {
  const int d = threadIdx.x;
  if (d >= g.num_ranks || Aborted(g)) return;
  const uint64_t seq = CurrentSeq(g, region);
  uint64_t v = 0;
  SpinWait(g, ConsumedFlag(g.peers[d], g, region), WaitKind::kConsumed, seq, op,
           region, d, &v);
}

// One block; thread s waits for source s's arrival flag of `region` in the
// own buffer. counts_out[s] (optional) = the count it carried, clamped to
// [0, T_max]; 0 when the group aborted or the wait timed out.
__global__ void __launch_bounds__(kWaitThreads)
    WaitArrivalsKernel(GroupView g, OpCode op, int region,
                       int32_t* __restrict__ counts_out) {
  const int s = threadIdx.x;
  if (s >= g.num_ranks) return;
  const uint64_t seq = CurrentSeq(g, region);
  int32_t count = 0;
  uint64_t v = 0;
  if (!Aborted(g) && SpinWait(g, ArrivalFlag(g.own, g, region, s),
                              WaitKind::kArrival, seq, op, region, s, &v)) {
    count = ClampCount(static_cast<int32_t>(v & 0xffffffffull), g);
  }
  if (counts_out != nullptr) counts_out[s] = count;
}

// Last kernel of every op: publish the release of the regions the op read
// and advance their sequence counters, unless the group aborted; status.
__global__ void FinishKernel(GroupView g, unsigned region_mask,
                             int32_t* __restrict__ status) {
  if (threadIdx.x != 0) return;
  const bool aborted = Aborted(g);
  if (!aborted) {
    for (int region = 0; region < kNumRegions; ++region) {
      if ((region_mask >> region & 1u) == 0u) continue;
      const uint64_t seq = CurrentSeq(g, region);
      StoreReleaseSys(ConsumedFlag(g.own, g, region), seq);
      g.state->seq[region] = seq;
    }
  }
  *status = aborted ? 1 : 0;
}

// Rows only (the cached dispatch and the combine VJP's d_out): items are
// tokens (grid-stride over a fixed grid, see LaunchRowsSend). Token t is read
// once and written to every rank d with send_pos[t, d] >= 0, this one
// included, at dispatch_rows[this rank][send_pos]. Plain stores. NOTES:
// __stcs makes ptxas spill at the 64 registers the launch bounds allow.
__global__ void __launch_bounds__(kCommThreads, kRowsSendBlocksPerSm)
    RowsSendKernel(GroupView g, const uint4* __restrict__ x,
                   const int32_t* __restrict__ send_pos, int32_t num_tokens,
                   unsigned long long* counter) {
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_dest[kMaxR];
  __shared__ int32_t s_pos[kMaxR];
  __shared__ int32_t s_num;
  const uint64_t seq = CurrentSeq(g, kDispatchRegion);
  if (BlockSeesAbort(g)) return;
  if (threadIdx.x < g.num_ranks) s_peer[threadIdx.x] = g.peers[threadIdx.x];
  const int me = g.rank;
  const int64_t rv = g.hidden * g.itemsize / 16;
  for (int32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      StageDestinations(send_pos, t, g, s_dest, s_pos, &s_num);
    }
    __syncthreads();
    const int32_t n = s_num;
    if (n == 0) continue;  // block-uniform
    const uint4* src = x + static_cast<int64_t>(t) * rv;
    PushRow</*kSkipSelf=*/false, /*kStreaming=*/false>(g, s_peer, s_dest, s_pos,
                                                       n, src, rv, rv);
  }
  if (!ArriveLastBlock(counter, gridDim.x)) return;
  if (threadIdx.x < g.num_ranks) {
    StoreReleaseSys(ArrivalFlag(s_peer[threadIdx.x], g, kDispatchRegion, me),
                    FlagValue(seq, 0));
  }
}

}  // namespace

namespace launch {

bool ValidView(const GroupView& g, ElementType dtype) {
  return g.peers != nullptr && g.own != nullptr && g.state != nullptr &&
         g.mailbox != nullptr && g.num_ranks >= 1 && g.num_ranks <= kMaxR &&
         g.rank >= 0 && g.rank < g.num_ranks && g.num_topk >= 1 &&
         g.num_topk <= kMaxK && g.max_tokens >= 1 && g.hidden >= 1 &&
         g.hidden % kHiddenMultiple == 0 && g.num_blocks >= 1 &&
         g.itemsize == detail::ElementBytes(dtype) &&
         g.num_ranks * g.max_tokens * g.num_topk <= INT32_MAX &&
         g.hidden * g.itemsize / 16 <= INT32_MAX;  // 32-bit vector indices
}

bool ValidTokens(const GroupView& g, int64_t num_tokens) {
  return num_tokens >= 0 && num_tokens <= g.max_tokens;
}

// The device's SMs outside the group's budget (as many as the budget when
// there are none), in SMs: where a send kernel's local roles run.
cudaError_t SmsOutsideBudget(const GroupView& g, int64_t* sms) {
  int num_sms = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::NumSms(&num_sms));
  *sms = num_sms > g.num_blocks ? num_sms - g.num_blocks : g.num_blocks;
  return cudaSuccess;
}

cudaError_t LaunchWait(const GroupView& g, OpCode op, int region,
                       int32_t* counts_out, cudaStream_t stream) {
  WaitArrivalsKernel<<<1, kWaitThreads, 0, stream>>>(g, op, region, counts_out);
  return cudaGetLastError();
}

cudaError_t LaunchWaitConsumed(const GroupView& g, OpCode op, int region,
                               cudaStream_t stream) {
  WaitConsumedKernel<<<1, kWaitThreads, 0, stream>>>(g, op, region);
  return cudaGetLastError();
}

cudaError_t LaunchFinish(const GroupView& g, unsigned region_mask,
                         int32_t* status, cudaStream_t stream) {
  FinishKernel<<<1, 32, 0, stream>>>(g, region_mask, status);
  return cudaGetLastError();
}

cudaError_t LaunchRowsSend(const GroupView& g, OpCode op, const void* x,
                           const int32_t* send_pos, int64_t num_tokens,
                           cudaStream_t stream) {
  JAX_EP_CUDA_RETURN_IF_ERROR(
      LaunchWaitConsumed(g, op, kDispatchRegion, stream));
  // NOTES: always the same grid for this kernel (the counters rely on it).
  RowsSendKernel<<<g.num_blocks * kRowsSendBlocksPerSm, kCommThreads, 0,
                   stream>>>(g, static_cast<const uint4*>(x), send_pos,
                             static_cast<int32_t>(num_tokens),
                             &g.state->blocks_done[kRowsSendCounter]);
  return cudaGetLastError();
}

cudaError_t PreloadCommonKernels() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, RowsSendKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, WaitArrivalsKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, WaitConsumedKernel));
  return cudaFuncGetAttributes(&attr, FinishKernel);
}

}  // namespace launch

cudaError_t PreloadKernels() {
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadSendListKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadDispatchKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadCommonKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadCombineKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadBackwardKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(layout::PreloadKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(low_latency::PreloadKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(rail::PreloadKernels());
  return local::PreloadKernels();
}

}  // namespace jax_ep::peer
