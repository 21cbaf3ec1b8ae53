// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Connecting native groups: each rank's table of its peers' buffers
// (opened from their CUDA IPC handles, given by the network transport, or
// the buffers of this process's own groups), checked against every peer's
// configuration header, and the kernels' GroupView built from it.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ffi/kernels/group_buffer_layout.h"
#include "ffi/kernels/group_view.h"
#include "ffi/kernels/network.h"
#include "ffi/runtime/group.h"
#include "ffi/runtime/group_internal.h"
#include "ffi/runtime/header.h"
#include "ffi/runtime/topology.h"

namespace jax_ep::runtime {
namespace {

using detail::DeviceGuard;
using detail::FindOrThrow;
using detail::RegistryMutex;
using detail::ThrowIfCuda;

// Empty if `peer` (read from rank r's buffer) matches `mine` for rank r.
std::string HeaderMismatch(const BufferHeader& mine, const BufferHeader& peer,
                           int r) {
  if (peer.magic != kHeaderMagic) {
    return "rank " + std::to_string(r) +
           "'s buffer has no jax_ep peer-group header (wrong handle?)";
  }
  if (peer.rank != r) {
    return "handles[" + std::to_string(r) + "] belongs to rank " +
           std::to_string(peer.rank) + ", not rank " + std::to_string(r);
  }
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"num_ranks", {mine.num_ranks, peer.num_ranks}},
      {"num_experts", {mine.num_experts, peer.num_experts}},
      {"num_topk", {mine.num_topk, peer.num_topk}},
      {"hidden", {mine.hidden, peer.hidden}},
      {"max_tokens_per_rank", {mine.max_tokens, peer.max_tokens}},
      {"itemsize", {mine.itemsize, peer.itemsize}},
      {"capacity", {mine.capacity, peer.capacity}},
      {"expert_alignment", {mine.expert_alignment, peer.expert_alignment}},
      {"low_latency", {mine.low_latency, peer.low_latency}},
      {"network", {mine.network, peer.network}},
      {"num_hosts", {mine.num_hosts, peer.num_hosts}},
  };
  for (const auto& f : fields) {
    if (f.second.first != f.second.second) {
      return std::string("group configuration differs: ") + f.first + " is " +
             std::to_string(f.second.first) + " on rank " +
             std::to_string(mine.rank) + " but " +
             std::to_string(f.second.second) + " on rank " + std::to_string(r);
    }
  }
  return "";
}

// Copies the table to the device and fills the kernel view. Called with the
// group's device current, before the group is published as connected.
void FinishConnect(Group& g) {
  const int num_ranks = g.config.num_ranks;
  void* table = nullptr;
  ThrowIfCuda(cudaMalloc(&table, sizeof(char*) * num_ranks),
              "cudaMalloc of the peer pointer table");
  cudaError_t err =
      cudaMemcpy(table, g.table_host.data(), sizeof(char*) * num_ranks,
                 cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    cudaFree(table);
    ThrowIfCuda(err, "cudaMemcpy of the peer pointer table");
  }
  g.table_device = static_cast<char**>(table);
  group::GroupView& v = g.view;
  v.peers = g.table_device;
  v.own = static_cast<char*>(g.buffer);
  v.state = g.state;
  v.mailbox = g.mailbox_device;
  v.layout = group::MakeBufferLayout(
      g.config.num_ranks, g.config.max_tokens, g.config.hidden,
      g.config.num_topk, g.config.itemsize,
      g.config.low_latency ? g.config.num_experts : 0, g.config.network,
      g.config.num_hosts);
  v.max_tokens = g.config.max_tokens;
  v.hidden = g.config.hidden;
  v.timeout_ns = static_cast<int64_t>(g.config.timeout_s * 1e9);
  v.rank = g.config.rank;
  v.num_ranks = g.config.num_ranks;
  v.num_topk = static_cast<int32_t>(g.config.num_topk);
  v.itemsize = static_cast<int32_t>(g.config.itemsize);
  v.num_blocks = g.config.num_sms;
  v.receive_while_sending = g.receive_while_sending ? 1 : 0;
  v.num_local = static_cast<int32_t>(g.config.num_experts / num_ranks);
  v.expert_alignment = static_cast<int32_t>(g.config.expert_alignment);
  v.low_latency = g.config.low_latency ? 1 : 0;
  v.network = g.config.network ? 1 : 0;
  v.num_hosts = g.config.network ? g.config.num_hosts : 0;
  // Published under the registry lock: Lookup reads it under the same lock.
  std::lock_guard<std::mutex> lock(RegistryMutex());
  g.connected = true;
}

}  // namespace

