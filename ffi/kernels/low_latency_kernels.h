// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::low_latency: the decode-time dispatch / combine over a native
// group's low-latency buffers (BufferLayout::ll_*, group_buffer_layout.h):
// every address is known before the call, so the send is the first action;
// each op is a send and a wait, two launchers (and two custom calls) so that
// independent work can run between them. Protocol: the NOTES of
// ffi/kernels/low_latency_protocol.cuh; kernels: low_latency_dispatch.cu,
// low_latency_combine.cu and, at one rank, low_latency_local.cu.
// Slots of one token that name the same expert are one row (the first slot's).

#ifndef JAX_EP_FFI_KERNELS_LOW_LATENCY_KERNELS_H_
#define JAX_EP_FFI_KERNELS_LOW_LATENCY_KERNELS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/group_view.h"

namespace jax_ep::low_latency {

// Rows of a low-latency dispatch's output: plain (x's dtype), or e4m3 with one
// float32 scale per 128 channels (kFp8: amax / 448; kFp8PowerOfTwo: rounded up
// to a power of two).
enum class RowFormat : int32_t { kPlain = 0, kFp8 = 1, kFp8PowerOfTwo = 2 };

// Sends every token's row to the rank of each expert it selects, at
// ll_dispatch_rows[set][l][this rank][j] (j: the token's position among this
// rank's tokens that select the expert), then each (rank, local expert)'s
// count as its arrival flag. `slot_scale` (`[T, K]` float32, may be null;
// plain rows only) multiplies the row sent for slot k (the weighted dispatch
// of combine's gradient). num_invalid `[]` int32 out: ids < -1 or >= E.
cudaError_t DispatchSend(const group::GroupView& g, ElementType dtype,
                         RowFormat format, const void* x,
                         const int32_t* topk_idx, const float* slot_scale,
                         int64_t num_tokens, int32_t* num_invalid,
                         cudaStream_t stream);

// Waits for every source's counts and packs expert l's rows at the front of
// recv_x[l] in (source rank, source token) order.
//   recv_x     `[L, R*T_max, H]` x dtype or e4m3 out (rows past count[l] are
//              left as they were)
//   scales     `[L, R*T_max, H/128]` float32, or UE8M0 `[L, R*T_max, H/512]`
//              int32 with `ue8m0` (fp8 formats only; may be null otherwise)
//   count      `[L]` int32 out   recv_src `[L, R*T_max]` int32 out:
//              s * T_max * K + t * K + k of each row, -1 past count
//   status     `[]` int32 out: 0 ok, 1 the group failed
cudaError_t DispatchWait(const group::GroupView& g, ElementType dtype,
                         RowFormat format, bool ue8m0, void* recv_x,
                         void* scales, int32_t* count, int32_t* recv_src,
                         int32_t* status, cudaStream_t stream);

// Sends each valid row (l, i < count[l]) of expert_out `[L, R*T_max, H]` to
// its token's home rank (recv_src), then the arrival flag of every home.
cudaError_t CombineSend(const group::GroupView& g, ElementType dtype,
                        const void* expert_out, const int32_t* recv_src,
                        const int32_t* count, cudaStream_t stream);

// Waits for every rank's rows; out[t] = sum over k ascending of
// weights[t, k] * row(t, k) in fp32, rounded once (`[T, H]`; the row of a
// slot is the one of the first slot of t that names the same expert; slots
// with ids outside [0, E) add nothing). With `gather`, out is `[T, K, H]`:
// row(t, k) itself, zeros for slots that select nothing (weights unread).
cudaError_t CombineWait(const group::GroupView& g, ElementType dtype,
                        const int32_t* topk_idx, const float* weights,
                        int64_t num_tokens, int64_t num_experts, bool gather,
                        void* out, int32_t* status, cudaStream_t stream);

// One rank (g.num_ranks == 1): the fused dispatch written straight into its
// outputs (DispatchWait's, plus num_invalid), with no buffer, flags or copy;
// rows past count[l] are left as they were, recv_src is -1 there. Takes
// DispatchSend's inputs and needs no wait.
cudaError_t DispatchLocal(const group::GroupView& g, ElementType dtype,
                          RowFormat format, bool ue8m0, const void* x,
                          const int32_t* topk_idx, const float* slot_scale,
                          int64_t num_tokens, void* recv_x, void* scales,
                          int32_t* count, int32_t* recv_src,
                          int32_t* num_invalid, int32_t* status,
                          cudaStream_t stream);

// One rank: the fused combine, reading each slot's row straight from
// expert_out `[L, T_max, H]` (where DispatchLocal / the packed slabs put it);
// CombineWait's outputs and semantics.
cudaError_t CombineLocal(const group::GroupView& g, ElementType dtype,
                         const void* expert_out, const int32_t* topk_idx,
                         const float* weights, int64_t num_tokens,
                         int64_t num_experts, bool gather, void* out,
                         int32_t* status, cudaStream_t stream);

cudaError_t PreloadKernels();

// Local memory per thread of the most demanding kernel above, as the last
// PreloadKernels found it: 0 by design (a kernel that needs local memory can,
// on its first launch, wait for a GPU shared under MPS to drain, peers'
// spinning waits included).
size_t MaxLocalBytes();

}  // namespace jax_ep::low_latency

#endif  // JAX_EP_FFI_KERNELS_LOW_LATENCY_KERNELS_H_
