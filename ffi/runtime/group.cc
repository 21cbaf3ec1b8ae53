// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The life cycle of a native group: its buffer's size, its creation
// (buffer, configuration header, device state, error mailbox; every kernel
// loaded), its buffer's CUDA IPC handle, and its destruction. See
// runtime/group.h; connecting a group: runtime/connect.cc; the registry
// and lookups: runtime/registry.cc; the GPUs' P2P capabilities:
// runtime/topology.cc; the timeout message: runtime/errors.cc.

#include "ffi/runtime/group.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/group_buffer_layout.h"
#include "ffi/kernels/group_view.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/runtime/group_internal.h"
#include "ffi/runtime/header.h"
#include "ffi/runtime/topology.h"

namespace jax_ep::runtime {
namespace {

using detail::DeviceGuard;
using detail::FindOrThrow;
using detail::ThrowIfCuda;

void CheckRange(bool ok, const std::string& fn, const std::string& what) {
  if (!ok) throw std::invalid_argument(fn + ": " + what);
}

void ValidateBufferArgs(const std::string& fn, int64_t num_ranks,
                        int64_t max_tokens, int64_t hidden, int64_t num_topk,
                        int64_t itemsize) {
  CheckRange(num_ranks >= 1 && num_ranks <= group::kMaxRanks, fn,
             "num_ranks is " + std::to_string(num_ranks) +
                 ", expected 1 <= num_ranks <= " +
                 std::to_string(group::kMaxRanks));
  CheckRange(max_tokens >= 1, fn,
             "max_tokens_per_rank is " + std::to_string(max_tokens) +
                 ", expected >= 1");
  CheckRange(hidden >= kHiddenMultiple && hidden % kHiddenMultiple == 0, fn,
             "hidden is " + std::to_string(hidden) +
                 ", expected a positive multiple of " +
                 std::to_string(kHiddenMultiple));
  CheckRange(num_topk >= 1 && num_topk <= kMaxTopk, fn,
             "num_topk is " + std::to_string(num_topk) +
                 ", expected 1 <= num_topk <= " + std::to_string(kMaxTopk));
  CheckRange(itemsize == 2 || itemsize == 4, fn,
             "itemsize is " + std::to_string(itemsize) + ", expected 2 or 4");
  CheckRange(num_ranks * max_tokens * num_topk <= kMaxSlots, fn,
             "num_ranks * max_tokens_per_rank * num_topk = " +
                 std::to_string(num_ranks * max_tokens * num_topk) +
                 ", expected at most " + std::to_string(kMaxSlots));
}

// Frees what `g` holds; best effort, never throws.
void Release(Group& g) noexcept {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (cudaSetDevice(g.config.device) == cudaSuccess) {
    cudaDeviceSynchronize();
    for (void* p : g.ipc_opened) cudaIpcCloseMemHandle(p);
    if (g.table_device != nullptr) cudaFree(g.table_device);
    if (g.state != nullptr) cudaFree(g.state);
    if (g.buffer != nullptr && g.owns_buffer) cudaFree(g.buffer);
    if (g.mailbox_host != nullptr) cudaFreeHost(g.mailbox_host);
  }
  g.ipc_opened.clear();
  g.table_device = nullptr;
  g.state = nullptr;
  g.buffer = nullptr;
  g.mailbox_host = nullptr;
  g.mailbox_device = nullptr;
  g.connected = false;
  cudaGetLastError();  // do not leave a sticky error for the caller
  if (previous >= 0) cudaSetDevice(previous);
}

}  // namespace

int64_t BufferBytes(int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                    int64_t num_topk, int64_t itemsize,
                    int64_t low_latency_experts, bool network,
                    int64_t num_hosts) {
  ValidateBufferArgs("group_buffer_bytes", num_ranks, max_tokens, hidden,
                     num_topk, itemsize);
  CheckRange(low_latency_experts >= 0 && low_latency_experts % num_ranks == 0 &&
                 low_latency_experts / num_ranks <= kMaxExperts,
             "group_buffer_bytes",
             "low_latency_experts is " + std::to_string(low_latency_experts) +
                 ", expected 0 or a multiple of num_ranks with at most " +
                 std::to_string(kMaxExperts) + " per rank");
  CheckRange(!network || low_latency_experts > 0 || num_hosts >= 2,
             "group_buffer_bytes",
             "a network buffer holds the low-latency ops' regions or the rail "
             "exchange's: low_latency_experts > 0 or num_hosts >= 2");
  CheckRange(num_hosts == 0 || (network && num_hosts >= 2 &&
                                num_hosts <= group::kMaxHosts &&
                                num_ranks % num_hosts == 0),
             "group_buffer_bytes",
             "num_hosts is " + std::to_string(num_hosts) +
                 ", expected 0, or for a network group 2 <= num_hosts <= " +
                 std::to_string(group::kMaxHosts) +
                 " dividing num_ranks = " + std::to_string(num_ranks));
  return group::MakeBufferLayout(num_ranks, max_tokens, hidden, num_topk,
                                     itemsize, low_latency_experts, network,
                                     num_hosts)
      .total;
}

int64_t Create(const GroupConfig& c, void* buffer, int64_t buffer_bytes) {
  const std::string fn = "group_create";
  ValidateBufferArgs(fn, c.num_ranks, c.max_tokens, c.hidden, c.num_topk,
                     c.itemsize);
  CheckRange(c.rank >= 0 && c.rank < c.num_ranks, fn,
             "rank is " + std::to_string(c.rank) + ", expected 0 <= rank < " +
                 std::to_string(c.num_ranks));
  CheckRange(c.num_experts >= c.num_ranks && c.num_experts % c.num_ranks == 0,
             fn,
             "num_experts is " + std::to_string(c.num_experts) +
                 ", expected a positive multiple of num_ranks = " +
                 std::to_string(c.num_ranks));
  CheckRange(c.num_experts / c.num_ranks <= kMaxExperts, fn,
             "num_experts / num_ranks is " +
                 std::to_string(c.num_experts / c.num_ranks) +
                 ", expected <= " + std::to_string(kMaxExperts));
  CheckRange(c.capacity >= 0 && c.capacity <= kMaxCapacity, fn,
             "capacity is " + std::to_string(c.capacity) +
                 ", expected 0 <= capacity <= " + std::to_string(kMaxCapacity));
  CheckRange(c.expert_alignment >= 1 &&
                 c.expert_alignment <= kMaxExpertAlignment,
             fn,
             "expert_alignment is " + std::to_string(c.expert_alignment) +
                 ", expected 1 <= expert_alignment <= " +
                 std::to_string(kMaxExpertAlignment));
  CheckRange(c.num_sms >= 1 && c.num_sms <= kMaxNumSms, fn,
             "num_sms is " + std::to_string(c.num_sms) +
                 ", expected 1 <= num_sms <= " + std::to_string(kMaxNumSms));
  CheckRange(c.timeout_s > 0.0 && c.timeout_s < 1e9, fn,
             "timeout_s is " + std::to_string(c.timeout_s) +
                 ", expected a positive number of seconds");
  int num_devices = 0;
  ThrowIfCuda(cudaGetDeviceCount(&num_devices), fn + ": cudaGetDeviceCount");
  CheckRange(c.device >= 0 && c.device < num_devices, fn,
             "device_ordinal is " + std::to_string(c.device) +
                 ", expected 0 <= "
                 "device_ordinal < " +
                 std::to_string(num_devices));

  auto g = std::make_shared<Group>();
  g->config = c;
  g->buffer_bytes =
      BufferBytes(c.num_ranks, c.max_tokens, c.hidden, c.num_topk, c.itemsize,
                  c.low_latency ? c.num_experts : 0, c.network, c.num_hosts);
  CheckRange(c.network == (buffer != nullptr), fn,
             c.network ? "a network group takes its buffer from the caller"
                       : "only a network group takes the caller's buffer");
  CheckRange(!c.network || buffer_bytes >= g->buffer_bytes, fn,
             "the caller's buffer has " + std::to_string(buffer_bytes) +
                 " bytes, expected at least " +
                 std::to_string(g->buffer_bytes));
  DeviceGuard guard(c.device);
  try {
    // NOTES: load every kernel the peer ops launch now: a lazy module load
    // while a peer spins could stall it past its timeout.
    ThrowIfCuda(peer::PreloadKernels(),
                fn + ": loading the peer-transport kernels on device " +
                    std::to_string(c.device));
    if (c.network) {
      g->buffer = buffer;
      g->owns_buffer = false;
    } else {
      ThrowIfCuda(cudaMalloc(&g->buffer, static_cast<size_t>(g->buffer_bytes)),
                  fn + ": cudaMalloc of " + std::to_string(g->buffer_bytes) +
                      " bytes (the peer buffer) on device " +
                      std::to_string(c.device));
    }
    // The whole buffer is zeroed (flags, counters and data): a few ms once,
    // and the receive regions never hold another process's old memory.
    ThrowIfCuda(cudaMemset(g->buffer, 0, static_cast<size_t>(g->buffer_bytes)),
                fn + ": cudaMemset of the peer buffer");
    BufferHeader header = MakeHeader(c);
    ThrowIfCuda(
        DeviceUuid(c.device, header.device_uuid),
        fn + ": cudaGetDeviceProperties of device " + std::to_string(c.device));
    g->device_uuid.assign(reinterpret_cast<const char*>(header.device_uuid),
                          16);
    ThrowIfCuda(
        cudaMemcpy(g->buffer, &header, sizeof(header), cudaMemcpyHostToDevice),
        fn + ": cudaMemcpy of the buffer header");
    void* state = nullptr;
    ThrowIfCuda(cudaMalloc(&state, sizeof(group::DeviceState)),
                fn + ": cudaMalloc of the device state");
    g->state = static_cast<group::DeviceState*>(state);
    ThrowIfCuda(cudaMemset(state, 0, sizeof(group::DeviceState)),
                fn + ": cudaMemset of the device state");
    void* mailbox = nullptr;
    ThrowIfCuda(cudaHostAlloc(&mailbox, sizeof(group::Mailbox),
                              cudaHostAllocMapped | cudaHostAllocPortable),
                fn + ": cudaHostAlloc of the error mailbox");
    g->mailbox_host = static_cast<group::Mailbox*>(mailbox);
    std::memset(mailbox, 0, sizeof(group::Mailbox));
    void* mailbox_device = nullptr;
    ThrowIfCuda(cudaHostGetDevicePointer(&mailbox_device, mailbox, 0),
                fn + ": cudaHostGetDevicePointer of the error mailbox");
    g->mailbox_device = static_cast<group::Mailbox*>(mailbox_device);
    // Peers may write into the buffer as soon as they have its handle.
    ThrowIfCuda(cudaDeviceSynchronize(), fn + ": cudaDeviceSynchronize");
  } catch (...) {
    Release(*g);
    throw;
  }
  return detail::Register(g);
}

std::string IpcHandle(int64_t group_id) {
  auto g = FindOrThrow(group_id, "group_ipc_handle");
  DeviceGuard guard(g->config.device);
  cudaIpcMemHandle_t handle;
  ThrowIfCuda(cudaIpcGetMemHandle(&handle, g->buffer),
              "group_ipc_handle: cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

std::optional<std::string> Destroy(int64_t group_id) {
  std::shared_ptr<Group> g = detail::Unregister(group_id);
  if (g == nullptr) return std::nullopt;
  // NOTES: the device first: a kernel still in flight may yet time out and fill
  // the mailbox, whose message must be read before the mailbox is freed.
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (cudaSetDevice(g->config.device) == cudaSuccess) cudaDeviceSynchronize();
  cudaGetLastError();
  if (previous >= 0) cudaSetDevice(previous);
  std::optional<std::string> message = PendingError(*g);
  Release(*g);
  return message;
}

}  // namespace jax_ep::runtime
