// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// nanobind module `jax_ep._jax_ep_ffi`: the CUDA custom calls of jax_ep.
//
// Importing it makes no CUDA call (it loads on machines without a GPU); the
// Python side registers the handlers with
//   for name, capsule in _jax_ep_ffi.registrations().items():
//     jax.ffi.register_ffi_target(name, capsule, platform="CUDA")

#include <cstdint>

#include <cuda_runtime.h>

#include "ffi/handlers/handlers.h"
#include "ffi/kernels/ep_kernels.h"
#include "nanobind/nanobind.h"

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
  m.def("cuda_runtime_version", &jax_ep::CudaRuntimeVersion,
        "CUDA runtime version the extension was built with, e.g. 13000.");
  m.attr("MAX_EXPERTS") = jax_ep::kMaxExperts;
  m.attr("MAX_TOPK") = jax_ep::kMaxTopk;
  m.attr("HIDDEN_MULTIPLE") = jax_ep::kHiddenMultiple;
}
