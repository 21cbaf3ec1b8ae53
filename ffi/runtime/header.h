// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The configuration header at offset 0 of every group's buffer (the
// group::kHeaderBytes region of group_buffer_layout.h): the group's
// creation writes it (runtime/group.cc), every peer reads it on connect
// (runtime/connect.cc). Host C++ only.

#ifndef JAX_EP_FFI_RUNTIME_HEADER_H_
#define JAX_EP_FFI_RUNTIME_HEADER_H_

#include <cstdint>
#include <cstring>

#include "ffi/kernels/group_buffer_layout.h"
#include "ffi/runtime/group.h"

namespace jax_ep::runtime {

// NOTES: written at offset 0 of every buffer at creation and read by every
// peer on connect, so ranks created with different configurations (or a
// handle list in the wrong order) fail at connect time instead of hanging
// or corrupting memory later. Fits group::kHeaderBytes.
struct BufferHeader {
  uint64_t magic;
  int64_t rank;
  int64_t num_ranks;
  int64_t num_experts;
  int64_t num_topk;
  int64_t hidden;
  int64_t max_tokens;
  int64_t itemsize;
  int64_t capacity;
  int64_t expert_alignment;
  int64_t low_latency;
  int64_t network;
  int64_t num_hosts;
  // The owner's GPU (cudaDeviceProp::uuid): not part of the configuration,
  // read on connect to tell whether every rank has a GPU of its own.
  unsigned char device_uuid[16];
};
static_assert(sizeof(BufferHeader) <= group::kHeaderBytes,
              "header must fit its region");
inline constexpr uint64_t kHeaderMagic = 0x6a61785f65705031ull;  // "jax_epP1"

inline BufferHeader MakeHeader(const GroupConfig& c) {
  BufferHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kHeaderMagic;
  h.rank = c.rank;
  h.num_ranks = c.num_ranks;
  h.num_experts = c.num_experts;
  h.num_topk = c.num_topk;
  h.hidden = c.hidden;
  h.max_tokens = c.max_tokens;
  h.itemsize = c.itemsize;
  h.capacity = c.capacity;
  h.expert_alignment = c.expert_alignment;
  h.low_latency = c.low_latency ? 1 : 0;
  h.network = c.network ? 1 : 0;
  h.num_hosts = c.num_hosts;
  return h;
}

}  // namespace jax_ep::runtime

#endif  // JAX_EP_FFI_RUNTIME_HEADER_H_
