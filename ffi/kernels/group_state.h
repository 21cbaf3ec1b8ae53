// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The device state of a native group: per region and per low-latency op
// the completed calls (the sequence every flag is tagged with), the
// "blocks done" counter of each send kernel, and the low-latency ops'
// pending sends and the sticky abort flag. Device memory of the group's
// device; only this rank's kernels (and its put kernels) touch it.

#ifndef JAX_EP_FFI_KERNELS_GROUP_STATE_H_
#define JAX_EP_FFI_KERNELS_GROUP_STATE_H_

#include <cstdint>

#include "ffi/kernels/group_buffer_layout.h"

namespace jax_ep::group {

// Monotonic "blocks done" counters, one per communication (send) kernel.
enum SendCounter : int32_t {
  kDispatchSendCounter = 0,
  kRowsSendCounter = 1,
  kCombineSendCounter = 2,
  kDotsSendCounter = 3,
  // The low-latency send kernels (low_latency_dispatch.cu,
  // low_latency_combine.cu).
  kLowLatencyDispatchSendCounter = 4,
  kLowLatencyCombineSendCounter = 5,
  // The low-latency waits' copying grids (not monotonic: the last block
  // resets its counter, so their grids may differ between calls).
  kLowLatencyDispatchPackCounter = 6,
  kLowLatencyCombineReduceCounter = 7,
  // The network transport's put kernels (ffi/nvshmem/low_latency_puts.cu;
  // resetting, like the waits' grids).
  kLowLatencyDispatchPutCounter = 8,
  kLowLatencyCombinePutCounter = 9,
  // The rail exchange's put kernel (ffi/nvshmem/rail_puts.cu; resetting).
  kRailPutCounter = 10,
  kNumSendCounters = 11,
};

// The two low-latency ops; each has its own sequence counter, buffer sets and
// flags (DeviceState::ll_seq, BufferLayout::ll_*).
enum LowLatencyOp : int32_t {
  kLowLatencyDispatch = 0,
  kLowLatencyCombine = 1,
  kNumLowLatencyOps = 2,
};

// Per-group device state (device memory of the group's device, zeroed at
// creation). Only this rank's kernels touch it.
struct DeviceState {
  unsigned long long seq[kNumRegions];  // completed calls per region
  unsigned long long blocks_done[kNumSendCounters];  // monotonic
  // Completed calls of each low-latency op (its wait advances it; call n,
  // 0-based, uses buffer set n % 2 and tags its flags with n + 1), and
  // whether its send was issued and its wait not yet.
  unsigned long long ll_seq[kNumLowLatencyOps];
  unsigned int ll_pending[kNumLowLatencyOps];
  unsigned int ll_invalid;     // invalid ids of the current dispatch send
  unsigned int aborted;        // sticky: a spin of this group timed out
                               // (never reset: send blocks that returned
                               // early left blocks_done out of phase)
  unsigned int error_claimed;  // the first timeout fills the mailbox
  // Completed rail exchanges (network groups; call n, 0-based, uses inbox set
  // n % 2 and tags its flags with n + 1; its last kernel advances it).
  unsigned long long rail_seq;
};

}  // namespace jax_ep::group

#endif  // JAX_EP_FFI_KERNELS_GROUP_STATE_H_
