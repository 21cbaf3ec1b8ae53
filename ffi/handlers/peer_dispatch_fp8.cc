// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_peer_dispatch_fp8` (kernels:
// ffi/kernels/peer_*.cu): jax_ep_peer_dispatch with fp8 rows on the wire
// (ffi/kernels/fp8_rows.h): each token quantised once by its sender (or its
// e4m3 row and scales taken as given), sent as one packed row, split on
// arrival. Per rank, no batch dims (R ranks, L = E / R, N = R * T_max):
//
//   x             `[T, H]` operand (T <= T_max): the activations (the
//                 group's itemsize), or float8_e4m3fn with `given`
//   x_scales      `[T, H/128]` float32 (`[T, H/512]` int32 with format 2)
//                 operand, read only with `given` (else any shape)
//   topk_idx      `[T, K]` int32 operand
//   topk_weights  `[T, K]` float32 operand
//   attrs         group (group_common.h, GroupRef), num_experts (E),
//                 capacity: int64, format: int64 (0 FP8, 1 FP8_POW2_SCALES,
//                 2 FP8_UE8M0), given: bool
//   recv_x        `[max(capacity, 1), H]` float8_e4m3fn
//   recv_scales   `[max(capacity, 1), H/128]` float32 (`H/512` int32 with
//                 format 2)
//   group_sizes ... workspace: jax_ep_peer_dispatch's results, the same
//                 layout (the combine takes it as it is)

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/fp8_checks.h"
#include "ffi/handlers/group_common.h"
#include "ffi/handlers/handlers.h"
#include "ffi/handlers/peer_dispatch_checks.h"
#include "ffi/kernels/fp8_rows.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using group_ffi::CheckShape;
using group_ffi::StorageRows;

constexpr char kOp[] = "jax_ep_peer_dispatch_fp8";

ffi::Error PeerDispatchFp8Impl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
    ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
    ffi::ResultBuffer<ffi::S32> group_sizes,
    ffi::ResultBuffer<ffi::S32> num_dropped,
    ffi::ResultBuffer<ffi::S32> num_invalid,
    ffi::ResultBuffer<ffi::S32> send_pos, ffi::ResultBuffer<ffi::S32> entry_row,
    ffi::ResultBuffer<ffi::F32> entry_weights,
    ffi::ResultBuffer<ffi::S32> recv_counts, ffi::ResultBuffer<ffi::S32> status,
    ffi::ResultBuffer<ffi::S32> workspace, group_ffi::GroupRef ref,
    int64_t num_experts, int64_t capacity, int64_t format, bool given) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::GetPlacingGroup(
      kOp, ref, num_experts, capacity, &group));
  const runtime::GroupConfig& c = group->config;
  const int64_t hidden = c.hidden;

  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "x", x.dimensions(), {-1, hidden}, "[T, H]"));
  const int64_t num_tokens = x.dimensions()[0];
  JAX_EP_FFI_RETURN_IF_ERROR(
      group_ffi::CheckTokens(kOp, "x", num_tokens, *group));
  fp8::ScaleFormat f;
  JAX_EP_FFI_RETURN_IF_ERROR(fp8_checks::CheckFormat(kOp, format, hidden, &f));
  // NOTES: a wire row travels in the group's staging rows of H * itemsize
  // bytes; it fits for every H >= 128 (fp8_rows.h), checked here all the
  // same so that a smaller staging row could never be overrun.
  if (fp8::RowBytes(hidden, f) > hidden * c.itemsize) {
    return ffi_utils::InvalidArgument(
        kOp, "an fp8 row of H = " + std::to_string(hidden) + " takes " +
                 std::to_string(fp8::RowBytes(hidden, f)) +
                 " bytes, more than the group's staging rows (H * itemsize = " +
                 std::to_string(hidden * c.itemsize) + ")");
  }
  fp8::Rows rows;
  JAX_EP_FFI_RETURN_IF_ERROR(fp8_checks::CheckSource(
      kOp, given, x, x_scales, /*nb=*/0, num_tokens, hidden, f, c.itemsize,
      &rows));
  JAX_EP_FFI_RETURN_IF_ERROR(fp8_checks::CheckResults(
      kOp, *recv_x, *recv_scales, x.dimensions(), /*nb=*/0,
      StorageRows(capacity), "max(capacity, 1)", hidden, f));
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckPeerDispatchLayout(
      kOp, *group, num_tokens, num_experts,
      {topk_idx.dimensions(), topk_weights.dimensions(),
       group_sizes->dimensions(), num_dropped->dimensions(),
       num_invalid->dimensions(), send_pos->dimensions(),
       entry_row->dimensions(), entry_weights->dimensions(),
       recv_counts->dimensions(), status->dimensions(),
       workspace->dimensions()}));

  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, peer::DispatchFp8(
               group->view, rows, topk_idx.typed_data(),
               topk_weights.typed_data(), num_tokens, num_experts, capacity,
               recv_x->untyped_data(), recv_scales->untyped_data(),
               group_sizes->typed_data(), num_dropped->typed_data(),
               num_invalid->typed_data(), send_pos->typed_data(),
               entry_row->typed_data(), entry_weights->typed_data(),
               recv_counts->typed_data(), status->typed_data(),
               workspace->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpPeerDispatchFp8, jax_ep::PeerDispatchFp8Impl,
    .Arg<xla::ffi::AnyBuffer>()                     // x
    .Arg<xla::ffi::AnyBuffer>()                     // x_scales
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // topk_idx
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // topk_weights
    .Ret<xla::ffi::AnyBuffer>()                     // recv_x
    .Ret<xla::ffi::AnyBuffer>()                     // recv_scales
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // num_dropped
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // num_invalid
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // send_pos
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // entry_row
    .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // entry_weights
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // recv_counts
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // status
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // workspace
    .Attr<jax_ep::group_ffi::GroupRef>("group")     // group_common.h
    .Attr<int64_t>("num_experts")                   // num_experts (E)
    .Attr<int64_t>("capacity")                      // capacity
    .Attr<int64_t>("format")                        // fp8::ScaleFormat
    .Attr<bool>("given"));                          // x is e4m3 + x_scales
