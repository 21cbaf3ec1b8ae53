// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_peer_combine_vjp` (kernels:
// ffi/kernels/peer_*.cu): cotangents of the weighted combine, one
// exchange of d_out serving both. Per rank, no batch dims (R ranks,
// L = E / R, N = R * T_max):
//
//   d_out         `[T, H]` operand, expert_out.dtype
//   expert_out    `[capacity, H]` bf16/f16/f32 operand
//   topk_idx      `[T, K]` int32 operand
//   send_pos      `[T, R]` int32 operand      (from jax_ep_peer_dispatch)
//   entry_row     `[N, K]` int32 operand
//   entry_weights `[N, K]` float32 operand
//   recv_counts   `[R]` int32 operand
//   group_sizes   `[L]` int32 operand
//   attrs         group (group_common.h, GroupRef),
//                 num_experts (E), capacity: int64
//   d_expert_out  `[capacity, H]` expert_out.dtype: the weighted cached
//                 dispatch of d_out
//   d_weights     `[T, K]` float32: <d_out[t], expert_out[row(t, k)]>, fp32
//                 on the expert side; 0 for slots that select nothing or
//                 were dropped
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

constexpr char kOp[] = "jax_ep_peer_combine_vjp";

ffi::Error PeerCombineVjpImpl(
    cudaStream_t stream, ffi::AnyBuffer d_out, ffi::AnyBuffer expert_out,
    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::S32> send_pos,
    ffi::Buffer<ffi::S32> entry_row, ffi::Buffer<ffi::F32> entry_weights,
    ffi::Buffer<ffi::S32> recv_counts, ffi::Buffer<ffi::S32> group_sizes,
    ffi::Result<ffi::AnyBuffer> d_expert_out,
    ffi::ResultBuffer<ffi::F32> d_weights, ffi::ResultBuffer<ffi::S32> status,
    group_ffi::GroupRef ref,
    int64_t num_experts, int64_t capacity) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::GetPlacingGroup(
      kOp, ref, num_experts, capacity, &group));
  const runtime::GroupConfig& c = group->config;
  const int64_t num_ranks = c.num_ranks;
  const int64_t num_local = num_experts / num_ranks;
  const int64_t hidden = c.hidden;
  const int64_t num_topk = c.num_topk;

  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupRows(
      kOp, *group, "expert_out", expert_out, StorageRows(capacity),
      "[max(capacity, 1), H]", /*rows=*/nullptr, &dtype));
  const auto g_dims = d_out.dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "d_out", g_dims, {-1, hidden}, "[T, H]"));
  const int64_t num_tokens = g_dims[0];
  JAX_EP_FFI_RETURN_IF_ERROR(
      group_ffi::CheckTokens(kOp, "d_out", num_tokens, *group));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckSameDtype(kOp, "d_out", d_out.element_type(),
                                "expert_out", expert_out.element_type()));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "topk_idx", topk_idx.dimensions(),
                                        {num_tokens, num_topk}, "[T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "send_pos", send_pos.dimensions(),
                                        {num_tokens, num_ranks}, "[T, R]"));
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckReceivedEntries(
      kOp, *group, entry_row.dimensions(), entry_weights.dimensions(),
      recv_counts.dimensions()));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(
      kOp, "group_sizes", group_sizes.dimensions(), {num_local}, "[E / R]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "d_expert_out", d_expert_out->dimensions(),
                 {StorageRows(capacity), hidden}, "[max(capacity, 1), H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckSameDtype(
      kOp, "d_expert_out", d_expert_out->element_type(), "expert_out",
      expert_out.element_type()));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "d_weights",
                                        d_weights->dimensions(),
                                        {num_tokens, num_topk}, "[T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "status", status->dimensions(), {}, "[]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "d_out", d_out.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "expert_out", expert_out.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckAligned(
      kOp, "d_expert_out", d_expert_out->untyped_data()));

  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp,
      peer::CombineVjp(
          group->view, dtype, d_out.untyped_data(), expert_out.untyped_data(),
          topk_idx.typed_data(), send_pos.typed_data(), entry_row.typed_data(),
          entry_weights.typed_data(), recv_counts.typed_data(),
          group_sizes.typed_data(), num_tokens, num_experts, capacity,
          d_expert_out->untyped_data(), d_weights->typed_data(),
          status->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpPeerCombineVjp, jax_ep::PeerCombineVjpImpl,
    .Arg<xla::ffi::AnyBuffer>()                     // d_out
    .Arg<xla::ffi::AnyBuffer>()                     // expert_out
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // topk_idx
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // send_pos
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // entry_row
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // entry_weights
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // recv_counts
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes
    .Ret<xla::ffi::AnyBuffer>()                     // d_expert_out
    .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // d_weights
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // status
    .Attr<jax_ep::group_ffi::GroupRef>("group")     // group_common.h
    .Attr<int64_t>("num_experts")                   // num_experts (E)
    .Attr<int64_t>("capacity"));                    // capacity
