// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// nanobind module `jax_ep._jax_ep_ffi`: the CUDA custom calls of jax_ep.
//
// Importing it makes no CUDA call (it loads on machines without a GPU); the
// Python side registers the handlers with
//   for name, capsule in _jax_ep_ffi.registrations().items():
//     jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
//
// The peer_group_* functions manage the peer transport's groups
// (ffi/handlers/peer_group.h); their failures raise Python exceptions:
// ValueError for arguments out of range, RuntimeError for CUDA errors.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "ffi/handlers/handlers.h"
#include "ffi/handlers/peer_group.h"
#include "ffi/kernels/ep_kernels.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/optional.h"
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
  dict["jax_ep_local_permute"] = EncapsulateFfiHandler(JaxEpLocalPermute);
  dict["jax_ep_local_unpermute"] = EncapsulateFfiHandler(JaxEpLocalUnpermute);
  dict["jax_ep_local_slot_dots"] = EncapsulateFfiHandler(JaxEpLocalSlotDots);
  dict["jax_ep_peer_dispatch"] = EncapsulateFfiHandler(JaxEpPeerDispatch);
  dict["jax_ep_peer_dispatch_cached"] =
      EncapsulateFfiHandler(JaxEpPeerDispatchCached);
  dict["jax_ep_peer_combine"] = EncapsulateFfiHandler(JaxEpPeerCombine);
  dict["jax_ep_peer_combine_vjp"] = EncapsulateFfiHandler(JaxEpPeerCombineVjp);
  return dict;
}

int64_t LocalLayoutWorkspaceElems(int64_t num_tokens, int64_t num_topk,
                                  int64_t num_experts) {
  if (num_tokens < 0 || num_topk < 1 || num_experts < 1 ||
      num_experts > kMaxExperts) {
    throw nb::value_error(
        "local_layout_workspace_elems: expected num_tokens >= 0, "
        "num_topk >= 1 and 1 <= num_experts <= 1024");
  }
  return layout::LocalLayoutWorkspaceElems(num_tokens, num_topk, num_experts);
}

int64_t PeerDispatchWorkspaceElems(int64_t num_ranks, int64_t max_tokens,
                                   int64_t num_topk, int64_t num_experts) {
  if (num_ranks < 1 || num_ranks > intranode::kMaxRanks || max_tokens < 1 ||
      num_topk < 1 || num_topk > kMaxTopk || num_experts < num_ranks ||
      num_experts % num_ranks != 0 || num_experts / num_ranks > kMaxExperts ||
      num_ranks * max_tokens * num_topk > INT32_MAX) {
    throw nb::value_error(
        "peer_dispatch_workspace_elems: expected 1 <= num_ranks <= 64, "
        "max_tokens_per_rank >= 1, 1 <= num_topk <= 32, num_experts a "
        "positive multiple of num_ranks with num_experts / num_ranks <= 1024, "
        "and num_ranks * max_tokens_per_rank * num_topk < 2^31");
  }
  return intranode::DispatchWorkspaceElems(num_ranks, max_tokens, num_topk,
                                           num_experts);
}

int64_t PeerGroupCreate(int device_ordinal, int rank, int num_ranks,
                        int64_t num_experts, int64_t num_topk, int64_t hidden,
                        int64_t max_tokens, int64_t itemsize, int64_t capacity,
                        int num_sms, double timeout_s) {
  peer::GroupConfig c;
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
  return peer::Create(c);
}

nb::bytes PeerGroupIpcHandle(int64_t group_id) {
  const std::string handle = peer::IpcHandle(group_id);
  return nb::bytes(handle.data(), handle.size());
}

void PeerGroupConnect(int64_t group_id, const std::vector<nb::bytes>& handles) {
  std::vector<std::string> raw;
  raw.reserve(handles.size());
  for (const nb::bytes& h : handles) {
    raw.emplace_back(static_cast<const char*>(h.data()), h.size());
  }
  peer::Connect(group_id, raw);
}

// Loads every kernel of the extension on `device_ordinal` (DESIGN: kernels are
// loaded when a group is created, never lazily inside a handler). Restores the
// caller's current device. Raises on a CUDA error.
void PreloadKernels(int device_ordinal) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess) err = cudaSetDevice(device_ordinal);
  if (err == cudaSuccess) err = intranode::PreloadKernels();
  if (err == cudaSuccess) err = cudaSetDevice(previous);
  if (err != cudaSuccess) {
    throw std::runtime_error("jax_ep: loading the kernels on device " +
                             std::to_string(device_ordinal) + ": " +
                             cudaGetErrorName(err));
  }
}

