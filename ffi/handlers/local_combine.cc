// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_local_combine` (kernels: ffi/kernels/local_*.cu).
// Combine on one rank.
//
//   expert_out   `[B..., capacity, H]` bf16/f16/f32 operand
//   slot_row     `[B..., T, K]` int32 operand (from jax_ep_local_layout)
//   slot_weights `[B..., T, K]` float32 operand, read only when `weighted`
//   attrs        weighted: bool
//   out          `[B..., T, H]` expert_out.dtype:
//                out[t] = sum_{k asc, slot_row >= 0} w[t, k] * expert_out[row]
//                accumulated in fp32 (one fmaf per slot), rounded once.

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

constexpr char kOp[] = "jax_ep_local_combine";

ffi::Error LocalCombineImpl(cudaStream_t stream, ffi::AnyBuffer expert_out,
                            ffi::Buffer<ffi::S32> slot_row,
                            ffi::Buffer<ffi::F32> slot_weights,
                            ffi::Result<ffi::AnyBuffer> out, bool weighted) {
  ffi_utils::LeadingOperand lead;
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckLeadingOperand(
      kOp, "expert_out", "[B..., capacity, H]", expert_out, &lead));
  const auto& [e_dims, nb, capacity, hidden, dtype] = lead;

  int64_t num_tokens = 0;
  int64_t num_topk = 0;
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSlotRows(
      kOp, "slot_row", slot_row.dimensions(), "expert_out", lead, -1, "",
      &num_tokens, &num_topk));

  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSlotsShape(
      kOp, "slot_weights", slot_weights.dimensions(), "expert_out", e_dims, nb,
      num_tokens, "slot_row T", num_topk, "slot_row K"));

  const auto out_dims = out->dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "out", out_dims, nb, 2, "[B..., T, H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(kOp, "out", out_dims, "expert_out", e_dims, nb));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckDim(kOp, "out", out_dims, nb, "T", num_tokens, "slot_row T"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckDim(kOp, "out", out_dims, nb + 1, "H", hidden, "expert_out H"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckSameDtype(kOp, "out", out->element_type(), "expert_out",
                                expert_out.element_type()));

  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "expert_out", expert_out.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "out", out->untyped_data()));

  const int64_t num_batches = ffi_utils::NumBatches(e_dims, nb);
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, local::Combine(dtype, expert_out.untyped_data(),
                          slot_row.typed_data(), slot_weights.typed_data(),
                          out->untyped_data(), num_batches, num_tokens,
                          num_topk, hidden, capacity, weighted, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpLocalCombine, jax_ep::LocalCombineImpl,
    .Arg<xla::ffi::AnyBuffer>()                     // expert_out
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // slot_row
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // slot_weights
    .Ret<xla::ffi::AnyBuffer>()                     // out
    .Attr<bool>("weighted"));                       // weighted
