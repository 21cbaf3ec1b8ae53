// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_peer_dispatch` (kernels:
// ffi/kernels/peer_*.cu): notify + dispatch + layout of the multi-rank
// high-throughput mode, one custom call. Per rank, no batch dims (R ranks, L =
// E / R, N = R * T_max):
//
//   x             `[T, H]` bf16/f16/f32 operand (T <= T_max)
//   topk_idx      `[T, K]` int32 operand
//   topk_weights  `[T, K]` float32 operand
//   attrs         group (group_common.h, GroupRef),
//                 num_experts (E), capacity: int64
//   recv_x        `[capacity, H]` x.dtype: rows grouped by local expert,
//                 (source rank, source token) ascending inside one expert
//   group_sizes   `[L]` int32          num_dropped, num_invalid `[]` int32
//   send_pos      `[T, R]` int32: position of token t in the send list for d
//   entry_row     `[N, K]` int32: row of received entry (s, i, k) or -1
//   entry_weights `[N, K]` float32: the weight that came with it
//   recv_counts   `[R]` int32: tokens received from each source
//   status        `[]` int32: 0 ok, 1 the group has timed out (in this call
//                 or an earlier one: the outputs are defined but not valid)
//   workspace     `[W]` int32 scratch, W = peer_dispatch_workspace_elems

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/group_common.h"
#include "ffi/handlers/handlers.h"
#include "ffi/handlers/peer_dispatch_checks.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using group_ffi::CheckShape;
using group_ffi::StorageRows;

constexpr char kOp[] = "jax_ep_peer_dispatch";

ffi::Error PeerDispatchImpl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
    ffi::Buffer<ffi::F32> topk_weights, ffi::Result<ffi::AnyBuffer> recv_x,
    ffi::ResultBuffer<ffi::S32> group_sizes,
    ffi::ResultBuffer<ffi::S32> num_dropped,
    ffi::ResultBuffer<ffi::S32> num_invalid,
    ffi::ResultBuffer<ffi::S32> send_pos, ffi::ResultBuffer<ffi::S32> entry_row,
    ffi::ResultBuffer<ffi::F32> entry_weights,
    ffi::ResultBuffer<ffi::S32> recv_counts, ffi::ResultBuffer<ffi::S32> status,
    ffi::ResultBuffer<ffi::S32> workspace, group_ffi::GroupRef ref,
    int64_t num_experts, int64_t capacity) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::GetPlacingGroup(
      kOp, ref, num_experts, capacity, &group));
  const int64_t hidden = group->config.hidden;

  int64_t num_tokens = 0;
  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupTokens(
      kOp, *group, "x", x, &num_tokens, &dtype));

  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "recv_x", recv_x->dimensions(),
                                        {StorageRows(capacity), hidden},
                                        "[max(capacity, 1), H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSameDtype(
      kOp, "recv_x", recv_x->element_type(), "x", x.element_type()));
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckPeerDispatchLayout(
      kOp, *group, num_tokens, num_experts,
      {topk_idx.dimensions(), topk_weights.dimensions(),
       group_sizes->dimensions(), num_dropped->dimensions(),
       num_invalid->dimensions(), send_pos->dimensions(),
       entry_row->dimensions(), entry_weights->dimensions(),
       recv_counts->dimensions(), status->dimensions(),
       workspace->dimensions()}));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "x", x.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "recv_x", recv_x->untyped_data()));

  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, peer::Dispatch(
               group->view, dtype, x.untyped_data(), topk_idx.typed_data(),
               topk_weights.typed_data(), num_tokens, num_experts, capacity,
               recv_x->untyped_data(), group_sizes->typed_data(),
               num_dropped->typed_data(), num_invalid->typed_data(),
               send_pos->typed_data(), entry_row->typed_data(),
               entry_weights->typed_data(), recv_counts->typed_data(),
               status->typed_data(), workspace->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpPeerDispatch, jax_ep::PeerDispatchImpl,
    .Arg<xla::ffi::AnyBuffer>()                     // x
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // topk_idx
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // topk_weights
    .Ret<xla::ffi::AnyBuffer>()                     // recv_x
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
    .Attr<int64_t>("capacity"));                    // capacity
