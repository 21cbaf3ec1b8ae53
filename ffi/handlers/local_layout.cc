// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_local_layout` (kernels: ffi/kernels/layout.cu).
//
//   topk_idx    `[B..., T, K]` int32 operand
//   attrs       num_experts: int64 (E), capacity: int64, expert_alignment:
//               int64 (each expert's first row is a multiple of it)
//   slot_row    `[B..., T, K]` int32: row of the slot or -1 (invalid/dropped)
//   group_sizes `[B..., E]`    int32: kept rows per expert
//   num_dropped `[B...]`       int32: valid slots with row >= capacity
//   num_invalid `[B...]`       int32: slots with id < -1 or id >= E
//   workspace   `[B..., W]`    int32 scratch, W = local_layout_workspace_elems

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/handlers.h"
#include "ffi/kernels/layout_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using ffi_utils::CheckBatchDims;
using ffi_utils::CheckDim;
using ffi_utils::CheckRank;

constexpr char kOp[] = "jax_ep_local_layout";

ffi::Error LocalLayoutImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                           ffi::ResultBuffer<ffi::S32> slot_row,
                           ffi::ResultBuffer<ffi::S32> group_sizes,
                           ffi::ResultBuffer<ffi::S32> num_dropped,
                           ffi::ResultBuffer<ffi::S32> num_invalid,
                           ffi::ResultBuffer<ffi::S32> workspace,
                           int64_t num_experts, int64_t capacity,
                           int64_t expert_alignment) {
  const auto idx_dims = topk_idx.dimensions();
  if (idx_dims.size() < 2) {
    return ffi_utils::InvalidArgument(
        kOp, "topk_idx must have shape [B..., T, K] (rank >= 2), got shape " +
                 ffi_utils::ShapeString(idx_dims));
  }
  const size_t nb = idx_dims.size() - 2;
  const int64_t num_tokens = idx_dims[nb];
  const int64_t num_topk = idx_dims[nb + 1];
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckTopk(kOp, "topk_idx", num_tokens, num_topk));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckNumExperts(kOp, "attribute num_experts", num_experts));
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckCapacity(kOp, capacity));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckExpertAlignment(kOp, expert_alignment));

  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSlotsShape(
      kOp, "slot_row", slot_row->dimensions(), "topk_idx", idx_dims, nb,
      num_tokens, "topk_idx T", num_topk, "topk_idx K"));

  const auto gs_dims = group_sizes->dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "group_sizes", gs_dims, nb, 1, "[B..., E]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(kOp, "group_sizes", gs_dims, "topk_idx", idx_dims, nb));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckDim(kOp, "group_sizes", gs_dims, nb, "E",
                                      num_experts, "attribute num_experts"));

  const auto dropped_dims = num_dropped->dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "num_dropped", dropped_dims, nb, 0, "[B...]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckBatchDims(kOp, "num_dropped", dropped_dims,
                                            "topk_idx", idx_dims, nb));
  const auto invalid_dims = num_invalid->dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "num_invalid", invalid_dims, nb, 0, "[B...]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckBatchDims(kOp, "num_invalid", invalid_dims,
                                            "topk_idx", idx_dims, nb));

  const auto ws_dims = workspace->dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "workspace", ws_dims, nb, 1, "[B..., W]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(kOp, "workspace", ws_dims, "topk_idx", idx_dims, nb));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckDim(
      kOp, "workspace", ws_dims, nb, "W",
      layout::LocalLayoutWorkspaceElems(num_tokens, num_topk, num_experts),
      "local_layout_workspace_elems(T, K, E)"));

  const int64_t num_batches = ffi_utils::NumBatches(idx_dims, nb);
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, layout::LocalLayout(
               topk_idx.typed_data(), slot_row->typed_data(),
               group_sizes->typed_data(), num_dropped->typed_data(),
               num_invalid->typed_data(), workspace->typed_data(), num_batches,
               num_tokens, num_topk, num_experts, capacity, expert_alignment,
               stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpLocalLayout, jax_ep::LocalLayoutImpl,
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // topk_idx
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // slot_row
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // num_dropped
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // num_invalid
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // workspace
    .Attr<int64_t>("num_experts")                   // num_experts (E)
    .Attr<int64_t>("capacity")                      // capacity
    .Attr<int64_t>("expert_alignment"));            // expert_alignment
