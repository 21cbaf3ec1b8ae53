// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Intranode groups: allocation, CUDA IPC, pointer tables and the registry.
// See intranode_group.h; the GPUs' P2P capabilities are asked in
// intranode_topology.cc, the timeout message is built in intranode_errors.cc.

#include "ffi/handlers/intranode_group.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "ffi/handlers/intranode_topology.h"
#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/intranode_kernels.h"

namespace jax_ep::intranode_group {
namespace {

// NOTES: written at offset 0 of every buffer at creation and read by every
// peer on connect, so ranks created with different configurations (or a
// handle list in the wrong order) fail at connect time instead of hanging
// or corrupting memory later. Fits intranode::kHeaderBytes.
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
  int64_t low_latency;
  int64_t network;
  int64_t num_hosts;
  // The owner's GPU (cudaDeviceProp::uuid): not part of the configuration,
  // read on connect to tell whether every rank has a GPU of its own.
  unsigned char device_uuid[16];
};
static_assert(sizeof(BufferHeader) <= intranode::kHeaderBytes,
              "header must fit its region");
constexpr uint64_t kMagic = 0x6a61785f65705031ull;  // "jax_epP1"

std::mutex& RegistryMutex() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}

std::map<int64_t, std::shared_ptr<Group>>& Registry() {
  static auto* groups = new std::map<int64_t, std::shared_ptr<Group>>();
  return *groups;
}

std::atomic<int64_t> next_group_id{1};

std::string CudaMessage(const std::string& what, cudaError_t err) {
  return what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
         ")";
}

void ThrowIfCuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error(CudaMessage(what, err));
}

// Makes `device` current for the scope, restoring the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    ThrowIfCuda(cudaSetDevice(device),
                "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

std::shared_ptr<Group> FindOrThrow(int64_t group_id, const char* fn) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(group_id);
  if (it == Registry().end()) {
    throw std::invalid_argument(std::string(fn) +
                                ": unknown intranode group id " +
                                std::to_string(group_id));
  }
  return it->second;
}

void CheckRange(bool ok, const std::string& fn, const std::string& what) {
  if (!ok) throw std::invalid_argument(fn + ": " + what);
}

