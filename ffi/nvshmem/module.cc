// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// nanobind module `jax_ep._jax_ep_nvshmem`: NVSHMEM for jax_ep's network
// transport (ffi/nvshmem/runtime.h). Built only when the nvidia-nvshmem wheel
// is present at build time; it needs libnvshmem_host.so.3 loaded first
// (jax_ep/backends/nvshmem.py does that from the same wheel).

#include <string>

#include "ffi/nvshmem/runtime.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"

namespace nb = nanobind;

NB_MODULE(_jax_ep_nvshmem, m) {
  m.doc() = "NVSHMEM's life cycle for jax_ep's network transport.";
  m.def("compiled_version", &jax_ep::nvshmem::CompiledVersion,
        "The NVSHMEM version this module was built against.");
  m.def("library_version", &jax_ep::nvshmem::LibraryVersion,
        "The version of the loaded libnvshmem_host.");
  m.def("init_status", &jax_ep::nvshmem::InitStatus,
        "nvshmemx_init_status() of this process.");
  m.def(
      "unique_id",
      []() {
        const std::string id = jax_ep::nvshmem::UniqueId();
        return nb::bytes(id.data(), id.size());
      },
      "A fresh NVSHMEM unique id (128 bytes).");
  m.def(
      "init",
      [](nb::bytes uid, int rank, int num_ranks, int device) {
        const auto r = jax_ep::nvshmem::Init(
            std::string(uid.c_str(), uid.size()), rank, num_ranks, device);
        nb::dict d;
        d["pe"] = r.pe;
        d["num_pes"] = r.num_pes;
        d["status"] = r.status;
        d["joined"] = r.joined;
        return d;
      },
      nb::arg("unique_id"), nb::arg("rank"), nb::arg("num_ranks"),
      nb::arg("device"),
      "Joins NVSHMEM as PE `rank` of `num_ranks` on CUDA device `device`.");
  m.def("ring_probe", &jax_ep::nvshmem::RingProbe, nb::arg("bytes"),
        nb::arg("timeout_s"),
        "Collective: put-with-signal of `bytes` to the next PE; True when this "
        "PE's own arrived intact within `timeout_s`.");
  m.def("symmetric_alloc", &jax_ep::nvshmem::SymmetricAlloc, nb::arg("bytes"),
        "Collective: nvshmem_malloc of `bytes`, zeroed; its device address.");
  m.def("symmetric_free", &jax_ep::nvshmem::SymmetricFree, nb::arg("address"),
        "Collective: nvshmem_free of an address symmetric_alloc returned.");
  m.def("peer_address", &jax_ep::nvshmem::PeerAddress, nb::arg("address"),
        nb::arg("pe"),
        "nvshmem_ptr: PE `pe`'s copy of a symmetric address as this process "
        "maps it, or 0 where only puts reach it.");
  m.def("send_address", &jax_ep::nvshmem::SendAddress,
        "The address of the put launcher a network group calls "
        "(group_connect_table's network_send).");
  m.def("warm_put_kernels", &jax_ep::nvshmem::WarmPutKernels, nb::arg("device"),
        "Launches the put kernels once (returning at once) on `device`.");
  m.def("put_kernels_local_bytes", &jax_ep::nvshmem::PutKernelsLocalBytes,
        "Local memory per thread of the put kernels (reserved by "
        "warm_put_kernels at connect).");
  m.def("finalize", &jax_ep::nvshmem::Finalize,
        "Finalises NVSHMEM if jax_ep initialised it (collective).");
}
