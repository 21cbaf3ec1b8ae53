// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The operands and results both peer dispatches share (jax_ep_peer_dispatch,
// jax_ep_peer_dispatch_fp8): the routing and the layout the combine takes,
// checked once for both, each error naming the op's argument.

#ifndef JAX_EP_FFI_HANDLERS_PEER_DISPATCH_CHECKS_H_
#define JAX_EP_FFI_HANDLERS_PEER_DISPATCH_CHECKS_H_

#include <cstdint>
#include <string_view>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/group_common.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::group_ffi {

// Dimensions of the routing operands and the layout results.
struct PeerDispatchDims {
  Dims topk_idx, topk_weights, group_sizes, num_dropped, num_invalid, send_pos,
      entry_row, entry_weights, recv_counts, status, workspace;
};

inline ::xla::ffi::Error CheckPeerDispatchLayout(std::string_view op,
                                                 const runtime::Group& group,
                                                 int64_t num_tokens,
                                                 int64_t num_experts,
                                                 const PeerDispatchDims& d) {
  const runtime::GroupConfig& c = group.config;
  const int64_t num_ranks = c.num_ranks;
  const int64_t num_topk = c.num_topk;
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(op, "topk_idx", d.topk_idx, {num_tokens, num_topk}, "[T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(op, "topk_weights", d.topk_weights,
                                        {num_tokens, num_topk}, "[T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(op, "group_sizes", d.group_sizes,
                                        {num_experts / num_ranks}, "[E / R]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(op, "num_dropped", d.num_dropped, {}, "[]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(op, "num_invalid", d.num_invalid, {}, "[]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(op, "send_pos", d.send_pos,
                                        {num_tokens, num_ranks}, "[T, R]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckReceivedEntries(
      op, group, d.entry_row, d.entry_weights, d.recv_counts));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(op, "status", d.status, {}, "[]"));
  return CheckShape(op, "workspace", d.workspace,
                    {peer::DispatchWorkspaceElems(num_ranks, c.max_tokens,
                                                  num_topk, num_experts)},
                    "[peer_dispatch_workspace_elems(R, T_max, K, E)]");
}

}  // namespace jax_ep::group_ffi

#endif  // JAX_EP_FFI_HANDLERS_PEER_DISPATCH_CHECKS_H_