void Connect(int64_t group_id, const std::vector<std::string>& handles) {
  const std::string fn = "group_connect";
  auto g = FindOrThrow(group_id, fn.c_str());
  const GroupConfig& c = g->config;
  if (g->connected) {
    throw std::invalid_argument(fn + ": group " + std::to_string(group_id) +
                                " is already connected");
  }
  if (static_cast<int64_t>(handles.size()) != c.num_ranks) {
    throw std::invalid_argument(
        fn + ": got " + std::to_string(handles.size()) +
        " handles, expected one per rank (num_ranks = " +
        std::to_string(c.num_ranks) + ")");
  }
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r != c.rank && handles[r].size() != sizeof(cudaIpcMemHandle_t)) {
      throw std::invalid_argument(fn + ": handles[" + std::to_string(r) +
                                  "] has " + std::to_string(handles[r].size()) +
                                  " bytes, expected " +
                                  std::to_string(sizeof(cudaIpcMemHandle_t)));
    }
  }
  DeviceGuard guard(c.device);
  const BufferHeader mine = MakeHeader(c);
  std::vector<uint64_t> table(c.num_ranks, 0);
  std::vector<std::string> uuids(c.num_ranks);
  std::vector<void*> opened;
  try {
    for (int r = 0; r < c.num_ranks; ++r) {
      if (r == c.rank) {
        table[r] = reinterpret_cast<uint64_t>(g->buffer);
        uuids[r] = g->device_uuid;
        continue;
      }
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, handles[r].data(), sizeof(handle));
      void* ptr = nullptr;
      ThrowIfCuda(
          cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess),
          fn + ": cudaIpcOpenMemHandle of rank " + std::to_string(r) +
              "'s buffer on device " + std::to_string(c.device));
      opened.push_back(ptr);
      table[r] = reinterpret_cast<uint64_t>(ptr);
      BufferHeader peer;
      ThrowIfCuda(
          cudaMemcpy(&peer, ptr, sizeof(peer), cudaMemcpyDefault),
          fn + ": reading rank " + std::to_string(r) + "'s buffer header");
      const std::string mismatch = HeaderMismatch(mine, peer, r);
      if (!mismatch.empty()) throw std::invalid_argument(fn + ": " + mismatch);
      uuids[r].assign(reinterpret_cast<const char*>(peer.device_uuid), 16);
    }
    g->table_host = table;
    g->ipc_opened = opened;
    g->receive_while_sending = NativeP2PAtomicsByUuid(uuids);
    FinishConnect(*g);
  } catch (...) {
    for (void* p : opened) cudaIpcCloseMemHandle(p);
    g->ipc_opened.clear();
    g->table_host.clear();
    throw;
  }
}

void ConnectTable(int64_t group_id, const std::vector<uint64_t>& table,
                  uint64_t network_send) {
  const std::string fn = "group_connect_table";
  auto g = FindOrThrow(group_id, fn.c_str());
  const GroupConfig& c = g->config;
  if (!c.network) {
    throw std::invalid_argument(fn + ": group " + std::to_string(group_id) +
                                " is not a network group");
  }
  if (g->connected) {
    throw std::invalid_argument(fn + ": group " + std::to_string(group_id) +
                                " is already connected");
  }
  if (static_cast<int64_t>(table.size()) != c.num_ranks) {
    throw std::invalid_argument(
        fn + ": got " + std::to_string(table.size()) +
        " table entries, expected one per rank (num_ranks = " +
        std::to_string(c.num_ranks) + ")");
  }
  if (table[c.rank] != reinterpret_cast<uint64_t>(g->buffer)) {
    throw std::invalid_argument(fn + ": table[" + std::to_string(c.rank) +
                                "] must be the group's own buffer");
  }
  if (network_send == 0) {
    throw std::invalid_argument(fn + ": network_send is null");
  }
  DeviceGuard guard(c.device);
  const BufferHeader mine = MakeHeader(c);
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r == c.rank || table[r] == 0) continue;
    BufferHeader peer;
    ThrowIfCuda(
        cudaMemcpy(&peer, reinterpret_cast<void*>(table[r]), sizeof(peer),
                   cudaMemcpyDefault),
        fn + ": reading rank " + std::to_string(r) + "'s buffer header");
    const std::string mismatch = HeaderMismatch(mine, peer, r);
    if (!mismatch.empty()) throw std::invalid_argument(fn + ": " + mismatch);
  }
  g->table_host = table;
  g->network_send = reinterpret_cast<network::SendFn>(network_send);
  g->receive_while_sending = false;
  FinishConnect(*g);
}

