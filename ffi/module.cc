// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// nanobind module `jax_ep._jax_ep_ffi`: the CUDA custom calls of jax_ep.
//
// Importing it makes no CUDA call (it loads on machines without a GPU); the
// Python side registers the handlers with
//   for name, capsule in _jax_ep_ffi.registrations().items():
//     jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
//
// The group_* functions manage the peer transport's groups
// (ffi/runtime/group.h); their failures raise Python exceptions:
// ValueError for arguments out of range, RuntimeError for CUDA errors.

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffi/handlers/handlers.h"
#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/layout_kernels.h"
#include "ffi/kernels/low_latency_kernels.h"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/runtime/group.h"
#include "ffi/runtime/side_stream.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict dict;
  dict["jax_ep_local_layout"] = EncapsulateFfiHandler(JaxEpLocalLayout);
  dict["jax_ep_local_dispatch"] = EncapsulateFfiHandler(JaxEpLocalDispatch);
  dict["jax_ep_local_dispatch_fp8"] =
      EncapsulateFfiHandler(JaxEpLocalDispatchFp8);
  dict["jax_ep_local_combine"] = EncapsulateFfiHandler(JaxEpLocalCombine);
  dict["jax_ep_local_combine_vjp"] =
      EncapsulateFfiHandler(JaxEpLocalCombineVjp);
  dict["jax_ep_peer_dispatch"] = EncapsulateFfiHandler(JaxEpPeerDispatch);
  dict["jax_ep_peer_dispatch_fp8"] =
      EncapsulateFfiHandler(JaxEpPeerDispatchFp8);
  dict["jax_ep_peer_dispatch_cached"] =
      EncapsulateFfiHandler(JaxEpPeerDispatchCached);
  dict["jax_ep_peer_combine"] = EncapsulateFfiHandler(JaxEpPeerCombine);
  dict["jax_ep_peer_combine_vjp"] = EncapsulateFfiHandler(JaxEpPeerCombineVjp);
  dict["jax_ep_low_latency_dispatch"] =
      EncapsulateFfiHandler(JaxEpLowLatencyDispatch);
  dict["jax_ep_low_latency_combine"] =
      EncapsulateFfiHandler(JaxEpLowLatencyCombine);
  dict["jax_ep_low_latency_dispatch_send"] =
      EncapsulateFfiHandler(JaxEpLowLatencyDispatchSend);
  dict["jax_ep_low_latency_dispatch_wait"] =
      EncapsulateFfiHandler(JaxEpLowLatencyDispatchWait);
  dict["jax_ep_low_latency_combine_send"] =
      EncapsulateFfiHandler(JaxEpLowLatencyCombineSend);
  dict["jax_ep_low_latency_combine_wait"] =
      EncapsulateFfiHandler(JaxEpLowLatencyCombineWait);
  dict["jax_ep_rail_exchange"] = EncapsulateFfiHandler(JaxEpRailExchange);
  // The high-throughput ops on jax_ep's own stream, and their join.
  dict["jax_ep_local_layout_own_stream"] =
      EncapsulateFfiHandler(JaxEpLocalLayoutOwnStream);
  dict["jax_ep_local_dispatch_own_stream"] =
      EncapsulateFfiHandler(JaxEpLocalDispatchOwnStream);
  dict["jax_ep_local_dispatch_fp8_own_stream"] =
      EncapsulateFfiHandler(JaxEpLocalDispatchFp8OwnStream);
  dict["jax_ep_local_combine_own_stream"] =
      EncapsulateFfiHandler(JaxEpLocalCombineOwnStream);
  dict["jax_ep_local_combine_vjp_own_stream"] =
      EncapsulateFfiHandler(JaxEpLocalCombineVjpOwnStream);
  dict["jax_ep_peer_dispatch_own_stream"] =
      EncapsulateFfiHandler(JaxEpPeerDispatchOwnStream);
  dict["jax_ep_peer_dispatch_fp8_own_stream"] =
      EncapsulateFfiHandler(JaxEpPeerDispatchFp8OwnStream);
  dict["jax_ep_peer_dispatch_cached_own_stream"] =
      EncapsulateFfiHandler(JaxEpPeerDispatchCachedOwnStream);
  dict["jax_ep_peer_combine_own_stream"] =
      EncapsulateFfiHandler(JaxEpPeerCombineOwnStream);
  dict["jax_ep_peer_combine_vjp_own_stream"] =
      EncapsulateFfiHandler(JaxEpPeerCombineVjpOwnStream);
  dict["jax_ep_rail_exchange_own_stream"] =
      EncapsulateFfiHandler(JaxEpRailExchangeOwnStream);
  dict["jax_ep_join"] = EncapsulateFfiHandler(JaxEpJoin);
  return dict;
}

