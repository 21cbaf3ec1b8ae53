// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The one declaration header for every jax_ep kernel launcher.
//
// Framework-free on purpose: raw device pointers, `cudaStream_t`, launchers
// return `cudaError_t` and never throw. No XLA, nanobind or Python header may
// be included here (the FFI adapters in ffi/handlers/ are the only layer that
// knows about XLA). Launchers are grouped by op family, one namespace each,
// and every launcher's kernels live in the .cu file of the same name
// (`jax_ep::layout` -> ffi/kernels/layout.cu, `jax_ep::local` ->
// ffi/kernels/local.cu).
//
// Batching: every launcher takes `num_batches`, the product of the leading
// batch dims a `vmap` added to every operand. Batch element `b` of an operand
// of per-element size `n` starts at `ptr + b * n`; all batch elements run in
// one launch.
//
// Shape names follow DESIGN.md: `num_tokens` (T), `num_topk` (K),
// `num_experts` (E), `hidden` (H), `capacity` (rows of the expert-grouped
// buffer).

#ifndef JAX_EP_FFI_KERNELS_EP_KERNELS_H_
#define JAX_EP_FFI_KERNELS_EP_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_ep {

// Element types of the activation tensors (`x`, `recv_x`, `expert_out`...).
enum class ElementType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

// Limits shared by every op; the FFI handlers reject anything outside them.
inline constexpr int64_t kMaxExperts = 1024;
inline constexpr int64_t kMaxTopk = 32;
// Rows are moved as 16-byte vectors; `hidden` must be a multiple of this many
// elements for every element type (8 x bf16 = 16 bytes, 8 x f32 = 2 vectors).
inline constexpr int64_t kHiddenMultiple = 8;

// ---------------------------------------------------------------------------
// Layout: slot -> row assignment of the expert-grouped buffer (one rank).
// ---------------------------------------------------------------------------
namespace layout {

// NOTES: the slots `(t, k)` of one batch element are processed in chunks of
// `LocalLayoutChunkSlots(T * K)` consecutive row-major slots, one thread block
// per chunk. The chunk grows with T * K so that there are never more than
// `kMaxChunks` chunks: that bounds the serial part of the per-expert scan over
// chunks. Both functions are pure host arithmetic, safe to call anywhere.
inline constexpr int64_t kThreads = 256;          // 8 warps per block.
inline constexpr int64_t kWarps = kThreads / 32;
inline constexpr int64_t kMinChunkSlots = 1024;   // Multiple of kThreads.
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

// Assigns every valid slot a row of the expert-grouped buffer (see DESIGN.md
// and the `jax_ep_local_layout` handler): rows grouped by expert ascending,
// (t, k) ascending inside one expert; rows >= capacity are dropped.
//
// Per batch element:
//   topk_idx      `[T, K]` int32 in; ids < -1 or >= E are counted as invalid.
//   slot_row      `[T, K]` int32 out; row of the slot or -1.
//   group_sizes   `[E]`    int32 out; kept rows per expert.
//   num_dropped   `[]`     int32 out; valid slots with row >= capacity.
//   num_invalid   `[]`     int32 out; slots with id < -1 or id >= E.
//   workspace     `[LocalLayoutWorkspaceElems(T, K, E)]` int32 scratch.
// Requires 1 <= E <= kMaxExperts, T * K < 2^31, capacity >= 0.
// Deterministic: no atomic decides an order.
cudaError_t LocalLayout(const int32_t* topk_idx, int32_t* slot_row,
                        int32_t* group_sizes, int32_t* num_dropped,
                        int32_t* num_invalid, int32_t* workspace,
                        int64_t num_batches, int64_t num_tokens,
                        int64_t num_topk, int64_t num_experts,
                        int64_t capacity, cudaStream_t stream);

}  // namespace layout

// ---------------------------------------------------------------------------
// Local (one rank) row movement between token order and expert-grouped order.
// ---------------------------------------------------------------------------
namespace local {

// recv_x[slot_row[t, k]] = x[t] (* slot_weights[t, k] in fp32, rounded once,
// when `weighted`) for every slot with 0 <= slot_row < capacity; rows
// [min(sum(group_sizes), capacity), capacity) are zero-filled. Each x row is
// read once.
//   x            `[T, H]` dtype      in
//   slot_row     `[T, K]` int32      in
//   group_sizes  `[E]`    int32      in
//   slot_weights `[T, K]` float32    in (not read when !weighted; may be null)
//   recv_x       `[capacity, H]` dtype out
// All activation pointers must be 16-byte aligned and H % kHiddenMultiple == 0.
cudaError_t Permute(ElementType dtype, const void* x, const int32_t* slot_row,
                    const int32_t* group_sizes, const float* slot_weights,
                    void* recv_x, int64_t num_batches, int64_t num_tokens,
                    int64_t num_topk, int64_t num_experts, int64_t hidden,
                    int64_t capacity, bool weighted, cudaStream_t stream);

// out[t] = sum_{k ascending, slot_row[t,k] >= 0} w[t,k] * expert_out[slot_row]
// with w = slot_weights when `weighted`, else 1; fp32 accumulation with one
// fmaf per (k, element) in k-ascending order, rounded to dtype once. Tokens
// without a valid slot get zeros.
//   expert_out   `[capacity, H]` dtype in
//   slot_row     `[T, K]` int32      in
//   slot_weights `[T, K]` float32    in (not read when !weighted; may be null)
//   out          `[T, H]` dtype      out
cudaError_t Unpermute(ElementType dtype, const void* expert_out,
                      const int32_t* slot_row, const float* slot_weights,
                      void* out, int64_t num_batches, int64_t num_tokens,
                      int64_t num_topk, int64_t hidden, int64_t capacity,
                      bool weighted, cudaStream_t stream);

// dots[t, k] = sum_h float(d_out[t, h]) * float(expert_out[slot_row[t, k], h])
// in fp32 (fixed per-thread order, then a fixed tree), 0 where slot_row < 0.
//   d_out        `[T, H]` dtype      in
//   expert_out   `[capacity, H]` dtype in
//   slot_row     `[T, K]` int32      in
//   dots         `[T, K]` float32    out
cudaError_t SlotDots(ElementType dtype, const void* d_out,
                     const void* expert_out, const int32_t* slot_row,
                     float* dots, int64_t num_batches, int64_t num_tokens,
                     int64_t num_topk, int64_t hidden, int64_t capacity,
                     cudaStream_t stream);

}  // namespace local

}  // namespace jax_ep

#endif  // JAX_EP_FFI_KERNELS_EP_KERNELS_H_