void ValidateBufferArgs(const std::string& fn, int64_t num_ranks,
                        int64_t max_tokens, int64_t hidden, int64_t num_topk,
                        int64_t itemsize) {
  CheckRange(num_ranks >= 1 && num_ranks <= intranode::kMaxRanks, fn,
             "num_ranks is " + std::to_string(num_ranks) +
                 ", expected 1 <= num_ranks <= " +
                 std::to_string(intranode::kMaxRanks));
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

BufferHeader MakeHeader(const GroupConfig& c) {
  BufferHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kMagic;
  h.rank = c.rank;
  h.num_ranks = c.num_ranks;
  h.num_experts = c.num_experts;
  h.num_topk = c.num_topk;
  h.hidden = c.hidden;
  h.max_tokens = c.max_tokens;
  h.itemsize = c.itemsize;
  h.capacity = c.capacity;
  h.low_latency = c.low_latency ? 1 : 0;
  h.network = c.network ? 1 : 0;
  h.num_hosts = c.num_hosts;
  return h;
}

// Empty if `peer` (read from rank r's buffer) matches `mine` for rank r.
std::string HeaderMismatch(const BufferHeader& mine, const BufferHeader& peer,
                           int r) {
  if (peer.magic != kMagic) {
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
  intranode::GroupView& v = g.view;
  v.peers = g.table_device;
  v.own = static_cast<char*>(g.buffer);
  v.state = g.state;
  v.mailbox = g.mailbox_device;
  v.layout = intranode::MakeBufferLayout(
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
  v.low_latency = g.config.low_latency ? 1 : 0;
  v.network = g.config.network ? 1 : 0;
  v.num_hosts = g.config.network ? g.config.num_hosts : 0;
  // Published under the registry lock: Lookup reads it under the same lock.
  std::lock_guard<std::mutex> lock(RegistryMutex());
  g.connected = true;
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
  ValidateBufferArgs("intranode_buffer_bytes", num_ranks, max_tokens, hidden,
                     num_topk, itemsize);
  CheckRange(low_latency_experts >= 0 && low_latency_experts % num_ranks == 0 &&
                 low_latency_experts / num_ranks <= kMaxExperts,
             "intranode_buffer_bytes",
             "low_latency_experts is " + std::to_string(low_latency_experts) +
                 ", expected 0 or a multiple of num_ranks with at most " +
                 std::to_string(kMaxExperts) + " per rank");
  CheckRange(!network || low_latency_experts > 0 || num_hosts >= 2,
             "intranode_buffer_bytes",
             "a network buffer holds the low-latency ops' regions or the rail "
             "exchange's: low_latency_experts > 0 or num_hosts >= 2");
  CheckRange(num_hosts == 0 || (network && num_hosts >= 2 &&
                                num_hosts <= intranode::kMaxHosts &&
                                num_ranks % num_hosts == 0),
             "intranode_buffer_bytes",
             "num_hosts is " + std::to_string(num_hosts) +
                 ", expected 0, or for a network group 2 <= num_hosts <= " +
                 std::to_string(intranode::kMaxHosts) +
                 " dividing num_ranks = " + std::to_string(num_ranks));
  return intranode::MakeBufferLayout(num_ranks, max_tokens, hidden, num_topk,
                                     itemsize, low_latency_experts, network,
                                     num_hosts)
      .total;
}

int64_t Create(const GroupConfig& c, void* buffer, int64_t buffer_bytes) {
  const std::string fn = "intranode_group_create";
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
    // NOTES: load every kernel the intranode ops launch now: a lazy module load
    // while a peer spins could stall it past its timeout.
    ThrowIfCuda(intranode::PreloadKernels(),
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
    ThrowIfCuda(cudaMalloc(&state, sizeof(intranode::DeviceState)),
                fn + ": cudaMalloc of the device state");
    g->state = static_cast<intranode::DeviceState*>(state);
    ThrowIfCuda(cudaMemset(state, 0, sizeof(intranode::DeviceState)),
                fn + ": cudaMemset of the device state");
    void* mailbox = nullptr;
    ThrowIfCuda(cudaHostAlloc(&mailbox, sizeof(intranode::Mailbox),
                              cudaHostAllocMapped | cudaHostAllocPortable),
                fn + ": cudaHostAlloc of the error mailbox");
    g->mailbox_host = static_cast<intranode::Mailbox*>(mailbox);
    std::memset(mailbox, 0, sizeof(intranode::Mailbox));
    void* mailbox_device = nullptr;
    ThrowIfCuda(cudaHostGetDevicePointer(&mailbox_device, mailbox, 0),
                fn + ": cudaHostGetDevicePointer of the error mailbox");
    g->mailbox_device = static_cast<intranode::Mailbox*>(mailbox_device);
    // Peers may write into the buffer as soon as they have its handle.
    ThrowIfCuda(cudaDeviceSynchronize(), fn + ": cudaDeviceSynchronize");
  } catch (...) {
    Release(*g);
    throw;
  }
  g->id = next_group_id.fetch_add(1);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[g->id] = g;
  return g->id;
}

std::string IpcHandle(int64_t group_id) {
  auto g = FindOrThrow(group_id, "intranode_group_ipc_handle");
  DeviceGuard guard(g->config.device);
  cudaIpcMemHandle_t handle;
  ThrowIfCuda(cudaIpcGetMemHandle(&handle, g->buffer),
              "intranode_group_ipc_handle: cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void Connect(int64_t group_id, const std::vector<std::string>& handles) {
  const std::string fn = "intranode_group_connect";
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
  const std::string fn = "intranode_group_connect_table";
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
  const std::string fn = "intranode_group_connect_local";
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

std::vector<uint64_t> PointerTable(int64_t group_id) {
  auto g = FindOrThrow(group_id, "intranode_group_pointer_table");
  return g->table_host;
}

bool ReceivesWhileSending(int64_t group_id) {
  return FindOrThrow(group_id, "intranode_group_receives_while_sending")
      ->receive_while_sending;
}

std::optional<std::string> ErrorMessage(int64_t group_id) {
  auto g = FindOrThrow(group_id, "intranode_group_error");
  if (std::optional<std::string> msg = PendingError(*g)) return msg;
  // NOTES: a ConnectLocal set is addressed by its primary id (the one group_id
  // of the program), but a timeout lands in the mailbox of the member whose
  // device spun: look at every member, or IntranodeBackend's status check on a
  // non-primary device would raise without the op / rank / peer message.
  std::vector<std::shared_ptr<Group>> members;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (int64_t id : g->local_siblings) {
      auto it = Registry().find(id);
      if (id != group_id && it != Registry().end())
        members.push_back(it->second);
    }
  }
  for (const auto& member : members) {
    if (std::optional<std::string> msg = PendingError(*member)) return msg;
  }
  return std::nullopt;
}

std::optional<std::string> Destroy(int64_t group_id) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto it = Registry().find(group_id);
    if (it == Registry().end()) return std::nullopt;
    g = std::move(it->second);
    Registry().erase(it);
  }
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

LookupResult Lookup(int64_t group_id, int device) noexcept {
  LookupResult result;
  try {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& registry = Registry();
    auto it = registry.find(group_id);
    if (it == registry.end()) {
      result.error = "unknown intranode group id " + std::to_string(group_id) +
                     " (destroyed, or created in another process)";
      return result;
    }
    std::shared_ptr<Group> g = it->second;
    if (g->config.device != device) {
      // One program serves every local device: pick the set's member here.
      std::shared_ptr<Group> match;
      int matches = 0;
      for (int64_t sibling : g->local_siblings) {
        auto s = registry.find(sibling);
        if (s != registry.end() && s->second->config.device == device) {
          match = s->second;
          ++matches;
        }
      }
      if (matches != 1) {
        result.error =
            "intranode group " + std::to_string(group_id) +
            " lives on device " + std::to_string(g->config.device) +
            " but the op runs on device " + std::to_string(device) +
            (matches == 0 ? std::string(" (no group of its set is there)")
                          : std::string(" (several groups of its set are "
                                        "there)"));
        return result;
      }
      g = match;
    }
    if (!g->connected) {
      result.error = "intranode group " + std::to_string(g->id) +
                     " is not connected (call intranode_group_connect or "
                     "intranode_group_connect_local first)";
      return result;
    }
    result.group = std::move(g);
  } catch (...) {
    result.group = nullptr;
    result.error = "intranode group lookup failed";
  }
  return result;
}

}  // namespace jax_ep::intranode_group
