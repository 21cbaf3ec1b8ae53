// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::rail: the rail exchange of a network group, the network hop of the
// high-throughput ops across hosts (jax_ep/backends/hierarchical.py). Every rank sends
// one block of records to its rail peer on each host (the rank with its own
// local index there) and receives one block from each.
//
// NOTES: the protocol.
// * Fixed addresses, no notify: the receiver's inbox holds T_max records per
//   source host, in two sets; call n (1-based seq, DeviceState::rail_seq + 1)
//   uses set (n - 1) % 2. A block's row count travels in its flag.
// * Pack (this file): the rows of block h, j < counts[h], as records of the
//   call's fields (each at a 16-byte offset; the call's record size is the
//   row stride, so a narrow call moves only its bytes) into the outbox at
//   (h, j); the own host's block straight into the own inbox.
// * Put (ffi/nvshmem/rail_puts.cu, the network transport, same stream): one
//   contiguous put per other host of its block into the rail peer's inbox
//   (set, this rank's host), every thread quiets its puts, then the grid's
//   last block sets each peer's flag (set, this host) = seq << 32 | rows with
//   nvshmemx_signal_op: ordered after the data.
// * Wait (one block, the only spinning one): every other host's flag of this
//   call (acquire, system scope, the group's timeout); then Unpack copies the
//   received records out (ld.global.cg) and zeroes the rows past each count,
//   and Finish advances rail_seq (only this rank's kernels read it).
// * Reuse without a release: a sender's put of call n + 2 into set n % 2 of
//   rank r follows (stream order) its wait of call n + 1, which needed r's
//   flag of call n + 1, which r set after its unpack of call n (stream
//   order again): every pair exchanges a flag every call, so an inbox set is
//   never overwritten while it is read. The outbox is rewritten only after
//   the previous call's puts were quieted.
// * Deadlock freedom and residency: pack, put and unpack never wait; a
//   rank's only spinning kernel is the one-block wait, which waits for puts
//   the peers issue before their own waits.

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/peer_protocol.cuh"
#include "ffi/kernels/rail_kernels.h"
#include "ffi/kernels/rail_protocol.cuh"

namespace jax_ep::rail {
namespace {

using group::GroupView;

constexpr int kCopyThreads = 128;  // a block per record
constexpr int kWaitThreads = static_cast<int>(group::kMaxHosts);

// Copies `bytes` (a multiple of 4) from src to dst with the block: 16-byte
// vectors where both are 16-byte aligned and the size allows, else words.
// kPeerSource: src was written by other GPUs / the network (L2 loads).
template <bool kPeerSource>
__device__ __forceinline__ void CopyBytes(char* __restrict__ dst,
                                          const char* __restrict__ src,
                                          int64_t bytes) {
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < bytes / 16; i += kCopyThreads) {
      d[i] = kPeerSource ? __ldcg(s + i) : __ldg(s + i);
    }
    return;
  }
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = threadIdx.x; i < bytes / 4; i += kCopyThreads) {
    d[i] = kPeerSource ? __ldcg(s + i) : __ldg(s + i);
  }
}

__device__ __forceinline__ void ZeroBytes(char* __restrict__ dst,
                                          int64_t bytes) {
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = threadIdx.x; i < bytes / 4; i += kCopyThreads) d[i] = 0u;
}

__device__ __forceinline__ int32_t ClampRows(int32_t n, const GroupView& g) {
  return min(max(n, 0), static_cast<int32_t>(g.max_tokens));
}

__global__ void __launch_bounds__(kCopyThreads)
    PackKernel(GroupView g, Fields f, const int32_t* __restrict__ index,
               const int32_t* __restrict__ counts,
               const int32_t* __restrict__ pes) {
  if (peer::BlockSeesAbort(g)) return;
  const uint64_t seq = protocol::CurrentSeq(g);
  const int set = protocol::InboxSet(seq);
  const int own = protocol::OwnHost(g, pes);
  const int64_t t_max = g.max_tokens;
  const int64_t record = RecordBytes(f);  // this call's row stride
  for (int64_t row = blockIdx.x; row < g.num_hosts * t_max; row += gridDim.x) {
    const int h = static_cast<int>(row / t_max);
    const int64_t j = row - h * t_max;
    if (j >= ClampRows(counts[h], g)) continue;  // block-uniform
    const int32_t from = index[row];
    char* dst = (h == own ? protocol::Inbox(g.own, g, set, h)
                          : protocol::Outbox(g.own, g, h)) +
                j * record;
    int64_t at = 0;
    // NOTES: unrolled, so the field arrays are indexed by constants (a
    // dynamic index copies the kernel parameter to local memory).
#pragma unroll
    for (int i = 0; i < kMaxRailFields; ++i) {
      if (i >= f.num) break;
      if (from >= 0 && from < f.rows[i]) {  // a corrupt index reads zeros
        CopyBytes<false>(dst + at,
                         static_cast<const char*>(f.src[i]) + from * f.bytes[i],
                         f.bytes[i]);
      } else {
        ZeroBytes(dst + at, f.bytes[i]);
      }
      at += group::AlignRecord(f.bytes[i]);
    }
  }
}

