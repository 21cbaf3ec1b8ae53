// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_peer_dispatch_cached` (kernels:
// ffi/kernels/peer_*.cu): dispatch again with the layout of an earlier
// jax_ep_peer_dispatch (backward passes). Sends rows only. Per rank, no
// batch dims (R ranks, L = E / R, N = R * T_max):
//
//   x             `[T, H]` bf16/f16/f32 operand
//   send_pos      `[T, R]` int32 operand      (from jax_ep_peer_dispatch)
//   entry_row     `[N, K]` int32 operand
//   entry_weights `[N, K]` float32 operand (read only when `weighted`)
//   group_sizes   `[L]` int32 operand
//   attrs         group (group_common.h, GroupRef),
//                 capacity: int64; weighted: bool
//   recv_x        `[capacity, H]` x.dtype: entry (s, i, k) at entry_row
//                 (times its weight in fp32, rounded once, when weighted);
//                 rows >= sum(group_sizes) are not written
//   status        `[]` int32: 0 ok, 1 the group has timed out (in this call
//                 or an earlier one: the outputs are defined but not valid)

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/group_common.h"
#include "ffi/handlers/handlers.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using group_ffi::CheckShape;
using group_ffi::StorageRows;

constexpr char kOp[] = "jax_ep_peer_dispatch_cached";

ffi::Error PeerDispatchCachedImpl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> send_pos,
    ffi::Buffer<ffi::S32> entry_row, ffi::Buffer<ffi::F32> entry_weights,
    ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> recv_x,
    ffi::ResultBuffer<ffi::S32> status, group_ffi::GroupRef ref,
    int64_t capacity, bool weighted) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(
      group_ffi::GetGroup(kOp, ref, &group));
  const runtime::GroupConfig& c = group->config;
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckCapacity(kOp, capacity));
  const int64_t num_ranks = c.num_ranks;
  const int64_t num_local = c.num_experts / num_ranks;
  const int64_t hidden = c.hidden;

  int64_t num_tokens = 0;
  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupTokens(
      kOp, *group, "x", x, &num_tokens, &dtype));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "send_pos", send_pos.dimensions(),
                                        {num_tokens, num_ranks}, "[T, R]"));
  const int64_t num_rows = num_ranks * c.max_tokens;
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "entry_row", entry_row.dimensions(),
                 {num_rows, c.num_topk}, "[R * T_max, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "entry_weights", entry_weights.dimensions(),
                 {num_rows, c.num_topk}, "[R * T_max, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(
      kOp, "group_sizes", group_sizes.dimensions(), {num_local}, "[E / R]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "recv_x", recv_x->dimensions(),
                                        {StorageRows(capacity), hidden},
                                        "[max(capacity, 1), H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSameDtype(
      kOp, "recv_x", recv_x->element_type(), "x", x.element_type()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "status", status->dimensions(), {}, "[]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "x", x.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "recv_x", recv_x->untyped_data()));

  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, peer::DispatchCached(
               group->view, dtype, x.untyped_data(), send_pos.typed_data(),
               entry_row.typed_data(), entry_weights.typed_data(),
               group_sizes.typed_data(), num_tokens, num_local, capacity,
               weighted, recv_x->untyped_data(), status->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpPeerDispatchCached, jax_ep::PeerDispatchCachedImpl,
    .Arg<xla::ffi::AnyBuffer>()                     // x
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // send_pos
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // entry_row
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // entry_weights
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
    .Ret<xla::ffi::AnyBuffer>()                     // recv_x
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // status
    .Attr<jax_ep::group_ffi::GroupRef>("group")     // group_common.h
    .Attr<int64_t>("capacity")                      // capacity
    .Attr<bool>("weighted"));                       // weighted
