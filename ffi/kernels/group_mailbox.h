// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The error mailbox of a native group: what the first timed-out spin of
// any of its kernels records (op, rank, peer, what it waited for) for the
// host to read without a sync (ffi/runtime/errors.cc builds the
// message from it).

#ifndef JAX_EP_FFI_KERNELS_GROUP_MAILBOX_H_
#define JAX_EP_FFI_KERNELS_GROUP_MAILBOX_H_

#include <cstdint>

namespace jax_ep::group {

// Op codes recorded in the error mailbox.
enum class OpCode : int32_t {
  kNone = 0,
  kDispatch = 1,
  kDispatchCached = 2,
  kCombine = 3,
  kCombineVjp = 4,
  kLowLatencyDispatch = 5,
  kLowLatencyCombine = 6,
  kRailExchange = 7,
};

// What a timed-out spin was waiting for.
enum class WaitKind : int32_t {
  kNone = 0,
  kConsumed = 1,  // the peer to release its region from the previous call
  kArrival = 2,   // the peer's data of this call
  kCounts = 3,    // the peer's dispatch counts of this call (notify)
  // Not a wait: a low-latency send issued before the wait of its previous
  // call, or a wait with no send before it (`peer` is this rank).
  kOutOfOrder = 4,
};

// Error mailbox in host-mapped pinned memory: the device writes it once
// (fields, system fence, then `state` = 1); the host reads it without a sync.
struct Mailbox {
  unsigned int state;      // 0: no error, 1: the fields below are valid
  int32_t op;              // OpCode
  int32_t rank;            // this rank
  int32_t peer;            // the rank waited for
  int32_t wait_kind;       // WaitKind
  int32_t region;          // Region
  unsigned long long seq;  // the call (1-based, per region) that timed out
};

}  // namespace jax_ep::group

#endif  // JAX_EP_FFI_KERNELS_GROUP_MAILBOX_H_
