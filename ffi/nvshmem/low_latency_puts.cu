// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The network transport of the low-latency pair: the puts to ranks on other
// hosts. The peer transport's send kernels (ffi/kernels/low_latency_*.cu)
// have already stored the rows for ranks they reach by pointer and the flags
// of those ranks; for a rank with no pointer (peers[r] null: another host, or
// another virtual host in the emulation) they staged the rows in their own
// outbox, which lives in NVSHMEM's symmetric heap like the whole buffer. The
// kernels here run next on the same stream and move them.
//
// NOTES: the protocol, as the peer transport's (same flags, same sequence and
// buffer sets, low_latency_protocol.cuh), with the puts in place of stores:
// * Dispatch: a warp per (rank d, local expert l) puts the n staged rows of
//   (l, d) and their tokens' codes to d's slots (l, this rank, 0..n): one
//   contiguous put each, the form RDMA moves best.
// * Combine: a warp per received row whose token's home is such a rank puts
//   it to the home's (token, slot) row.
// * Flags after data: every thread quiets its own puts (completion at the
//   target, whatever the transport), the grid's last block then sets every
//   flag of those ranks with nvshmemx_signal_op. The receiver's wait is
//   unchanged: it polls its own flags (acquire, system scope).
// * Never spins: the kernels only put, so R ranks' kernels sharing one GPU
//   cannot wait on each other. NVSHMEM's device calls give them a stack
//   (local memory), and the first launch of a kernel that needs more local
//   memory than the context holds can wait for the GPU to drain, a peer's
//   spinning wait included (see SpinArrival, low_latency_common.cuh): so
//   they are launched once when the group connects (WarmPutKernels,
//   returning at once), before any wait of the group can spin.

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ffi/kernels/group_view.h"
#include "ffi/kernels/low_latency_protocol.cuh"
#include "ffi/kernels/network.h"
#include "ffi/nvshmem/put_utils.cuh"
#include "ffi/nvshmem/runtime.h"

extern "C" int JaxEpNvshmemSend(const jax_ep::network::Send* send,
                                cudaStream_t stream);

namespace jax_ep::nvshmem {
namespace {

namespace protocol = low_latency::protocol;
using group::GroupView;

void ThrowIfCudaError(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("jax_ep.nvshmem: ") + what + ": " +
                             cudaGetErrorString(e));
  }
}

__global__ void __launch_bounds__(kPutThreads)
    DispatchPutKernel(GroupView g, unsigned long long* counter, int warm) {
  if (warm) return;
  const int op = group::kLowLatencyDispatch;
  const uint64_t seq = protocol::CurrentSeq(g, op);
  const int set = protocol::BufferSet(seq);
  if (__syncthreads_or(Aborted(g))) return;  // the peers time out and say so
  const int num_ranks = g.num_ranks;
  const int num_local = g.num_local;
  const int me = g.rank;
  const int64_t t_max = g.max_tokens;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t* outbox_counts =
      reinterpret_cast<const int32_t*>(g.own + g.layout.ll_outbox_counts);
  const int warp = blockIdx.x * kPutWarps + threadIdx.x / 32;
  const int num_warps = gridDim.x * kPutWarps;
  for (int i = warp; i < num_ranks * num_local; i += num_warps) {
    const int d = i / num_local;
    const int l = i - d * num_local;
    if (g.peers[d] != nullptr) continue;  // the peer transport's
    const int32_t n =
        min(max(outbox_counts[i], 0), static_cast<int32_t>(t_max));
    if (n == 0) continue;
    const int64_t from = (static_cast<int64_t>(l) * num_ranks + d) * t_max;
    const int64_t to = (static_cast<int64_t>(l) * num_ranks + me) * t_max;
    nvshmemx_putmem_nbi_warp(
        g.own + g.layout.ll_dispatch_rows[set] + to * row_bytes,
        g.own + g.layout.ll_outbox_rows[op] + from * row_bytes, n * row_bytes,
        d);
    nvshmemx_putmem_nbi_warp(g.own + g.layout.ll_dispatch_meta[set] + to * 4,
                             g.own + g.layout.ll_outbox_meta + from * 4, n * 4,
                             d);
  }
  nvshmem_quiet();
  if (!detail::LastBlockOfGrid(counter)) return;
  for (int i = threadIdx.x; i < num_ranks * num_local; i += kPutThreads) {
    const int d = i / num_local;
    if (g.peers[d] != nullptr) continue;
    const int l = i - d * num_local;
    const int32_t n =
        min(max(outbox_counts[i], 0), static_cast<int32_t>(t_max));
    nvshmemx_signal_op(protocol::DispatchFlag(g.own, g, set, l, me),
                       protocol::FlagValue(seq, n), NVSHMEM_SIGNAL_SET, d);
  }
}

