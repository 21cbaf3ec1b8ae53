// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The network transport of the rail exchange (the protocol:
// ffi/kernels/rail_exchange.cu): the pack kernel has staged this rank's block
// for every other host in the rail outbox (symmetric heap); this kernel runs
// next on the same stream and puts each to that host's rail peer, into its
// inbox (this call's set, this rank's host), then sets the peer's flag there.
//
// NOTES:
// * A warp per chunk of about 64 KiB of one block: contiguous puts, the form
//   RDMA moves best, spread over the grid's warps.
// * Flags after data: every thread quiets its puts (complete at the target,
//   whatever the transport), then the grid's last block sets each peer's flag
//   to seq << 32 | rows with nvshmemx_signal_op.
// * Never spins (see low_latency_puts.cu): launched once at connect
//   (WarmPutKernels) for its local memory.

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "ffi/kernels/group_view.h"
#include "ffi/kernels/network.h"
#include "ffi/kernels/rail_protocol.cuh"
#include "ffi/nvshmem/put_utils.cuh"
#include "ffi/nvshmem/runtime.h"

namespace jax_ep::nvshmem {
namespace {

namespace protocol = rail::protocol;
using group::GroupView;

constexpr int64_t kChunkBytes = 64 * 1024;

__global__ void __launch_bounds__(kPutThreads)
    RailPutKernel(GroupView g, const int32_t* __restrict__ counts,
                  const int32_t* __restrict__ pes, int64_t record,
                  unsigned long long* counter, int warm) {
  if (warm) return;
  const uint64_t seq = protocol::CurrentSeq(g);
  const int set = protocol::InboxSet(seq);
  if (__syncthreads_or(Aborted(g))) return;  // the peers time out and say so
  const int own = protocol::OwnHost(g, pes);
  const int64_t t_max = g.max_tokens;
  const int64_t chunk_rows =
      kChunkBytes / record > 0 ? kChunkBytes / record : 1;
  const int64_t chunks_per_host = (t_max + chunk_rows - 1) / chunk_rows;
  const int64_t warp = blockIdx.x * kPutWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kPutWarps;
  for (int64_t item = warp; item < g.num_hosts * chunks_per_host;
       item += num_warps) {
    const int h = static_cast<int>(item / chunks_per_host);
    if (h == own) continue;
    const int64_t n = min(max(counts[h], 0), static_cast<int32_t>(t_max));
    const int64_t first = (item - h * chunks_per_host) * chunk_rows;
    if (first >= n) continue;
    const int64_t rows = min(chunk_rows, n - first);
    nvshmemx_putmem_nbi_warp(
        protocol::Inbox(g.own, g, set, own) + first * record,
        protocol::Outbox(g.own, g, h) + first * record, rows * record, pes[h]);
  }
  nvshmem_quiet();
  if (!detail::LastBlockOfGrid(counter)) return;
  for (int h = threadIdx.x; h < g.num_hosts; h += kPutThreads) {
    if (h == own) continue;
    const int32_t n = min(max(counts[h], 0), static_cast<int32_t>(t_max));
    nvshmemx_signal_op(protocol::Flag(g.own, g, set, own),
                       protocol::FlagValue(seq, n), NVSHMEM_SIGNAL_SET, pes[h]);
  }
}

}  // namespace

cudaError_t LaunchRailPuts(const network::Send& send, cudaStream_t stream) {
  const GroupView& g = send.view;
  if (g.state == nullptr || g.own == nullptr || send.count == nullptr ||
      send.pes == nullptr || g.num_hosts < 2 || send.record_bytes <= 0 ||
      send.record_bytes > g.layout.rail_record_bytes) {
    return cudaErrorInvalidValue;
  }
  RailPutKernel<<<PutGrid(g), kPutThreads, 0, stream>>>(
      g, send.count, send.pes, send.record_bytes,
      &g.state->blocks_done[group::kRailPutCounter], 0);
  return cudaGetLastError();
}

void WarmRailPutKernel() {
  const GroupView none{};
  RailPutKernel<<<1, kPutThreads>>>(none, nullptr, nullptr, 0, nullptr, 1);
}

size_t RailPutKernelLocalBytes() {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, RailPutKernel) != cudaSuccess) return 0;
  return attr.localSizeBytes;
}

}  // namespace jax_ep::nvshmem
