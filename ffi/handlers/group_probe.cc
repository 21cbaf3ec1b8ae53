// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_group_probe`, an XLA:CPU target (module.cc,
// cpu_registrations()): it decodes the `group` attribute exactly as the ops on
// a native group do (group_ffi::GroupRef, by field name) and writes what it
// decoded. The group ops themselves run only on GPUs; this lets the CPU tests
// (tests/test_group_ids.py) run XLA's decoding of the attribute that
// jax_ep/backends/cuda_ops.py builds.
//
//   attrs   group (group_common.h, GroupRef)
//   fields  `[9]` int32: id, num_ranks, num_experts, num_topk, hidden,
//           max_tokens_per_rank, itemsize, capacity, expert_alignment

#include <cstdint>

#include "ffi/handlers/group_common.h"
#include "ffi/handlers/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;

ffi::Error GroupProbeImpl(ffi::ResultBuffer<ffi::S32> fields,
                          group_ffi::GroupRef ref) {
  const int64_t values[] = {ref.id,        ref.num_ranks,
                            ref.num_experts, ref.num_topk,
                            ref.hidden,    ref.max_tokens_per_rank,
                            ref.itemsize,  ref.capacity,
                            ref.expert_alignment};
  constexpr int64_t kNumFields = sizeof(values) / sizeof(values[0]);
  if (fields->element_count() != kNumFields) {
    return ffi_utils::InvalidArgument(
        "jax_ep_group_probe",
        "fields must have " + std::to_string(kNumFields) + " elements");
  }
  for (int64_t i = 0; i < kNumFields; ++i) {
    fields->typed_data()[i] = static_cast<int32_t>(values[i]);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxEpGroupProbe, jax_ep::GroupProbeImpl,
    xla::ffi::Ffi::Bind()
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // fields
        .Attr<jax_ep::group_ffi::GroupRef>("group"));   // group_common.h
