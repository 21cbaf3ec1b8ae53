// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_peer_combine` (kernels:
// ffi/kernels/peer_*.cu): the reverse path of jax_ep_peer_dispatch. Per
// rank, no batch dims (R ranks, N = R * T_max):
//
//   expert_out    `[capacity, H]` bf16/f16/f32 operand
//   entry_row     `[N, K]` int32 operand      (from jax_ep_peer_dispatch)
//   entry_weights `[N, K]` float32 operand (read only when `weighted`)
//   recv_counts   `[R]` int32 operand
//   send_pos      `[T, R]` int32 operand
//   attrs         group (group_common.h, GroupRef):
//                 int64; weighted: bool
//   out           `[T, H]` expert_out.dtype: out[t] = sum over ranks d
//                 ascending of the partial d computed for t (its rows summed
//                 over k ascending in fp32, weighted; it travels in bf16 for
//                 bf16 activations), summed in fp32, rounded once; zeros for
//                 tokens sent nowhere
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

constexpr char kOp[] = "jax_ep_peer_combine";

ffi::Error PeerCombineImpl(cudaStream_t stream, ffi::AnyBuffer expert_out,
                                ffi::Buffer<ffi::S32> entry_row,
                                ffi::Buffer<ffi::F32> entry_weights,
                                ffi::Buffer<ffi::S32> recv_counts,
                                ffi::Buffer<ffi::S32> send_pos,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::ResultBuffer<ffi::S32> status,
                                group_ffi::GroupRef ref,
                                bool weighted) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(
      group_ffi::GetGroup(kOp, ref, &group));
  const runtime::GroupConfig& c = group->config;
  const int64_t num_ranks = c.num_ranks;
  const int64_t hidden = c.hidden;

  int64_t capacity = 0;
  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupRows(
      kOp, *group, "expert_out", expert_out, /*num_rows=*/-1, "[capacity, H]",
      &capacity, &dtype));
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckReceivedEntries(
      kOp, *group, entry_row.dimensions(), entry_weights.dimensions(),
      recv_counts.dimensions()));
  const auto pos_dims = send_pos.dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "send_pos", pos_dims, {-1, num_ranks}, "[T, R]"));
  const int64_t num_tokens = pos_dims[0];
  JAX_EP_FFI_RETURN_IF_ERROR(
      group_ffi::CheckTokens(kOp, "send_pos", num_tokens, *group));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "out", out->dimensions(),
                                        {num_tokens, hidden}, "[T, H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckSameDtype(kOp, "out", out->element_type(), "expert_out",
                                expert_out.element_type()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "status", status->dimensions(), {}, "[]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "expert_out", expert_out.untyped_data()));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kOp, "out", out->untyped_data()));

  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp,
      peer::Combine(group->view, dtype, expert_out.untyped_data(),
                         entry_row.typed_data(), entry_weights.typed_data(),
                         recv_counts.typed_data(), send_pos.typed_data(),
                         num_tokens, capacity, weighted, out->untyped_data(),
                         status->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpPeerCombine, jax_ep::PeerCombineImpl,
    .Arg<xla::ffi::AnyBuffer>()                     // expert_out
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // entry_row
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // entry_weights
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // recv_counts
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // send_pos
    .Ret<xla::ffi::AnyBuffer>()                     // out
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // status
    .Attr<jax_ep::group_ffi::GroupRef>("group")     // group_common.h
    .Attr<bool>("weighted"));                       // weighted