__global__ void __launch_bounds__(kPutThreads)
    CombinePutKernel(GroupView g, const int32_t* __restrict__ recv_src,
                     const int32_t* __restrict__ count,
                     unsigned long long* counter, int warm) {
  if (warm) return;
  const int op = group::kLowLatencyCombine;
  const uint64_t seq = protocol::CurrentSeq(g, op);
  const int set = protocol::BufferSet(seq);
  if (__syncthreads_or(Aborted(g))) return;
  const int num_ranks = g.num_ranks;
  const int64_t slab = num_ranks * g.max_tokens;
  const int64_t row_bytes = g.layout.ll_row_bytes;
  const int32_t code_stride = static_cast<int32_t>(g.max_tokens * g.num_topk);
  const int warp = blockIdx.x * kPutWarps + threadIdx.x / 32;
  const int num_warps = gridDim.x * kPutWarps;
  for (int l = 0; l < g.num_local; ++l) {
    const int32_t n = min(max(count[l], 0), static_cast<int32_t>(slab));
    for (int32_t i = warp; i < n; i += num_warps) {
      const int64_t in_row = l * slab + i;
      const int32_t code = recv_src[in_row];
      if (code < 0 || code >= num_ranks * code_stride) continue;
      const int s = code / code_stride;
      if (g.peers[s] != nullptr) continue;  // the peer transport's
      const int64_t tk = code - static_cast<int64_t>(s) * code_stride;
      nvshmemx_putmem_nbi_warp(
          g.own + g.layout.ll_combine_rows[set] + tk * row_bytes,
          g.own + g.layout.ll_outbox_rows[op] + in_row * row_bytes, row_bytes,
          s);
    }
  }
  nvshmem_quiet();
  if (!detail::LastBlockOfGrid(counter)) return;
  for (int s = threadIdx.x; s < num_ranks; s += kPutThreads) {
    if (g.peers[s] != nullptr) continue;
    nvshmemx_signal_op(protocol::CombineFlag(g.own, g, set, g.rank),
                       protocol::FlagValue(seq, 0), NVSHMEM_SIGNAL_SET, s);
  }
}

}  // namespace

cudaError_t LaunchPuts(const network::Send& send, cudaStream_t stream) {
  const GroupView& g = send.view;
  if (g.state == nullptr || g.peers == nullptr || g.own == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (send.op == group::kLowLatencyDispatch) {
    DispatchPutKernel<<<PutGrid(g), kPutThreads, 0, stream>>>(
        g, &g.state->blocks_done[group::kLowLatencyDispatchPutCounter], 0);
  } else if (send.op == group::kLowLatencyCombine) {
    if (send.recv_src == nullptr || send.count == nullptr) {
      return cudaErrorInvalidValue;
    }
    CombinePutKernel<<<PutGrid(g), kPutThreads, 0, stream>>>(
        g, send.recv_src, send.count,
        &g.state->blocks_done[group::kLowLatencyCombinePutCounter], 0);
  } else if (send.op == network::kRailSend) {
    return LaunchRailPuts(send, stream);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

void WarmPutKernels(int device) {
  ThrowIfCudaError(cudaSetDevice(device), "cudaSetDevice");
  const GroupView none{};
  DispatchPutKernel<<<1, kPutThreads>>>(none, nullptr, 1);
  CombinePutKernel<<<1, kPutThreads>>>(none, nullptr, nullptr, nullptr, 1);
  WarmRailPutKernel();
  ThrowIfCudaError(cudaGetLastError(), "launching the put kernels");
  ThrowIfCudaError(cudaDeviceSynchronize(), "the put kernels' first launch");
}

uint64_t SendAddress() { return reinterpret_cast<uint64_t>(&JaxEpNvshmemSend); }

size_t PutKernelsLocalBytes() {
  size_t most = 0;
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, DispatchPutKernel) == cudaSuccess &&
      attr.localSizeBytes > most) {
    most = attr.localSizeBytes;
  }
  if (cudaFuncGetAttributes(&attr, CombinePutKernel) == cudaSuccess &&
      attr.localSizeBytes > most) {
    most = attr.localSizeBytes;
  }
  const size_t rail = RailPutKernelLocalBytes();
  return rail > most ? rail : most;
}

}  // namespace jax_ep::nvshmem

extern "C" int JaxEpNvshmemSend(const jax_ep::network::Send* send,
                                cudaStream_t stream) {
  if (send == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(jax_ep::nvshmem::LaunchPuts(*send, stream));
}
