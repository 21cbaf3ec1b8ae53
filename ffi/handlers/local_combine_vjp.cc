// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_local_combine_vjp` (kernels: ffi/kernels/local_*.cu).
// Gradient of combine w.r.t. the router weights.
//
//   d_out      `[B..., T, H]` bf16/f16/f32 operand (cotangent of combine)
//   expert_out `[B..., capacity, H]` d_out.dtype operand
//   slot_row   `[B..., T, K]` int32 operand (from jax_ep_local_layout)
//   dots       `[B..., T, K]` float32:
//              dots[t, k] = <d_out[t], expert_out[slot_row[t, k]]> in fp32,
//              0 where slot_row[t, k] < 0.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/handlers.h"
#include "ffi/kernels/local_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using ffi_utils::CheckBatchDims;
using ffi_utils::CheckDim;
using ffi_utils::CheckRank;

constexpr char kOp[] = "jax_ep_local_combine_vjp";

ffi::Error LocalCombineVjpImpl(cudaStream_t stream, ffi::AnyBuffer d_out,
                               ffi::AnyBuffer expert_out,
                               ffi::Buffer<ffi::S32> slot_row,
                               ffi::ResultBuffer<ffi::F32> dots) {
  ffi_utils::LeadingOperand lead;
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckLeadingOperand(
      kOp, "d_out", "[B..., T, H]", d_out, &lead));
  const auto& [d_dims, nb, num_tokens, hidden, dtype] = lead;

  const auto e_dims = expert_out.dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "expert_out", e_dims, nb, 2, "[B..., capacity, H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(kOp, "expert_out", e_dims, "d_out", d_dims, nb));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckDim(kOp, "expert_out", e_dims, nb + 1, "H", hidden, "d_out H"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckSameDtype(kOp, "expert_out", expert_out.element_type(),
                                "d_out", d_out.element_type()));
  const int64_t capacity = e_dims[nb];

  int64_t num_topk = 0;
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSlotRows(
      kOp, "slot_row", slot_row.dimensions(), "d_out", lead, num_tokens,
      "d_out T", nullptr, &num_topk));

  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSlotsShape(
      kOp, "dots", dots->dimensions(), "d_out", d_dims, nb, num_tokens,
      "d_out T", num_topk, "slot_row K"));

  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "d_out", d_out.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "expert_out", expert_out.untyped_data()));

  const int64_t num_batches = ffi_utils::NumBatches(d_dims, nb);
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp,
      local::CombineVjp(dtype, d_out.untyped_data(), expert_out.untyped_data(),
                        slot_row.typed_data(), dots->typed_data(), num_batches,
                        num_tokens, num_topk, hidden, capacity, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpLocalCombineVjp, jax_ep::LocalCombineVjpImpl,
    .Arg<xla::ffi::AnyBuffer>()                     // d_out
    .Arg<xla::ffi::AnyBuffer>()                     // expert_out
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // slot_row
    .Ret<xla::ffi::Buffer<xla::ffi::F32>>());       // dots
