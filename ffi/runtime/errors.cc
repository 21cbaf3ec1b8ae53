// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The message of a native group's first timeout, read from its mailbox in
// host-mapped memory without a sync (runtime/group.h: PendingError).

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "ffi/kernels/group_buffer_layout.h"
#include "ffi/kernels/group_mailbox.h"
#include "ffi/runtime/group.h"

namespace jax_ep::runtime {
namespace {

const char* OpName(int32_t op) {
  switch (static_cast<group::OpCode>(op)) {
    case group::OpCode::kDispatch:
      return "jax_ep.dispatch";
    case group::OpCode::kDispatchCached:
      return "jax_ep.dispatch_cached";
    case group::OpCode::kCombine:
      return "jax_ep.combine";
    case group::OpCode::kCombineVjp:
      return "jax_ep.combine_vjp";
    case group::OpCode::kLowLatencyDispatch:
      return "jax_ep.low_latency_dispatch";
    case group::OpCode::kLowLatencyCombine:
      return "jax_ep.low_latency_combine";
    case group::OpCode::kRailExchange:
      // The network hop of dispatch, combine and their gradients across hosts.
      return "jax_ep.rail_exchange";
    case group::OpCode::kNone:
      break;
  }
  return "jax_ep.group_op";
}

const char* RegionName(int32_t region) {
  switch (region) {
    case group::kDispatchRegion:
      return "dispatch";
    case group::kCombineRegion:
      return "combine";
    case group::kDotsRegion:
      return "combine-vjp dots";
    case group::kNumRegions:  // the rail exchange's inbox
                                  // (rail_exchange.cu)
      return "rail exchange";
    default:
      return "unknown";
  }
}

std::string FormatSeconds(double s) {
  char buf[64];
  if (s == std::round(s * 10.0) / 10.0) {
    std::snprintf(buf, sizeof(buf), "%.1f", s);
  } else {
    std::snprintf(buf, sizeof(buf), "%g", s);
  }
  return buf;
}

}  // namespace

std::optional<std::string> PendingError(const Group& group) noexcept {
  const volatile group::Mailbox* m = group.mailbox_host;
  if (m == nullptr || m->state == 0u) return std::nullopt;
  std::atomic_thread_fence(std::memory_order_acquire);
  try {
    const int32_t op = m->op;
    const int32_t rank = m->rank;
    const int32_t peer = m->peer;
    const int32_t what = m->wait_kind;
    const int32_t region = m->region;
    const unsigned long long seq = m->seq;
    if (what == static_cast<int32_t>(group::WaitKind::kOutOfOrder)) {
      return std::string(OpName(op)) + ": rank " + std::to_string(rank) +
             " issued call " + std::to_string(seq) +
             "'s send before the previous call's wait, or a wait with no "
             "send before it: one send may be outstanding per low-latency "
             "op (issue send, wait, send, wait). The group is "
             "unusable; recreate it.";
    }
    std::string msg = std::string(OpName(op)) + ": rank " +
                      std::to_string(rank) + " timed out after " +
                      FormatSeconds(group.config.timeout_s) +
                      " s waiting for rank " + std::to_string(peer) +
                      " (call " + std::to_string(seq) + ")";
    if (what == static_cast<int32_t>(group::WaitKind::kConsumed)) {
      msg += ": rank " + std::to_string(peer) + " did not release its " +
             RegionName(region) + " buffer from the previous call";
    } else if (what == static_cast<int32_t>(group::WaitKind::kCounts)) {
      msg += ": rank " + std::to_string(peer) +
             "'s dispatch counts (notify) did not arrive";
    } else {
      msg += ": rank " + std::to_string(peer) + "'s " + RegionName(region) +
             " data did not arrive";
    }
    msg += ". The group is unusable; recreate it.";
    return msg;
  } catch (...) {
    return std::string("jax_ep: a group op timed out");
  }
}

}  // namespace jax_ep::runtime
