// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// XLA FFI handler symbols of every jax_ep custom call, one per op. The FFI
// target name registered for each is given beside it; ffi/module.cc maps the
// names to these symbols in `registrations()`. Every handler is CUDA-only and
// command-buffer compatible (no allocation, no host sync, no per-call host
// state), but for those of jax_ep's own stream (below).

#ifndef JAX_EP_FFI_HANDLERS_HANDLERS_H_
#define JAX_EP_FFI_HANDLERS_HANDLERS_H_

#include "xla/ffi/api/api.h"

// "jax_ep_local_layout"     — ffi/handlers/local_layout.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalLayout);
// "jax_ep_local_dispatch"    — ffi/handlers/local_dispatch.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalDispatch);
// "jax_ep_local_dispatch_fp8" — ffi/handlers/local_dispatch_fp8.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalDispatchFp8);
// "jax_ep_local_combine"  — ffi/handlers/local_combine.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalCombine);
// "jax_ep_local_combine_vjp"  — ffi/handlers/local_combine_vjp.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalCombineVjp);

// Multi-rank peer transport (state: ffi/runtime/group.h).
// "jax_ep_peer_dispatch"        — ffi/handlers/peer_dispatch.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatch);
// "jax_ep_peer_dispatch_fp8"    — ffi/handlers/peer_dispatch_fp8.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatchFp8);
// "jax_ep_peer_dispatch_cached" —
// ffi/handlers/peer_dispatch_cached.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatchCached);
// "jax_ep_peer_combine"         — ffi/handlers/peer_combine.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerCombine);
// "jax_ep_peer_combine_vjp"     — ffi/handlers/peer_combine_vjp.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerCombineVjp);

// Low-latency pair over the same groups (ffi/handlers/low_latency.cc):
// "jax_ep_low_latency_dispatch_send" / "_dispatch_wait" /
// "_combine_send" / "_combine_wait", and each pair fused in one call:
// "jax_ep_low_latency_dispatch" / "jax_ep_low_latency_combine".
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombine);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchWait);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineSend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineWait);

// The rail exchange of a network group (ffi/handlers/rail_exchange.cc):
// "jax_ep_rail_exchange".
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpRailExchange);

// jax_ep's own stream (`Group(comm_stream="jax_ep")`): every handler defined
// with JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM (the high-throughput ops
// above and the rail exchange) also has `<symbol>OwnStream`, target
// "<op>_own_stream", and "jax_ep_join" (ffi/handlers/join.cc) ends them.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalLayoutOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalDispatchOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalDispatchFp8OwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalCombineOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalCombineVjpOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatchOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatchFp8OwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatchCachedOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerCombineOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerCombineVjpOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpRailExchangeOwnStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpJoin);

// XLA:CPU: the `group` attribute as the group ops decode it (group_probe.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpGroupProbe);

namespace jax_ep {
// Invocations of the low-latency handlers (a fused call counts once), and how
// many of them ran while a command buffer was recorded.
void LowLatencyHandlerCalls(int64_t* calls, int64_t* captured);
}  // namespace jax_ep

#endif  // JAX_EP_FFI_HANDLERS_HANDLERS_H_