__global__ void __launch_bounds__(kWaitThreads)
    WaitKernel(GroupView g, const int32_t* __restrict__ counts,
               const int32_t* __restrict__ pes,
               int32_t* __restrict__ recv_counts) {
  const uint64_t seq = protocol::CurrentSeq(g);
  const int set = protocol::InboxSet(seq);
  const int own = protocol::OwnHost(g, pes);
  const int h = threadIdx.x;
  if (h >= g.num_hosts) return;
  if (h == own) {
    recv_counts[h] = ClampRows(counts[h], g);
    return;
  }
  uint64_t value = 0;
  const bool ok = peer::SpinWait(
      g, protocol::Flag(g.own, g, set, h), group::WaitKind::kArrival, seq,
      group::OpCode::kRailExchange, group::kNumRegions, pes[h], &value);
  recv_counts[h] =
      ok ? ClampRows(static_cast<int32_t>(value & 0xffffffffull), g) : 0;
}

__global__ void __launch_bounds__(kCopyThreads)
    UnpackKernel(GroupView g, Fields f,
                 const int32_t* __restrict__ recv_counts) {
  const uint64_t seq = protocol::CurrentSeq(g);
  const int set = protocol::InboxSet(seq);
  const int64_t t_max = g.max_tokens;
  const int64_t record = RecordBytes(f);  // this call's row stride
  for (int64_t row = blockIdx.x; row < g.num_hosts * t_max; row += gridDim.x) {
    const int h = static_cast<int>(row / t_max);
    const int64_t j = row - h * t_max;
    const bool valid = j < recv_counts[h];  // block-uniform
    const char* src = protocol::Inbox(g.own, g, set, h) + j * record;
    int64_t at = 0;
#pragma unroll
    for (int i = 0; i < kMaxRailFields; ++i) {
      if (i >= f.num) break;
      char* dst = static_cast<char*>(f.dst[i]) + row * f.bytes[i];
      if (valid) {
        CopyBytes<true>(dst, src + at, f.bytes[i]);
      } else {
        ZeroBytes(dst, f.bytes[i]);
      }
      at += group::AlignRecord(f.bytes[i]);
    }
  }
}

__global__ void FinishKernel(GroupView g, int32_t* __restrict__ status) {
  *status = peer::Aborted(g) ? 1 : 0;
  g.state->rail_seq += 1ull;
}

// A block per record, at most two resident waves (the copies never wait).
template <typename Kernel>
cudaError_t RecordGrid(Kernel kernel, const GroupView& g, unsigned* grid) {
  JAX_EP_CUDA_RETURN_IF_ERROR(detail::BoundedGrid(
      kernel, kCopyThreads, /*max_blocks_per_sm=*/16, /*max_waves=*/2,
      static_cast<int64_t>(g.num_hosts) * g.max_tokens, grid));
  if (*grid == 0) *grid = 1;
  return cudaSuccess;
}

bool ValidFields(const GroupView& g, const Fields& f) {
  if (f.num < 1 || f.num > kMaxRailFields) return false;
  for (int i = 0; i < f.num; ++i) {
    if (f.bytes[i] < 4 || f.bytes[i] % 4 != 0 || f.rows[i] < 0) return false;
  }
  return RecordBytes(f) <= g.layout.rail_record_bytes;
}

bool ValidView(const GroupView& g) {
  return g.network != 0 && g.num_hosts >= 2 &&
         g.num_hosts <= group::kMaxHosts && g.own != nullptr &&
         g.state != nullptr && g.layout.rail_record_bytes > 0;
}

}  // namespace

cudaError_t Pack(const GroupView& g, const Fields& f, const int32_t* index,
                 const int32_t* counts, const int32_t* pes,
                 cudaStream_t stream) {
  if (!ValidView(g) || !ValidFields(g, f)) return cudaErrorInvalidValue;
  unsigned grid = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(RecordGrid(PackKernel, g, &grid));
  PackKernel<<<grid, kCopyThreads, 0, stream>>>(g, f, index, counts, pes);
  return cudaGetLastError();
}

cudaError_t WaitAndUnpack(const GroupView& g, const Fields& f,
                          const int32_t* counts, const int32_t* pes,
                          int32_t* recv_counts, int32_t* status,
                          cudaStream_t stream) {
  if (!ValidView(g) || !ValidFields(g, f)) return cudaErrorInvalidValue;
  WaitKernel<<<1, kWaitThreads, 0, stream>>>(g, counts, pes, recv_counts);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  unsigned grid = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(RecordGrid(UnpackKernel, g, &grid));
  UnpackKernel<<<grid, kCopyThreads, 0, stream>>>(g, f, recv_counts);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  FinishKernel<<<1, 1, 0, stream>>>(g, status);
  return cudaGetLastError();
}

cudaError_t PreloadKernels() {
  cudaFuncAttributes attr;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, PackKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, WaitKernel));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, UnpackKernel));
  return cudaFuncGetAttributes(&attr, FinishKernel);
}

}  // namespace jax_ep::rail