// The XLA:CPU targets: the group attribute's probe (handlers/group_probe.cc).
nb::dict CpuRegistrations() {
  nb::dict dict;
  dict["jax_ep_group_probe"] = EncapsulateFfiHandler(JaxEpGroupProbe);
  return dict;
}

int64_t LocalLayoutWorkspaceElems(int64_t num_tokens, int64_t num_topk,
                                  int64_t num_experts) {
  if (num_tokens < 0 || num_topk < 1 || num_experts < 1 ||
      num_experts > kMaxExperts) {
    throw nb::value_error(
        ("local_layout_workspace_elems: expected num_tokens >= 0, num_topk >= "
         "1 and 1 <= num_experts <= " +
         std::to_string(kMaxExperts))
            .c_str());
  }
  return layout::LocalLayoutWorkspaceElems(num_tokens, num_topk, num_experts);
}

void CheckDispatchWorkspaceArgs(const char* fn, int64_t num_ranks,
                                int64_t max_tokens, int64_t num_topk,
                                int64_t num_experts) {
  if (num_ranks < 1 || num_ranks > group::kMaxRanks || max_tokens < 1 ||
      num_topk < 1 || num_topk > kMaxTopk || num_experts < num_ranks ||
      num_experts % num_ranks != 0 || num_experts / num_ranks > kMaxExperts ||
      num_ranks * max_tokens * num_topk > kMaxSlots) {
    throw std::invalid_argument(
        std::string(fn) +
        ": expected 1 <= num_ranks <= " + std::to_string(group::kMaxRanks) +
        ", max_tokens_per_rank >= 1, 1 <= num_topk <= " +
        std::to_string(kMaxTopk) +
        ", num_experts a positive multiple of num_ranks with num_experts / "
        "num_ranks <= " +
        std::to_string(kMaxExperts) +
        ", and num_ranks * max_tokens_per_rank * num_topk <= " +
        std::to_string(kMaxSlots));
  }
}

int64_t PeerDispatchWorkspaceElems(int64_t num_ranks, int64_t max_tokens,
                                        int64_t num_topk, int64_t num_experts) {
  CheckDispatchWorkspaceArgs("peer_dispatch_workspace_elems", num_ranks,
                             max_tokens, num_topk, num_experts);
  return peer::DispatchWorkspaceElems(num_ranks, max_tokens, num_topk,
                                           num_experts);
}

// The parts of peer::DispatchWorkspace as {name: offset}, and "elems".
nb::dict PeerDispatchWorkspace(int64_t num_ranks, int64_t max_tokens,
                                    int64_t num_topk, int64_t num_experts) {
  CheckDispatchWorkspaceArgs("peer_dispatch_workspace", num_ranks,
                             max_tokens, num_topk, num_experts);
  const peer::DispatchWorkspace w = peer::MakeDispatchWorkspace(
      num_ranks, max_tokens, num_topk, num_experts);
  nb::dict d;
  d["count_to"] = w.count_to;
  d["layout_dropped"] = w.layout_dropped;
  d["layout_invalid"] = w.layout_invalid;
  d["source_chunks"] = w.source_chunks;
  d["chunk_start"] = w.chunk_start;
  d["dest_ids"] = w.dest_ids;
  d["slot_rank"] = w.slot_rank;
  d["dest_counts"] = w.dest_counts;
  d["offset"] = w.offset;
  d["tile_count"] = w.tile_count;
  d["invalid_count"] = w.invalid_count;
  d["layout"] = w.layout;
  d["elems"] = w.elems;
  return d;
}

