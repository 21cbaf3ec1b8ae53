// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Native groups of the peer transport: the library-owned buffer of one
// rank, its device state, error mailbox and peer-pointer table, kept in a
// process-wide registry keyed by a process-unique group id.
//
// Host C++ and the CUDA runtime only (no XLA, no nanobind). The management
// functions (Create, Connect, ...) are called from the nanobind module and
// report failures by throwing std::runtime_error / std::invalid_argument
// (nanobind turns them into Python exceptions). The two functions the FFI
// handlers use, Lookup and PendingError, never throw.
//
// Lifecycle, per rank: Create (allocate + zero + preload kernels) ->
// IpcHandle (publish) -> Connect (open every peer's handle, check its config
// header, build the pointer table) -> ops -> Destroy. One process driving
// several devices: Create per device, then ConnectLocal with all the ids.
//
// Defined in runtime/group.cc (BufferBytes, Create, IpcHandle, Destroy),
// runtime/connect.cc (Connect, ConnectTable, ConnectLocal),
// runtime/registry.cc (the registry, Lookup and the queries) and
// runtime/errors.cc (PendingError).

#ifndef JAX_EP_FFI_RUNTIME_GROUP_H_
#define JAX_EP_FFI_RUNTIME_GROUP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ffi/kernels/group_view.h"
#include "ffi/kernels/network.h"

namespace jax_ep::runtime {

struct GroupConfig {
  int device = 0;  // CUDA device ordinal of this rank
  int rank = 0;
  int num_ranks = 1;         // R
  int64_t num_experts = 1;   // E (global)
  int64_t num_topk = 1;      // K
  int64_t hidden = 8;        // H
  int64_t max_tokens = 1;    // T_max
  int64_t itemsize = 2;      // bytes per activation element (2 or 4)
  int64_t capacity = 0;      // rows of recv_x
  int64_t expert_alignment = 1;  // each local expert's rows of recv_x start at
                                 // a multiple of it (the dispatch's WaitCounts)
  int num_sms = 24;          // blocks of every communication kernel
  double timeout_s = 60.0;   // every spin-wait gives up after this long
  bool low_latency = false;  // allocate the low-latency buffers (L * R * T_max
                             // rows, two sets: BufferLayout::ll_*)
  bool network = false;      // some peers are on other hosts (the network
                         // transport): the buffer has the outbox regions and
                         // is given by the caller (NVSHMEM's symmetric heap)
  int num_hosts = 0;  // hosts of a network group (>= 2: the rail
                      // exchange's regions), else 0
};

struct Group {
  int64_t id = 0;
  GroupConfig config;
  int64_t buffer_bytes = 0;
  void* buffer = nullptr;  // cudaMalloc'd, own; or the caller's (network)
  bool owns_buffer = true;
  group::DeviceState* state = nullptr;       // cudaMalloc'd
  group::Mailbox* mailbox_host = nullptr;    // cudaHostAlloc(Mapped)
  group::Mailbox* mailbox_device = nullptr;  // its device pointer
  char** table_device = nullptr;                 // [R] peer bases
  std::vector<uint64_t> table_host;              // the same, on the host
  std::vector<void*> ipc_opened;                 // to cudaIpcCloseMemHandle
  std::vector<int64_t> local_siblings;           // ConnectLocal group ids
  std::string device_uuid;  // cudaDeviceProp::uuid of config.device, 16 bytes
  // GroupView::receive_while_sending (decided on connect).
  bool receive_while_sending = false;
  // The network transport's put launcher (network groups, set by
  // ConnectTable); null otherwise.
  network::SendFn network_send = nullptr;
  bool connected = false;
  group::GroupView view{};  // valid once connected
};

// Bytes of one rank's buffer (group::MakeBufferLayout). Throws
// std::invalid_argument on arguments out of range.
// `low_latency_experts`: E with the low-latency buffers, else 0.
// `network`: with the outbox of the network transport (low-latency only);
// `num_hosts` >= 2 (network only): with the rail exchange's regions.
int64_t BufferBytes(int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                    int64_t num_topk, int64_t itemsize,
                    int64_t low_latency_experts = 0, bool network = false,
                    int64_t num_hosts = 0);

// Allocates and registers a group on config.device; returns its id. A network
// group (config.network) takes `buffer` (device memory of at least
// BufferBytes(..., network=true) bytes that outlives the group, e.g. in
// NVSHMEM's symmetric heap), zeroes it and never frees it.
int64_t Create(const GroupConfig& config, void* buffer = nullptr,
               int64_t buffer_bytes = 0);

// The 64-byte cudaIpcMemHandle_t of the group's buffer.
std::string IpcHandle(int64_t group_id);

// handles[r] for every rank r (the own one is ignored). Opens the peers'
// handles, checks every peer's config header, builds the pointer table.
void Connect(int64_t group_id, const std::vector<std::string>& handles);

// A network group's peers: table[r] is rank r's buffer as this process maps
// it, or 0 for a rank reached through the network transport (table[rank] is
// the group's own buffer); `network_send` (a network::SendFn) moves
// the rows for the latter. Checks the header of every mapped peer.
void ConnectTable(int64_t group_id, const std::vector<uint64_t>& table,
                  uint64_t network_send);

// Groups of this process, group_ids[r] = rank r (one per device, or several
// on one device in tests); enables peer access between distinct devices.
void ConnectLocal(const std::vector<int64_t>& group_ids);

// The device pointer table as integers (empty before connect).
std::vector<uint64_t> PointerTable(int64_t group_id);

// The mailbox message of the group's first timeout, if any (no sync); for a
// ConnectLocal set, else the first other member's (rank order) that has one.
std::optional<std::string> ErrorMessage(int64_t group_id);

// Whether the group's dispatch places the other ranks' rows while it sends
// (decided on connect; false before it).
bool ReceivesWhileSending(int64_t group_id);

// cudaDeviceSynchronize on the group's device, then the mailbox message of
// its first timeout if there was one (a kernel still running when Destroy was
// called may have timed out meanwhile), then close IPC handles and free
// everything. Idempotent; unknown ids are a no-op (nullopt).
std::optional<std::string> Destroy(int64_t group_id);

// --- For the FFI handlers (never throw). ---------------------------------

struct LookupResult {
  std::shared_ptr<const Group> group;  // null on failure
  std::string error;                   // why, when group is null
};

// The connected group `group_id` for the handler's current device. A group
// connected with ConnectLocal stands for its whole set: when its own device
// is not `device`, the member on `device` is returned (one HLO program, and
// so one group_id attribute, serves every local device).
LookupResult Lookup(int64_t group_id, int device) noexcept;

// The mailbox message if a spin of this group timed out (plain host read of
// mapped memory, no sync).
std::optional<std::string> PendingError(const Group& group) noexcept;

}  // namespace jax_ep::runtime

#endif  // JAX_EP_FFI_RUNTIME_GROUP_H_
