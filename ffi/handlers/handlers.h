// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// XLA FFI handler symbols of every jax_ep custom call, one per op. The FFI
// target name registered for each is given beside it; ffi/module.cc maps the
// names to these symbols in `registrations()`. Every handler is CUDA-only and
// command-buffer compatible (no allocation, no host sync, no per-call host
// state).

#ifndef JAX_EP_FFI_HANDLERS_HANDLERS_H_
#define JAX_EP_FFI_HANDLERS_HANDLERS_H_

#include "xla/ffi/api/api.h"

// "jax_ep_local_layout"     — ffi/handlers/local_layout.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalLayout);
// "jax_ep_local_permute"    — ffi/handlers/local_permute.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalPermute);
// "jax_ep_local_unpermute"  — ffi/handlers/local_unpermute.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalUnpermute);
// "jax_ep_local_slot_dots"  — ffi/handlers/local_slot_dots.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLocalSlotDots);

// Multi-rank peer transport (state: ffi/handlers/peer_group.h).
// "jax_ep_peer_dispatch"        — ffi/handlers/peer_dispatch.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatch);
// "jax_ep_peer_dispatch_cached" — ffi/handlers/peer_dispatch_cached.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerDispatchCached);
// "jax_ep_peer_combine"         — ffi/handlers/peer_combine.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerCombine);
// "jax_ep_peer_combine_vjp"     — ffi/handlers/peer_combine_vjp.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpPeerCombineVjp);

#endif  // JAX_EP_FFI_HANDLERS_HANDLERS_H_