int64_t GroupCreate(int device_ordinal, int rank, int num_ranks,
                             int64_t num_experts, int64_t num_topk,
                             int64_t hidden, int64_t max_tokens,
                             int64_t itemsize, int64_t capacity, int num_sms,
                             double timeout_s, bool low_latency,
                             uint64_t network_buffer,
                             int64_t network_buffer_bytes, int num_hosts,
                             int64_t expert_alignment) {
  runtime::GroupConfig c;
  c.device = device_ordinal;
  c.rank = rank;
  c.num_ranks = num_ranks;
  c.num_experts = num_experts;
  c.num_topk = num_topk;
  c.hidden = hidden;
  c.max_tokens = max_tokens;
  c.itemsize = itemsize;
  c.capacity = capacity;
  c.num_sms = num_sms;
  c.timeout_s = timeout_s;
  c.low_latency = low_latency;
  c.network = network_buffer != 0;
  c.num_hosts = num_hosts;
  c.expert_alignment = expert_alignment;
  return runtime::Create(c, reinterpret_cast<void*>(network_buffer),
                                 network_buffer_bytes);
}

nb::bytes GroupIpcHandle(int64_t group_id) {
  const std::string handle = runtime::IpcHandle(group_id);
  return nb::bytes(handle.data(), handle.size());
}

void GroupConnect(int64_t group_id,
                           const std::vector<nb::bytes>& handles) {
  std::vector<std::string> raw;
  raw.reserve(handles.size());
  for (const nb::bytes& h : handles) {
    raw.emplace_back(static_cast<const char*>(h.data()), h.size());
  }
  runtime::Connect(group_id, raw);
}

// Loads every kernel of the extension on `device_ordinal` (DESIGN: kernels are
// loaded when a group is created, never lazily inside a handler). Restores the
// caller's current device. Raises on a CUDA error.
void PreloadKernels(int device_ordinal) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess) err = cudaSetDevice(device_ordinal);
  if (err == cudaSuccess) err = peer::PreloadKernels();
  if (err == cudaSuccess) err = cudaSetDevice(previous);
  if (err != cudaSuccess) {
    throw std::runtime_error("jax_ep: loading the kernels on device " +
                             std::to_string(device_ordinal) + ": " +
                             cudaGetErrorName(err));
  }
}

// NOTES: the one table of the kernels' limits. jax_ep/_native/limits.py reads it to
// refuse a configuration when the group is created; the handlers check the
// same constants on every call, so the two checks cannot disagree.
nb::dict Limits() {
  nb::dict d;
  d["max_experts"] = kMaxExperts;  // E at one rank, E / R across ranks
  d["max_topk"] = kMaxTopk;
  d["max_slots"] = kMaxSlots;  // T * K at one rank, R * T_max * K across ranks
  d["hidden_multiple"] = kHiddenMultiple;
  d["max_capacity"] = kMaxCapacity;
  d["max_ranks"] = group::kMaxRanks;
  d["max_num_sms"] = kMaxNumSms;
  return d;
}

// Whether every ordered pair of these devices can access each other's memory
// (cudaDeviceCanAccessPeer): what one process driving them through the
// peer transport needs. Query failures count as no.
bool PeerAccess(const std::vector<int>& devices) {
  for (int a : devices) {
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess) {
        cudaGetLastError();
        return false;
      }
      if (!can) return false;
    }
  }
  return true;
}

int CudaRuntimeVersion() {
  // Reports the (statically linked) runtime's version; does not touch the
  // driver or any device.
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return CUDART_VERSION;
  return version;
}

}  // namespace
}  // namespace jax_ep

