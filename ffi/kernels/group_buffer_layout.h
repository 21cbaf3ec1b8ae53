// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The wire format of a native group's buffer: where each region of one
// rank's buffer lies, the buffer its peers write into (peer transport,
// low-latency pair, network outbox, rail exchange). Pure host arithmetic,
// shared by the kernels, the put kernels of ffi/nvshmem/ and the group's
// set-up (ffi/runtime/group.cc), which must agree on every offset.

#ifndef JAX_EP_FFI_KERNELS_GROUP_BUFFER_LAYOUT_H_
#define JAX_EP_FFI_KERNELS_GROUP_BUFFER_LAYOUT_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_common.h"

namespace jax_ep::group {

inline constexpr int64_t kRegionAlign = 256;  // bytes; >= 16 for row vectors
// The configuration header at offset 0, checked by every peer on connect
// (ffi/runtime/header.h).
inline constexpr int64_t kHeaderBytes = 256;

// Regions of a rank's buffer that peers write into. Each has its own sequence
// counter, arrival flags and `consumed` counter, so their reuse is independent.
enum Region : int32_t {
  kDispatchRegion = 0,  // rows (x / d_out), meta, weights, token index
  kCombineRegion = 1,   // partial rows of combine (CombineWire: bf16 or fp32)
  kDotsRegion = 2,      // fp32 slot dots of combine_vjp
  kNumRegions = 3,
};

// Byte offsets of the regions of one rank's buffer (the receiver side).
// NOTES: every region is sized for the worst routing skew (every token of
// every source sent to this one rank), so no flow control depends on the
// workload:
//   header            kHeaderBytes (config, checked by every peer on connect)
//   dispatch_rows     [R src][T_max][H] x dtype      R*T_max*H*itemsize
//                     (a dispatch leaves its own source's rows out: it places
//                     them from x while the others travel; the cached dispatch
//                     and the combine VJP copy them)
//   dispatch_meta     [R src][T_max][K] int32         local expert or -1
//   dispatch_weights  [R src][T_max][K] float32
//   dispatch_rank     [R src][T_max][K] int32         the slot's row in the
//                     source's own expert-grouped order of the slots it sends
//                     this rank (see peer::Dispatch)
//   notify_counts     [R src][kMaxExperts] int32     slots per local expert
//   notify_chunks     [R src][T_max + 1] int32       receive position of the
//                     first token of each of the source's send chunks
//   chunk_done        [R src][T_max + 1] u32         tokens of each chunk the
//                     source has finished (the receiver resets them)
//   combine_rows      [R expert rank][T_max][H] partial sums, sized for
//                     float32; they travel in bf16 for bf16 activations (half
//                     the wire bytes), else in fp32 (CombineWire,
//                     peer_protocol.cuh)
//   dots              [R expert rank][T_max][K] float32
//   flags             arrival[kNumRegions][R] u64, consumed[kNumRegions] u64,
//                     notify[R] u64 (dispatch counts, dispatch region's seq)
// and, only in a group created with low-latency buffers (L = E / R local
// experts, two sets b = 0, 1 of each; see low_latency_protocol.cuh):
//   ll_dispatch_rows[b]  [L][R src][T_max] rows of ll_row_bytes = H * itemsize
//                        (an fp8 row is H bytes of e4m3 then H / 128 float32
//                        scales, which fit in H * itemsize for itemsize >= 2)
//   ll_dispatch_meta[b]  [L][R src][T_max] int32  t * K + k of the row's token
//                        and (first) slot on its source
//   ll_combine_rows[b]   [T_max][K] rows of ll_row_bytes (the expert output
//                        row of each of this rank's slots)
//   ll_send_counts       [E] int32: rows per expert this rank sends in the
//                        current call (only its own kernels touch it)
//   ll_recv_start        [L][R + 1] int32: where each source's rows start in
//                        an expert's packed rows, this call (own kernels only)
//   ll_flags             dispatch[2][L][R src] u64, then combine[2][R] u64
// and, only in a group whose peers include ranks on other hosts (the network
// transport: the buffer lives in NVSHMEM's symmetric heap, and a row for such
// a rank is staged here, in memory the network can read, then put):
//   ll_outbox_rows[op]   [L][R dst][T_max] rows of ll_row_bytes, one per op (so
//                        that a dispatch and a combine in flight together never
//                        share one): dispatch rows for rank d's local expert l
//                        at (l, d, j); combine rows at the row of the expert
//                        slab they come from
//   ll_outbox_meta       [L][R dst][T_max] int32 (dispatch: t * K + k)
//   ll_outbox_counts     [E] int32: the dispatch's rows per expert for ranks
//                        reached through the network (the put kernel's flags)
// and, only in a network group of Hn >= 2 hosts, the rail exchange's regions
// (ffi/kernels/rail_exchange.cu; records of rail_record_bytes, the widest
// being a dispatched token: its row, K expert ids and K weights):
//   rail_inbox[b]        [Hn src host][T_max] records, two sets b = 0, 1
//   rail_outbox          [Hn dst host][T_max] records (what is put)
//   rail_flags           [2][Hn src host] u64: seq << 32 | rows
// each rounded up to kRegionAlign bytes (all zero without them).
struct BufferLayout {
  int64_t dispatch_rows;
  int64_t dispatch_meta;
  int64_t dispatch_weights;
  int64_t dispatch_rank;
  int64_t notify_counts;
  int64_t notify_chunks;
  int64_t chunk_done;
  int64_t combine_rows;
  int64_t dots;
  int64_t flags;
  int64_t ll_dispatch_rows[2];
  int64_t ll_dispatch_meta[2];
  int64_t ll_combine_rows[2];
  int64_t ll_send_counts;
  int64_t ll_recv_start;
  int64_t ll_flags;
  int64_t ll_outbox_rows[2];  // [LowLatencyOp]
  int64_t ll_outbox_meta;
  int64_t ll_outbox_counts;
  int64_t rail_inbox[2];
  int64_t rail_outbox;
  int64_t rail_flags;
  int64_t rail_record_bytes;
  int64_t ll_row_bytes;
  int64_t total;  // bytes of the whole buffer
};

inline int64_t AlignRegion(int64_t bytes) {
  return (bytes + kRegionAlign - 1) / kRegionAlign * kRegionAlign;
}

// Bytes of one record of the rail exchange: fields start at 16-byte offsets.
__host__ __device__ inline int64_t AlignRecord(int64_t bytes) {
  return (bytes + 15) / 16 * 16;
}
inline int64_t RailRecordBytes(int64_t hidden, int64_t itemsize,
                               int64_t num_topk) {
  return AlignRecord(hidden * itemsize) + 2 * AlignRecord(num_topk * 4);
}

// Pure host arithmetic; callers validate the arguments (all >= 1).
// `num_experts` > 0 adds the low-latency buffers (0: none), `network` their
// outbox (ll_outbox_*), `num_hosts` >= 2 (network groups) the rail exchange's
// regions.
inline BufferLayout MakeBufferLayout(int64_t num_ranks, int64_t max_tokens,
                                     int64_t hidden, int64_t num_topk,
                                     int64_t itemsize,
                                     int64_t low_latency_experts = 0,
                                     bool network = false,
                                     int64_t num_hosts = 0) {
  const int64_t rows = num_ranks * max_tokens;  // N
  BufferLayout l;
  int64_t at = kHeaderBytes;
  l.dispatch_rows = at;
  at += AlignRegion(rows * hidden * itemsize);
  l.dispatch_meta = at;
  at += AlignRegion(rows * num_topk * 4);
  l.dispatch_weights = at;
  at += AlignRegion(rows * num_topk * 4);
  l.dispatch_rank = at;
  at += AlignRegion(rows * num_topk * 4);
  l.notify_counts = at;
  at += AlignRegion(num_ranks * kMaxExperts * 4);
  l.notify_chunks = at;
  at += AlignRegion(num_ranks * (max_tokens + 1) * 4);
  l.chunk_done = at;
  at += AlignRegion(num_ranks * (max_tokens + 1) * 4);
  l.combine_rows = at;
  at += AlignRegion(rows * hidden * 4);
  l.dots = at;
  at += AlignRegion(rows * num_topk * 4);
  l.flags = at;
  at += AlignRegion((kNumRegions * num_ranks + kNumRegions + num_ranks) * 8);
  l.ll_row_bytes = low_latency_experts > 0 ? hidden * itemsize : 0;
  const int64_t num_local =
      low_latency_experts > 0 ? low_latency_experts / num_ranks : 0;
  const int64_t slab_rows = num_local * num_ranks * max_tokens;
  for (int b = 0; b < 2; ++b) {
    l.ll_dispatch_rows[b] = at;
    at += AlignRegion(slab_rows * l.ll_row_bytes);
    l.ll_dispatch_meta[b] = at;
    at += AlignRegion(slab_rows * 4);
    l.ll_combine_rows[b] = at;
    at += AlignRegion(
        low_latency_experts > 0 ? max_tokens * num_topk * l.ll_row_bytes : 0);
  }
  l.ll_send_counts = at;
  at += AlignRegion(low_latency_experts * 4);
  l.ll_recv_start = at;
  at += AlignRegion(low_latency_experts > 0 ? num_local * (num_ranks + 1) * 4
                                            : 0);
  l.ll_flags = at;
  at += AlignRegion(low_latency_experts > 0
                        ? (2 * num_local * num_ranks + 2 * num_ranks) * 8
                        : 0);
  const bool outbox = network && low_latency_experts > 0;
  for (int op = 0; op < 2; ++op) {
    l.ll_outbox_rows[op] = at;
    at += AlignRegion(outbox ? slab_rows * l.ll_row_bytes : 0);
  }
  l.ll_outbox_meta = at;
  at += AlignRegion(outbox ? slab_rows * 4 : 0);
  l.ll_outbox_counts = at;
  at += AlignRegion(outbox ? low_latency_experts * 4 : 0);
  const bool rail = network && num_hosts >= 2;
  l.rail_record_bytes = rail ? RailRecordBytes(hidden, itemsize, num_topk) : 0;
  const int64_t rail_bytes =
      rail ? num_hosts * max_tokens * l.rail_record_bytes : 0;
  for (int b = 0; b < 2; ++b) {
    l.rail_inbox[b] = at;
    at += AlignRegion(rail_bytes);
  }
  l.rail_outbox = at;
  at += AlignRegion(rail_bytes);
  l.rail_flags = at;
  at += AlignRegion(rail ? 2 * num_hosts * 8 : 0);
  l.total = at;
  return l;
}

}  // namespace jax_ep::group

#endif  // JAX_EP_FFI_KERNELS_GROUP_BUFFER_LAYOUT_H_
