// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::layout: the slot -> row assignment of the expert-grouped buffer at
// one rank (kernels: ffi/kernels/layout.cu; handler: jax_ep_local_layout).
// Element types, limits and the batching convention: ep_common.h.

#ifndef JAX_EP_FFI_KERNELS_LAYOUT_KERNELS_H_
#define JAX_EP_FFI_KERNELS_LAYOUT_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_common.h"

namespace jax_ep::layout {

// NOTES: the slots `(t, k)` of one batch element are processed in chunks of
// `LocalLayoutChunkSlots(T * K)` consecutive row-major slots, one thread block
// per chunk. The chunk grows with T * K so that there are never more than
// `kMaxChunks` chunks: that bounds the serial part of the per-expert scan over
// chunks. Both functions are pure host arithmetic, safe to call anywhere.
inline constexpr int64_t kThreads = 256;  // 8 warps per block.
inline constexpr int64_t kWarps = kThreads / 32;
inline constexpr int64_t kMinChunkSlots = 1024;  // Multiple of kThreads.
inline constexpr int64_t kMaxChunks = 512;

inline int64_t LocalLayoutChunkSlots(int64_t num_slots) {
  int64_t slots = (num_slots + kMaxChunks - 1) / kMaxChunks;
  if (slots < kMinChunkSlots) slots = kMinChunkSlots;
  return (slots + kThreads - 1) / kThreads * kThreads;
}

inline int64_t LocalLayoutNumChunks(int64_t num_slots) {
  const int64_t chunk = LocalLayoutChunkSlots(num_slots);
  return (num_slots + chunk - 1) / chunk;
}

// Elements of the int32 scratch buffer `LocalLayout` needs PER BATCH ELEMENT:
// per-chunk counts `[num_chunks, E + 1]` (column E counts invalid ids) followed
// by per-expert totals `[E + 1]`, i.e. `(num_chunks + 1) * (E + 1)`.
inline int64_t LocalLayoutWorkspaceElems(int64_t num_tokens, int64_t num_topk,
                                         int64_t num_experts) {
  return (LocalLayoutNumChunks(num_tokens * num_topk) + 1) * (num_experts + 1);
}

// An upper bound of LocalLayoutWorkspaceElems(T, K, E) over every T <=
// max_tokens, for a workspace sized once and used with any T up to it.
// NOTES: LocalLayoutWorkspaceElems is not monotone in T once T * K passes
// kMaxChunks * kMinChunkSlots (the chunk size is rounded up to whole blocks,
// so a smaller T can need more chunks); below that the chunks are
// ceil(T * K / kMinChunkSlots), above it at most kMaxChunks.
inline int64_t LocalLayoutMaxWorkspaceElems(int64_t max_tokens,
                                            int64_t num_topk,
                                            int64_t num_experts) {
  const int64_t max_slots = max_tokens * num_topk;
  const int64_t chunks = max_slots <= kMaxChunks * kMinChunkSlots
                             ? (max_slots + kMinChunkSlots - 1) / kMinChunkSlots
                             : kMaxChunks;
  return (chunks + 1) * (num_experts + 1);
}

// Assigns every valid slot a row of the expert-grouped buffer (see DESIGN.md
// and the `jax_ep_local_layout` handler): rows grouped by expert ascending,
// (t, k) ascending inside one expert, each expert's first row a multiple of
// `expert_alignment` (the exclusive scan of the counts, each rounded up to a
// multiple of it); rows >= capacity are dropped.
//
// Per batch element:
//   topk_idx      `[T, K]` int32 in; ids < -1 or >= E are counted as invalid.
//   slot_row      `[T, K]` int32 out; row of the slot or -1.
//   group_sizes   `[E]`    int32 out; kept rows per expert.
//   num_dropped   `[]`     int32 out; valid slots with row >= capacity.
//   num_invalid   `[]`     int32 out; slots with id < -1 or id >= E.
//   workspace     `[LocalLayoutWorkspaceElems(T, K, E)]` int32 scratch.
// Requires 1 <= E <= kMaxExperts, T * K <= kMaxSlots, capacity >= 0,
// 1 <= expert_alignment <= kMaxExpertAlignment.
// Deterministic: no atomic decides an order.
cudaError_t LocalLayout(const int32_t* topk_idx, int32_t* slot_row,
                        int32_t* group_sizes, int32_t* num_dropped,
                        int32_t* num_invalid, int32_t* workspace,
                        int64_t num_batches, int64_t num_tokens,
                        int64_t num_topk, int64_t num_experts, int64_t capacity,
                        int64_t expert_alignment, cudaStream_t stream);

// Forces the module load of every kernel of this family on the current
// device (cudaFuncGetAttributes), so no lazy load happens later.
cudaError_t PreloadKernels();

}  // namespace jax_ep::layout

#endif  // JAX_EP_FFI_KERNELS_LAYOUT_KERNELS_H_