NB_MODULE(_jax_ep_ffi, m) {
  m.doc() = "CUDA kernels of jax_ep as XLA FFI custom calls.";
  m.def("registrations", &jax_ep::Registrations,
        "Returns {ffi_target_name: PyCapsule of the XLA FFI handler} for every "
        "CUDA custom call (register with platform='CUDA').");
  m.def("cpu_registrations", &jax_ep::CpuRegistrations,
        "Returns {ffi_target_name: PyCapsule} of the XLA:CPU targets "
        "(register with platform='cpu'): jax_ep_group_probe, which decodes the "
        "group ops' `group` attribute and returns its fields.");
  m.def("local_layout_workspace_elems", &jax_ep::LocalLayoutWorkspaceElems,
        nb::arg("num_tokens"), nb::arg("num_topk"), nb::arg("num_experts"),
        "Elements of the int32 `workspace` result of jax_ep_local_layout, "
        "per batch element (layout::LocalLayoutWorkspaceElems).");
  m.def("preload_kernels", &jax_ep::PreloadKernels, nb::arg("device_ordinal"),
        "Loads every kernel (layout, local, peer transport) on a device; "
        "called when a cuda group is created.");
  m.def(
      "prepare_own_stream",
      [](int device_ordinal, int sms) {
        const cudaError_t err =
            jax_ep::runtime::PrepareOwnStream(device_ordinal, sms);
        if (err != cudaSuccess) {
          throw std::runtime_error(std::string("jax_ep: PrepareOwnStream: ") +
                                   cudaGetErrorString(err));
        }
        std::string why_not;
        const int got =
            jax_ep::runtime::OwnStreamPartition(device_ordinal, &why_not);
        return nb::make_tuple(got, why_not);
      },
      nb::arg("device_ordinal"), nb::arg("sms"),
      "Makes jax_ep's own stream and its events on a device (once; the first "
      "call decides), on a green context of at least `sms` SMs where `sms` > "
      "0 and the driver makes one; called when a cuda group with "
      "comm_stream='jax_ep' is created. Returns (the partition's SMs, 0 for "
      "none; why none where one was asked for).");
  m.def("cuda_runtime_version", &jax_ep::CudaRuntimeVersion,
        "CUDA runtime version the extension was built with, e.g. 13000.");

  // --- The peer transport (multi-rank, one NVLink domain). ------------
  m.def(
      "low_latency_local_bytes",
      []() {
        return static_cast<int64_t>(jax_ep::low_latency::MaxLocalBytes());
      },
      "Local memory per thread of the most demanding low-latency kernel, as "
      "the last kernel preload found it (0 by design; 0 before any preload).");
  m.def(
      "low_latency_handler_calls",
      []() {
        int64_t calls = 0, captured = 0;
        jax_ep::LowLatencyHandlerCalls(&calls, &captured);
        return std::make_pair(calls, captured);
      },
      "(calls, captured): invocations of the low-latency handlers in this "
      "process, and those made while XLA recorded a command buffer.");
  m.def("group_buffer_bytes", &jax_ep::runtime::BufferBytes,
        nb::arg("num_ranks"), nb::arg("max_tokens_per_rank"), nb::arg("hidden"),
        nb::arg("num_topk"), nb::arg("itemsize"),
        nb::arg("low_latency_experts") = 0, nb::arg("network") = false,
        nb::arg("num_hosts") = 0,
        "Bytes of one rank's group buffer (group::BufferLayout in "
        "ffi/kernels/group_buffer_layout.h; docs/intranode.md lists its "
        "regions); `network`: with the network transport's outbox; "
        "`num_hosts` >= 2: with the rail exchange's regions.");
  m.def("peer_dispatch_workspace_elems",
        &jax_ep::PeerDispatchWorkspaceElems, nb::arg("num_ranks"),
        nb::arg("max_tokens_per_rank"), nb::arg("num_topk"),
        nb::arg("num_experts"),
        "Elements of the int32 `workspace` result of "
        "jax_ep_peer_dispatch (peer::DispatchWorkspace).");
  m.def("peer_dispatch_workspace", &jax_ep::PeerDispatchWorkspace,
        nb::arg("num_ranks"), nb::arg("max_tokens_per_rank"),
        nb::arg("num_topk"), nb::arg("num_experts"),
        "peer::DispatchWorkspace: {part: offset in int32 elements}, in "
        "order, and 'elems', the total.");
  m.def("group_create", &jax_ep::GroupCreate,
        nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("num_ranks"),
        nb::arg("num_experts"), nb::arg("num_topk"), nb::arg("hidden"),
        nb::arg("max_tokens_per_rank"), nb::arg("itemsize"),
        nb::arg("capacity"), nb::arg("num_sms"), nb::arg("timeout_s"),
        nb::arg("low_latency") = false, nb::arg("network_buffer") = 0,
        nb::arg("network_buffer_bytes") = 0, nb::arg("num_hosts") = 0,
        nb::arg("expert_alignment") = 1,
        "Allocates this rank's peer buffer, device state and error mailbox on "
        "`device_ordinal`, loads every peer kernel there; returns a "
        "process-unique group id. A network group (ranks on other hosts) "
        "takes its buffer, `network_buffer` (a device address, e.g. in "
        "NVSHMEM's symmetric heap, of `network_buffer_bytes`), and never "
        "frees it; `num_hosts` >= 2 adds its rail exchange's regions. "
        "`expert_alignment`: each local expert's rows of the dispatch output "
        "start at a multiple of it.");
  m.def("group_connect_table", &jax_ep::runtime::ConnectTable,
        nb::arg("group_id"), nb::arg("table"), nb::arg("network_send"),
        "Connects a network group: table[r] is rank r's buffer as this "
        "process maps it, 0 for a rank reached through the network "
        "transport; `network_send` is the address of the network transport's "
        "low-latency put launcher (jax_ep._jax_ep_nvshmem).");
  m.def("group_ipc_handle", &jax_ep::GroupIpcHandle,
        nb::arg("group_id"),
        "The 64-byte cudaIpcMemHandle_t of the group's buffer.");
  m.def("group_connect", &jax_ep::GroupConnect,
        nb::arg("group_id"), nb::arg("handles"),
        "Opens handles[r] of every rank r (the own one is ignored), checks "
        "each peer's configuration header and builds the pointer table.");
  m.def("group_connect_local", &jax_ep::runtime::ConnectLocal,
        nb::arg("group_ids"),
        "Connects groups of this process, group_ids[r] = rank r, enabling "
        "peer access between distinct devices. An op given any id of the set "
        "runs with the member on its current device.");
  m.def("group_pointer_table", &jax_ep::runtime::PointerTable,
        nb::arg("group_id"),
        "The group's peer pointer table as integers (empty before connect).");
  m.def("group_receives_while_sending",
        &jax_ep::runtime::ReceivesWhileSending, nb::arg("group_id"),
        "Whether the group's dispatch places the other ranks' rows while it "
        "sends (every rank on a GPU of its own, native P2P atomics between "
        "them; decided on connect).");
  m.def("peer_access", &jax_ep::PeerAccess,
        nb::arg("device_ordinals"),
        "Whether every ordered pair of these devices can access each other's "
        "memory (cudaDeviceCanAccessPeer); False when a query fails.");
  m.def("group_error", &jax_ep::runtime::ErrorMessage,
        nb::arg("group_id"),
        "The message of the group's first timeout, or None (no sync).");
  m.def("group_destroy", &jax_ep::runtime::Destroy,
        nb::arg("group_id"),
        "Synchronizes the group's device, reads the message of its first "
        "timeout (or None), and frees the group; returns the message. "
        "Idempotent; unknown ids are a no-op (None).");
  m.def("limits", &jax_ep::Limits,
        "The kernels' limits, {name: value}; jax_ep.limits checks a group "
        "against them when it is created, the handlers check every call.");
}
