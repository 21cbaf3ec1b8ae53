// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// What every kernel family shares: the element types of the activations and
// the limits the FFI handlers check on every call (ffi/module.cc exports them
// as the one table of limits, jax_ep/_native/limits.py reads it).
//
// Framework-free on purpose, as is every declaration header of ffi/kernels/:
// raw device pointers, `cudaStream_t`, launchers return `cudaError_t` and
// never throw. No XLA, nanobind or Python header may be included here (the
// FFI adapters in ffi/handlers/ are the only layer that knows about XLA).
// Launchers are declared per op family, one header and namespace each:
// layout_kernels.h (layout), local_kernels.h (local), peer_kernels.h
// (peer), low_latency_kernels.h (low_latency), rail_kernels.h (rail).
//
// Batching: every layout / local launcher takes `num_batches`, the product of
// the leading batch dims a `vmap` added to every operand. Batch element `b` of
// an operand of per-element size `n` starts at `ptr + b * n`; all batch
// elements run in one launch. The peer launchers (peer, low_latency,
// rail) take no batch.
//
// Shape names follow DESIGN.md: `num_tokens` (T), `num_topk` (K),
// `num_experts` (E), `hidden` (H), `capacity` (rows of the expert-grouped
// buffer).

#ifndef JAX_EP_FFI_KERNELS_EP_COMMON_H_
#define JAX_EP_FFI_KERNELS_EP_COMMON_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

// Element types of the activation tensors (`x`, `recv_x`, `expert_out`...).
enum class ElementType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

// Limits shared by every op; the FFI handlers reject anything outside them.
inline constexpr int64_t kMaxExperts = 1024;
inline constexpr int64_t kMaxTopk = 32;
// Most slots (T * K) one call may have per batch element (per rank for the
// peer transport's received entries, R * T_max * K). NOTES: int32 slot
// indices with headroom: the layout's last chunk ends at most one chunk (<=
// 2^22 slots) past T * K, which must still fit int32.
inline constexpr int64_t kMaxSlots = int64_t{1} << 30;
// Rows are moved as 16-byte vectors; `hidden` must be a multiple of this many
// elements for every element type (8 x bf16 = 16 bytes, 8 x f32 = 2 vectors).
inline constexpr int64_t kHiddenMultiple = 8;
// Rows of `recv_x` (capacity): row indices are int32.
inline constexpr int64_t kMaxCapacity = INT32_MAX;
// The SM budget of a native group's send kernels (num_sms): far above any
// GPU's multiprocessor count, and keeps every send grid well inside int32.
inline constexpr int64_t kMaxNumSms = 1024;
// expert_alignment (each expert's rows of recv_x start at a multiple of it):
// jax_ep.config.MAX_EXPERT_ALIGNMENT. NOTES: the rows plus the padding
// (< kMaxExperts * kMaxExpertAlignment = 2^26 rows) stay inside int32 row
// indices for every slot count up to kMaxSlots.
inline constexpr int64_t kMaxExpertAlignment = int64_t{1} << 16;

}  // namespace jax_ep

#endif  // JAX_EP_FFI_KERNELS_EP_COMMON_H_
