// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer: multi-rank dispatch / combine through a table of peer
// pointers (CUDA IPC or P2P). Protocol: docs/intranode.md and the NOTES of
// ffi/kernels/peer_protocol.cuh; kernels: ffi/kernels/peer_*.cu.
// The group these launchers take: group_view.h; its host-side
// set-up (allocation, IPC, registry): ffi/runtime/group.h.

#ifndef JAX_EP_FFI_KERNELS_PEER_KERNELS_H_
#define JAX_EP_FFI_KERNELS_PEER_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/fp8_rows.h"
#include "ffi/kernels/group_view.h"
#include "ffi/kernels/layout_kernels.h"

namespace jax_ep::peer {

// The group's types (its view, buffer layout, state and mailbox) are the peer
// protocol's vocabulary: named here unqualified, as in group_view.h.
using namespace ::jax_ep::group;  // NOLINT(build/namespaces)

// The `workspace` result of jax_ep_peer_dispatch (int32 elements),
// sized and carved in this one place: offsets of its parts, in order, and the
// total. NOTES: Dispatch carves its pointers from these offsets and the
// handler sizes the result from `elems`, so the two cannot disagree.
inline constexpr int64_t kSendTileTokens = 512;
inline int64_t DispatchSendTiles(int64_t max_tokens) {
  const int64_t tiles = (max_tokens + kSendTileTokens - 1) / kSendTileTokens;
  return tiles > 1 ? tiles : 1;
}
struct DispatchWorkspace {
  int64_t count_to;        // [R] tokens sent to each rank
  int64_t layout_dropped;  // [R] layout scratch (never drops)
  int64_t layout_invalid;  // [R] layout scratch (invalid ids counted apart)
  int64_t source_chunks;   // [R] chunks of each source
  int64_t chunk_start;     // [R, T_max + 1] send position of each chunk's
                           // first token per destination
  int64_t dest_ids;        // [R, T_max, K] the slots' local expert ids per
                           // destination (-1 for other ranks' slots)
  int64_t slot_rank;       // [R, T_max, K] each slot's row in this rank's
                           // expert-grouped order of what it sends there
  int64_t dest_counts;     // [R, E/R] slots per (destination, local expert)
  int64_t offset;          // [R, E/R] receive offsets per (source, expert)
  int64_t tile_count;      // [R, tiles] tokens of each tile of
                           // kSendTileTokens tokens that go to each rank
  int64_t invalid_count;   // [tiles] invalid ids per tile
  int64_t layout;          // the batched local layout's workspace (R batches
                           // of up to T_max rows of K slots over E/R experts)
  int64_t elems;           // the total
};
inline DispatchWorkspace MakeDispatchWorkspace(int64_t num_ranks,
                                               int64_t max_tokens,
                                               int64_t num_topk,
                                               int64_t num_experts) {
  DispatchWorkspace w;
  int64_t at = 0;
  const auto take = [&at](int64_t elems) {
    const int64_t here = at;
    at += elems;
    return here;
  };
  const int64_t slots = num_ranks * max_tokens * num_topk;
  w.count_to = take(num_ranks);
  w.layout_dropped = take(num_ranks);
  w.layout_invalid = take(num_ranks);
  w.source_chunks = take(num_ranks);
  w.chunk_start = take(num_ranks * (max_tokens + 1));
  w.dest_ids = take(slots);
  w.slot_rank = take(slots);
  w.dest_counts = take(num_experts);
  w.offset = take(num_experts);
  w.tile_count = take(num_ranks * DispatchSendTiles(max_tokens));
  w.invalid_count = take(DispatchSendTiles(max_tokens));
  w.layout =
      take(num_ranks * layout::LocalLayoutMaxWorkspaceElems(
                           max_tokens, num_topk, num_experts / num_ranks));
  w.elems = at;
  return w;
}
inline int64_t DispatchWorkspaceElems(int64_t num_ranks, int64_t max_tokens,
                                      int64_t num_topk, int64_t num_experts) {
  return MakeDispatchWorkspace(num_ranks, max_tokens, num_topk, num_experts)
      .elems;
}

// Forces the module load of every kernel the peer ops launch (this
// family's, the layout kernels and the local kernels) on the current device.
cudaError_t PreloadKernels();

// Notify + dispatch + layout (jax_ep_peer_dispatch). Per rank:
//   x             `[T, H]`   dtype   in      topk_idx `[T, K]` int32 in
//   topk_weights  `[T, K]`   float32 in
//   recv_x        `[capacity, H]` dtype out  group_sizes `[E/R]` int32 out
//   num_dropped, num_invalid `[]` int32 out
//   send_pos      `[T, R]`   int32 out: position of t in the send list for d
//   entry_row     `[R*T_max, K]` int32 out: row of recv_x of entry (s, i, k)
//   entry_weights `[R*T_max, K]` float32 out (0 where no entry)
//   recv_counts   `[R]` int32 out        status `[]` int32 out (0 ok)
//   workspace     `[DispatchWorkspaceElems(R, T_max, K, E)]` int32 scratch
cudaError_t Dispatch(const GroupView& g, ElementType dtype, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     int64_t num_tokens, int64_t num_experts, int64_t capacity,
                     void* recv_x, int32_t* group_sizes, int32_t* num_dropped,
                     int32_t* num_invalid, int32_t* send_pos,
                     int32_t* entry_row, float* entry_weights,
                     int32_t* recv_counts, int32_t* status, int32_t* workspace,
                     cudaStream_t stream);

// Dispatch of fp8 rows (jax_ep_peer_dispatch_fp8): Dispatch's protocol,
// layout and outputs, each token travelling as one packed wire row of
// fp8::RowBytes(H, src.format) bytes (fp8_rows.h), quantised once by its
// sender (kQuantize: `src.x` `[T, H]` of src.dtype, the group's itemsize) or
// taken as given (kGiven: `src.x` `[T, H]` e4m3 and `src.scales`
// `[T, ScaleBytes / 4]`), and split on arrival:
//   recv_x      `[capacity, H]` e4m3 out
//   recv_scales `[capacity, ScaleBytes / 4]` float32 / int32 (UE8M0) out
// the other arguments as Dispatch's. H a multiple of 128 (512 for UE8M0).
// The layout results are Dispatch's: the combine and the cached dispatch
// take them as they are.
cudaError_t DispatchFp8(const GroupView& g, const fp8::Rows& src,
                        const int32_t* topk_idx, const float* topk_weights,
                        int64_t num_tokens, int64_t num_experts,
                        int64_t capacity, void* recv_x, void* recv_scales,
                        int32_t* group_sizes, int32_t* num_dropped,
                        int32_t* num_invalid, int32_t* send_pos,
                        int32_t* entry_row, float* entry_weights,
                        int32_t* recv_counts, int32_t* status,
                        int32_t* workspace, cudaStream_t stream);

// Dispatch with the layout of an earlier Dispatch
// (jax_ep_peer_dispatch_cached): rows only; entry (s, i, k) lands at
// entry_row (times entry_weights in fp32, rounded once, when `weighted`); rows
// >= sum(group_sizes) are not written (unspecified).
//   x `[T, H]`, send_pos `[T, R]`, entry_row / entry_weights `[R*T_max, K]`
//   (rows past each source's count are -1 there), group_sizes `[L]` in;
//   recv_x `[capacity, H]`, status out.
cudaError_t DispatchCached(const GroupView& g, ElementType dtype, const void* x,
                           const int32_t* send_pos, const int32_t* entry_row,
                           const float* entry_weights,
                           const int32_t* group_sizes, int64_t num_tokens,
                           int64_t num_local_experts, int64_t capacity,
                           bool weighted, void* recv_x, int32_t* status,
                           cudaStream_t stream);

// Combine (jax_ep_peer_combine): expert side reduces each received token's
// rows over k ascending in fp32 (weighted or not) and writes one partial row
// to its home (bf16 for bf16 activations, else fp32: CombineWire); home sums
// the partials of ranks d ascending in fp32, rounds once.
//   expert_out `[capacity, H]` in; entry_row, entry_weights, recv_counts,
//   send_pos `[T, R]` in; out `[T, H]`, status out.
cudaError_t Combine(const GroupView& g, ElementType dtype,
                    const void* expert_out, const int32_t* entry_row,
                    const float* entry_weights, const int32_t* recv_counts,
                    const int32_t* send_pos, int64_t num_tokens,
                    int64_t capacity, bool weighted, void* out, int32_t* status,
                    cudaStream_t stream);

// Cotangents of the weighted combine (jax_ep_peer_combine_vjp):
//   d_expert_out `[capacity, H]` = weighted cached dispatch of d_out `[T, H]`;
//   d_weights `[T, K]` float32 = <d_out[t], expert_out[row(t, k)]> (0 for
//   slots that select nothing or were dropped), dot taken on the expert side.
cudaError_t CombineVjp(const GroupView& g, ElementType dtype, const void* d_out,
                       const void* expert_out, const int32_t* topk_idx,
                       const int32_t* send_pos, const int32_t* entry_row,
                       const float* entry_weights, const int32_t* recv_counts,
                       const int32_t* group_sizes, int64_t num_tokens,
                       int64_t num_experts, int64_t capacity,
                       void* d_expert_out, float* d_weights, int32_t* status,
                       cudaStream_t stream);

}  // namespace jax_ep::peer

#endif  // JAX_EP_FFI_KERNELS_PEER_KERNELS_H_