// NOTES: the one table of the kernels' limits. jax_ep/limits.py reads it to
// refuse a configuration when the group is created; the handlers check the
// same constants on every call, so the two checks cannot disagree.
nb::dict Limits() {
  nb::dict d;
  d["max_experts"] = kMaxExperts;  // E at one rank, E / R across ranks
  d["max_topk"] = kMaxTopk;
  d["max_slots"] = kMaxSlots;  // T * K at one rank, R * T_max * K across ranks
  d["hidden_multiple"] = kHiddenMultiple;
  d["max_capacity"] = kMaxCapacity;
  d["max_peer_ranks"] = intranode::kMaxRanks;
  d["max_num_sms"] = kMaxNumSms;
  return d;
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
  m.def("local_layout_workspace_elems", &jax_ep::LocalLayoutWorkspaceElems,
        nb::arg("num_tokens"), nb::arg("num_topk"), nb::arg("num_experts"),
        "Elements W of the int32 `workspace` result of jax_ep_local_layout, "
        "per batch element: (num_chunks + 1) * (num_experts + 1) with "
        "num_chunks = ceil(T*K / chunk), chunk = max(1024, "
        "round_up(ceil(T*K / 512), 256)).");
  m.def("preload_kernels", &jax_ep::PreloadKernels, nb::arg("device_ordinal"),
        "Loads every kernel (layout, local, peer transport) on a device; "
        "called when a cuda group is created.");
  m.def("cuda_runtime_version", &jax_ep::CudaRuntimeVersion,
        "CUDA runtime version the extension was built with, e.g. 13000.");

  // --- Peer transport (multi-rank, one NVLink domain). ---------------------
  m.def("peer_buffer_bytes", &jax_ep::peer::BufferBytes, nb::arg("num_ranks"),
        nb::arg("max_tokens_per_rank"), nb::arg("hidden"), nb::arg("num_topk"),
        nb::arg("itemsize"),
        "Bytes of one rank's peer buffer: header 256 + dispatch rows "
        "R*T_max*H*itemsize + dispatch meta, weights and grouped ranks "
        "R*T_max*K*4 each + notify counts R*1024*4 + chunk starts and chunk "
        "counts R*(T_max+1)*4 each + combine rows R*T_max*H*4 (fp32) + dots "
        "R*T_max*K*4 + flags (4R+3)*8, each region rounded up to 256 bytes.");
  m.def("peer_dispatch_workspace_elems",
        &jax_ep::PeerDispatchWorkspaceElems, nb::arg("num_ranks"),
        nb::arg("max_tokens_per_rank"), nb::arg("num_topk"),
        nb::arg("num_experts"),
        "Elements W of the int32 `workspace` result of jax_ep_peer_dispatch: "
        "4R + R*(T_max+1) + 2*R*T_max*K + 2E + (R+1)*ceil(T_max/512) + R "
        "times the local layout's "
        "workspace for up to T_max tokens of K slots over E/R experts.");
  m.def("peer_group_create", &jax_ep::PeerGroupCreate,
        nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("num_ranks"),
        nb::arg("num_experts"), nb::arg("num_topk"), nb::arg("hidden"),
        nb::arg("max_tokens_per_rank"), nb::arg("itemsize"),
        nb::arg("capacity"), nb::arg("num_sms"), nb::arg("timeout_s"),
        "Allocates this rank's peer buffer, device state and error mailbox on "
        "`device_ordinal`, loads every peer kernel there; returns a "
        "process-unique group id.");
  m.def("peer_group_ipc_handle", &jax_ep::PeerGroupIpcHandle,
        nb::arg("group_id"),
        "The 64-byte cudaIpcMemHandle_t of the group's buffer.");
  m.def("peer_group_connect", &jax_ep::PeerGroupConnect, nb::arg("group_id"),
        nb::arg("handles"),
        "Opens handles[r] of every rank r (the own one is ignored), checks "
        "each peer's configuration header and builds the pointer table.");
  m.def("peer_group_connect_local", &jax_ep::peer::ConnectLocal,
        nb::arg("group_ids"),
        "Connects groups of this process, group_ids[r] = rank r, enabling "
        "peer access between distinct devices. An op given any id of the set "
        "runs with the member on its current device.");
  m.def("peer_group_pointer_table", &jax_ep::peer::PointerTable,
        nb::arg("group_id"),
        "The group's peer pointer table as integers (empty before connect).");
  m.def("peer_group_receives_while_sending",
        &jax_ep::peer::ReceivesWhileSending, nb::arg("group_id"),
        "Whether the group's dispatch places the other ranks' rows while it "
        "sends (every rank on a GPU of its own, native P2P atomics between "
        "them; decided on connect).");
  m.def("peer_group_error", &jax_ep::peer::ErrorMessage, nb::arg("group_id"),
        "The message of the group's first timeout, or None (no sync).");
  m.def("peer_group_destroy", &jax_ep::peer::Destroy, nb::arg("group_id"),
        "Synchronizes the group's device and frees the group. Idempotent; "
        "unknown ids are a no-op.");
  m.def("limits", &jax_ep::Limits,
        "The kernels' limits, {name: value}; jax_ep.limits checks a group "
        "against them when it is created, the handlers check every call.");
}