void ConnectLocal(const std::vector<int64_t>& group_ids) {
  const std::string fn = "group_connect_local";
  if (group_ids.empty()) {
    throw std::invalid_argument(fn + ": expected one group id per rank");
  }
  std::vector<std::shared_ptr<Group>> groups;
  for (int64_t id : group_ids) groups.push_back(FindOrThrow(id, fn.c_str()));
  const int num_ranks = static_cast<int>(groups.size());
  for (int r = 0; r < num_ranks; ++r) {
    const Group& g = *groups[r];
    if (g.connected) {
      throw std::invalid_argument(fn + ": group " + std::to_string(g.id) +
                                  " is already connected");
    }
    if (g.config.num_ranks != num_ranks) {
      throw std::invalid_argument(
          fn + ": got " + std::to_string(num_ranks) + " group ids but group " +
          std::to_string(g.id) +
          " has num_ranks = " + std::to_string(g.config.num_ranks));
    }
    const std::string mismatch =
        HeaderMismatch(MakeHeader(groups[0]->config), MakeHeader(g.config), r);
    if (!mismatch.empty()) throw std::invalid_argument(fn + ": " + mismatch);
  }
  // Peer access between every pair of distinct devices (both directions).
  for (int a = 0; a < num_ranks; ++a) {
    const int dev_a = groups[a]->config.device;
    DeviceGuard guard(dev_a);
    for (int b = 0; b < num_ranks; ++b) {
      const int dev_b = groups[b]->config.device;
      if (dev_b == dev_a) continue;
      int can = 0;
      ThrowIfCuda(cudaDeviceCanAccessPeer(&can, dev_a, dev_b),
                  fn + ": cudaDeviceCanAccessPeer");
      if (!can) {
        throw std::runtime_error(fn + ": device " + std::to_string(dev_a) +
                                 " cannot access device " +
                                 std::to_string(dev_b) +
                                 " (no P2P between them)");
      }
      const cudaError_t err = cudaDeviceEnablePeerAccess(dev_b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear it
      } else {
        ThrowIfCuda(err, fn + ": cudaDeviceEnablePeerAccess(" +
                             std::to_string(dev_b) + ") on device " +
                             std::to_string(dev_a));
      }
    }
  }
  std::vector<uint64_t> table(num_ranks);
  std::vector<int> devices;
  for (int r = 0; r < num_ranks; ++r) {
    table[r] = reinterpret_cast<uint64_t>(groups[r]->buffer);
    devices.push_back(groups[r]->config.device);
  }
  const bool receive_while_sending = NativeP2PAtomics(devices);
  try {
    for (int r = 0; r < num_ranks; ++r) {
      Group& g = *groups[r];
      DeviceGuard guard(g.config.device);
      g.table_host = table;
      g.local_siblings = group_ids;
      g.receive_while_sending = receive_while_sending;
      FinishConnect(g);
    }
  } catch (...) {
    for (int r = 0; r < num_ranks; ++r) {
      Group& g = *groups[r];
      if (g.table_device != nullptr) {
        int previous = -1;
        if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
        cudaSetDevice(g.config.device);
        cudaFree(g.table_device);
        if (previous >= 0) cudaSetDevice(previous);
      }
      g.table_device = nullptr;
      g.table_host.clear();
      g.local_siblings.clear();
      std::lock_guard<std::mutex> lock(RegistryMutex());
      g.connected = false;
    }
    throw;
  }
}

}  // namespace jax_ep::runtime
