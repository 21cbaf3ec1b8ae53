// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::local: row movement at one rank between token order and the
// expert-grouped order (kernels: ffi/kernels/local_*.cu; handlers:
// jax_ep_local_dispatch, _combine, _combine_vjp). The peer transport
// places received rows with local::Dispatch too. Element types, limits and
// the batching convention: ep_common.h.

#ifndef JAX_EP_FFI_KERNELS_LOCAL_KERNELS_H_
#define JAX_EP_FFI_KERNELS_LOCAL_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/fp8_rows.h"

namespace jax_ep::local {

// Tokens of a peer placement (local::Dispatch of received rows) whose
// rows the caller has already placed in `recv_x` (a dispatch places its own
// rank's tokens while its rows travel): tokens n in [begin, begin + count) are
// neither read nor written. Only with x_from_peers and one batch element
// (Dispatch refuses it otherwise, and a range outside [0, num_tokens]).
struct PlacedTokens {
  int64_t begin = 0;
  int64_t count = 0;
};

// recv_x[slot_row[t, k]] = x[t] (* slot_weights[t, k] in fp32, rounded once,
// when `weighted`) for every slot with 0 <= slot_row < capacity; no other row
// is written (rows past the used ones are unspecified). Each x row is read
// once.
//   x            `[T, H]` dtype      in
//   slot_row     `[T, K]` int32      in
//   slot_weights `[T, K]` float32    in (not read when !weighted; may be null)
//   recv_x       `[capacity, H]` dtype out
// All activation pointers must be 16-byte aligned and H % kHiddenMultiple == 0.
// Tokens none of whose slots has a row are not read at all.
// `x_from_peers`: `x` is a peer-transport receive buffer that other GPUs wrote
// (before this kernel was launched): its rows are read with ld.global.cg
// (L2, no L1 / non-coherent cache) instead of ld.global.nc.
// `placed`: see PlacedTokens.
cudaError_t Dispatch(ElementType dtype, const void* x, const int32_t* slot_row,
                     const float* slot_weights,
                     void* recv_x, int64_t num_batches, int64_t num_tokens,
                     int64_t num_topk, int64_t num_experts, int64_t hidden,
                     int64_t capacity, bool weighted, cudaStream_t stream,
                     bool x_from_peers = false,
                     const PlacedTokens& placed = {});

// Dispatch of fp8 rows (the high-throughput dispatch's fp8 wire formats,
// fp8_rows.h): for every slot with 0 <= slot_row < capacity,
// recv_x[slot_row[t, k]] = token t's e4m3 bytes and
// recv_scales[slot_row[t, k]] = its scales; no other row is written. Each
// token is read once, quantised at most once. `rows` (fp8::Rows):
//   kQuantize  x `[T, H]` rows.dtype, quantised here (fp8_quantize.cuh)
//   kGiven     x `[T, H]` e4m3 and scales `[T, ScaleBytes / 4]` 32-bit words
//   kPacked    x `[T, RowBytes]` packed wire rows of a peer staging buffer
//              (x_from_peers: written by other GPUs, read through L2)
//   slot_row    `[T, K]` int32 in
//   recv_x      `[capacity, H]` e4m3 out
//   recv_scales `[capacity, ScaleBytes / 4]` float32 or int32 (UE8M0) out
// H a multiple of 128 (512 for UE8M0); pointers 16-byte aligned. Batch dims
// as Dispatch's (kQuantize and kGiven); `placed` only with kPacked.
cudaError_t DispatchFp8(const fp8::Rows& rows, const int32_t* slot_row,
                        void* recv_x, void* recv_scales, int64_t num_batches,
                        int64_t num_tokens, int64_t num_topk, int64_t hidden,
                        int64_t capacity, cudaStream_t stream,
                        bool x_from_peers = false,
                        const PlacedTokens& placed = {});

// out[t] = sum_{k ascending, slot_row[t,k] >= 0} w[t,k] * expert_out[slot_row]
// with w = slot_weights when `weighted`, else 1; fp32 accumulation with one
// fmaf per (k, element) in k-ascending order, rounded to dtype once. Tokens
// without a valid slot get zeros.
//   expert_out   `[capacity, H]` dtype in
//   slot_row     `[T, K]` int32      in
//   slot_weights `[T, K]` float32    in (not read when !weighted; may be null)
//   out          `[T, H]` dtype      out
cudaError_t Combine(ElementType dtype, const void* expert_out,
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
cudaError_t CombineVjp(ElementType dtype, const void* d_out,
                       const void* expert_out, const int32_t* slot_row,
                       float* dots, int64_t num_batches, int64_t num_tokens,
                       int64_t num_topk, int64_t hidden, int64_t capacity,
                       cudaStream_t stream);

// Forces the module load of every kernel of this family on the current
// device (cudaFuncGetAttributes), so no lazy load happens later.
cudaError_t PreloadKernels();

}  // namespace jax_ep::local

#endif  // JAX_EP_FFI_KERNELS_LOCAL_KERNELS_H_
