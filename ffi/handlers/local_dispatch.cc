// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_local_dispatch` (kernels: ffi/kernels/local_*.cu).
// Dispatch on one rank, and the weighted transpose of combine.
//
//   x            `[B..., T, H]` bf16/f16/f32 operand
//   slot_row     `[B..., T, K]` int32 operand (from jax_ep_local_layout)
//   group_sizes  `[B..., E]`    int32 operand
//   slot_weights `[B..., T, K]` float32 operand, read only when `weighted`
//   attrs        capacity: int64, weighted: bool
//   recv_x       `[B..., capacity, H]` x.dtype: recv_x[slot_row[t, k]] = x[t]
//                (* slot_weights[t, k]); rows >= sum(group_sizes) are not written.

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

constexpr char kOp[] = "jax_ep_local_dispatch";

ffi::Error LocalDispatchImpl(cudaStream_t stream, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> slot_row,
                             ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Buffer<ffi::F32> slot_weights,
                             ffi::Result<ffi::AnyBuffer> recv_x,
                             int64_t capacity, bool weighted) {
  ffi_utils::LeadingOperand lead;
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckLeadingOperand(kOp, "x", "[B..., T, H]", x, &lead));
  const auto& [x_dims, nb, num_tokens, hidden, dtype] = lead;
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckCapacity(kOp, capacity));

  int64_t num_topk = 0;
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSlotRows(
      kOp, "slot_row", slot_row.dimensions(), "x", lead, num_tokens, "x T",
      nullptr, &num_topk));

  const auto gs_dims = group_sizes.dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "group_sizes", gs_dims, nb, 1, "[B..., E]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(kOp, "group_sizes", gs_dims, "x", x_dims, nb));
  const int64_t num_experts = gs_dims[nb];
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckNumExperts(kOp, "group_sizes last dim", num_experts));

  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSlotsShape(
      kOp, "slot_weights", slot_weights.dimensions(), "x", x_dims, nb,
      num_tokens, "x T", num_topk, "slot_row K"));

  const auto out_dims = recv_x->dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "recv_x", out_dims, nb, 2, "[B..., capacity, H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(kOp, "recv_x", out_dims, "x", x_dims, nb));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckDim(kOp, "recv_x", out_dims, nb, "capacity",
                                      capacity, "attribute capacity"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckDim(kOp, "recv_x", out_dims, nb + 1, "H", hidden, "x H"));
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSameDtype(
      kOp, "recv_x", recv_x->element_type(), "x", x.element_type()));

  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "x", x.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "recv_x", recv_x->untyped_data()));

  const int64_t num_batches = ffi_utils::NumBatches(x_dims, nb);
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp,
      local::Dispatch(dtype, x.untyped_data(), slot_row.typed_data(),
                      slot_weights.typed_data(),
                      recv_x->untyped_data(), num_batches, num_tokens, num_topk,
                      num_experts, hidden, capacity, weighted, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpLocalDispatch, jax_ep::LocalDispatchImpl,
    .Arg<xla::ffi::AnyBuffer>()                     // x
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // slot_row
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // slot_weights
    .Ret<xla::ffi::AnyBuffer>()                     // recv_x
    .Attr<int64_t>("capacity")                      // capacity
    .Attr<bool>("weighted"));                       // weighted
