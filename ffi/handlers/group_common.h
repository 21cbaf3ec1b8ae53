// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Helpers shared by the FFI adapters of the ops on a native group
// (ffi/handlers/peer_*.cc, low_latency.cc, rail_exchange.cc): the group
// of the current device (checked against the configuration the program was
// built for), the error of an earlier timeout, and shape checks
// for ops that take no batch dims; GetGroup, then CheckGroupTokens or
// CheckGroupRows, is the prologue of their handlers.

#ifndef JAX_EP_FFI_HANDLERS_GROUP_COMMON_H_
#define JAX_EP_FFI_HANDLERS_GROUP_COMMON_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/kernels/ep_common.h"
#include "ffi/runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::group_ffi {

namespace ffi = ::xla::ffi;
using ffi_utils::Dims;

// Rows of the `[capacity, H]` buffers the peer ops take and produce: at
// least one. NOTES: XLA:GPU crashed (segfault while compiling, seen on the H200
// with jaxlib 0.11.2) on a side-effecting custom call with a zero-row result,
// so with capacity 0 the Python layer passes one unused row and slices it off
// (it does the same for T = 0, see jax_ep/backends/cuda_ops.py).
inline int64_t StorageRows(int64_t capacity) {
  return capacity > 0 ? capacity : 1;
}

// The `group` attribute of every op on a native group: the group's number in
// this process (runtime::Create) and the configuration the program was built
// for, one named field each (an MLIR dictionary attribute, decoded by name;
// Python builds it from GROUP_FIELDS in jax_ep/backends/cuda_ops.py).
// NOTES: the id is process-local. A program traced in this process names this
// process's group (and jax's persistent compilation cache keys on the program
// text, id included, so a cached executable is one this process would have
// built); a program built in another process (exported, serialized) names
// that process's numbering, which the configuration catches wherever the
// group found differs (docs/decisions.md, "Group ids").
struct GroupRef {
  int64_t id;
  int64_t num_ranks;
  int64_t num_experts;
  int64_t num_topk;
  int64_t hidden;
  int64_t max_tokens_per_rank;
  int64_t itemsize;
  int64_t capacity;
  int64_t expert_alignment;
};

// The program's configuration against the group `ref.id` names here, field
// by field; the error names the group, the field, and both values.
inline ffi::Error CheckGroupConfig(std::string_view op, const GroupRef& ref,
                                   const runtime::Group& g) {
  const runtime::GroupConfig& c = g.config;
  struct Field {
    const char* name;
    int64_t program;
    int64_t here;
  };
  const Field fields[] = {
      {"num_ranks", ref.num_ranks, c.num_ranks},
      {"num_experts", ref.num_experts, c.num_experts},
      {"num_topk", ref.num_topk, c.num_topk},
      {"hidden", ref.hidden, c.hidden},
      {"max_tokens_per_rank", ref.max_tokens_per_rank, c.max_tokens},
      {"itemsize", ref.itemsize, c.itemsize},
      {"capacity", ref.capacity, c.capacity},
      {"expert_alignment", ref.expert_alignment, c.expert_alignment}};
  for (const Field& f : fields) {
    if (f.program == f.here) continue;
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(op) + ": the program was built for native group " +
            std::to_string(ref.id) + " with " + f.name + " = " +
            std::to_string(f.program) + ", but group " +
            std::to_string(ref.id) + " of this process has " + f.name +
            " = " + std::to_string(f.here) +
            " (group ids are numbered per process: a program built in "
            "another process, e.g. an exported or serialized one, names that "
            "process's groups; trace the program in this process)");
  }
  return ffi::Error::Success();
}

// The connected group `ref.id` on the current device, once its configuration
// matches the program's (CheckGroupConfig).
// NOTES: cudaGetDevice, not cudaStreamGetDevice (illegal during command-buffer
// capture, see kernel_utils.cuh). A group whose spins timed out earlier fails
// every later call with the mailbox message (kDeadlineExceeded).
// `network_ok`: the op runs on a group with ranks on other hosts (the
// low-latency ops and the rail exchange do; the high-throughput kernels
// address every peer by pointer, so across hosts they run on each host's own
// group, jax_ep/backends/hierarchical.py).
inline ffi::Error GetGroup(std::string_view op, const GroupRef& ref,
                           std::shared_ptr<const runtime::Group>* group,
                           bool network_ok = false) {
  const int64_t group_id = ref.id;
  int device = -1;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) {
    return ffi_utils::CudaError(op, "cudaGetDevice", err);
  }
  runtime::LookupResult found =
      runtime::Lookup(group_id, device);
  if (found.group == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": " + found.error);
  }
  JAX_EP_FFI_RETURN_IF_ERROR(CheckGroupConfig(op, ref, *found.group));
  if (std::optional<std::string> msg =
          runtime::PendingError(*found.group)) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      std::string(op) +
                          ": an earlier call on this native group "
                          "timed out: " +
                          *msg);
  }
  if (found.group->config.network && !network_ok) {
    return ffi::Error(
        ffi::ErrorCode::kUnimplemented,
        std::string(op) + ": native group " + std::to_string(group_id) +
            " has ranks on other hosts: the high-throughput kernels run on "
            "each host's own group there (jax_ep/backends/hierarchical.py)");
  }
  *group = std::move(found.group);
  return ffi::Error::Success();
}

inline std::string ExpectedString(std::initializer_list<int64_t> expected) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t e : expected) {
    if (i++ > 0) s += ", ";
    s += e >= 0 ? std::to_string(e) : std::string("?");
  }
  return s + "]";
}

// `dims` must be exactly `expected` (-1: any size). More dims than expected
// means a vmap added batch dims, which the peer ops do not take.
inline ffi::Error CheckShape(std::string_view op, std::string_view name,
                             Dims dims, std::initializer_list<int64_t> expected,
                             std::string_view shape_doc) {
  if (dims.size() > expected.size()) {
    return ffi_utils::InvalidArgument(
        op, "vmap of peer ops is not supported yet: " + std::string(name) +
                " has shape " + ffi_utils::ShapeString(dims) + ", expected " +
                std::string(shape_doc) + " with no leading batch dims (" +
                std::to_string(dims.size() - expected.size()) +
                " extra); call the op once per batch element");
  }
  if (dims.size() < expected.size()) {
    return ffi_utils::InvalidArgument(
        op, std::string(name) + " must have shape " + std::string(shape_doc) +
                " = " + ExpectedString(expected) + ", got shape " +
                ffi_utils::ShapeString(dims));
  }
  size_t i = 0;
  for (int64_t e : expected) {
    if (e >= 0 && dims[i] != e) {
      return ffi_utils::InvalidArgument(
          op, std::string(name) + " has shape " + ffi_utils::ShapeString(dims) +
                  " but must have shape " + std::string(shape_doc) + " = " +
                  ExpectedString(expected) + " (dim " + std::to_string(i) +
                  " is " + std::to_string(dims[i]) + ", expected " +
                  std::to_string(e) + ")");
    }
    ++i;
  }
  return ffi::Error::Success();
}

// Activation dtype of `name`: bf16 / f16 / f32 with the group's itemsize.
inline ffi::Error CheckGroupDtype(std::string_view op, std::string_view name,
                                  ffi::DataType dtype,
                                  const runtime::Group& g,
                                  ElementType* element_type) {
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckActivationDtype(op, name, dtype, element_type));
  const int64_t itemsize = *element_type == ElementType::kF32 ? 4 : 2;
  if (itemsize == g.config.itemsize) return ffi::Error::Success();
  return ffi_utils::InvalidArgument(
      op, std::string(name) + " has " + std::to_string(itemsize) +
              "-byte elements but native group " + std::to_string(g.id) +
              " was created for itemsize " + std::to_string(g.config.itemsize));
}

inline ffi::Error CheckTokens(std::string_view op, std::string_view name,
                              int64_t num_tokens,
                              const runtime::Group& g) {
  if (num_tokens >= 0 && num_tokens <= g.config.max_tokens) {
    return ffi::Error::Success();
  }
  return ffi_utils::InvalidArgument(
      op, std::string(name) + " has T = " + std::to_string(num_tokens) +
              " tokens, expected T <= max_tokens_per_rank = " +
              std::to_string(g.config.max_tokens) + " of native group " +
              std::to_string(g.id));
}

// With GetGroup, the prologue of the group ops' handlers: their leading
// activation operand `name`, `[N, H]` with the group's H, has `num_rows` rows
// (-1: any; their count into *rows when not null) and the group's element
// type.
inline ffi::Error CheckGroupRows(std::string_view op,
                                 const runtime::Group& g,
                                 std::string_view name,
                                 const ffi::AnyBuffer& operand,
                                 int64_t num_rows, std::string_view shape_doc,
                                 int64_t* rows, ElementType* element_type) {
  const Dims dims = operand.dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(op, name, dims, {num_rows, g.config.hidden}, shape_doc));
  if (rows != nullptr) *rows = dims[0];
  return CheckGroupDtype(op, name, operand.element_type(), g, element_type);
}

// The same for token rows `name` `[T, H]`: T (into *num_tokens) is at most
// the group's T_max.
inline ffi::Error CheckGroupTokens(std::string_view op,
                                   const runtime::Group& g,
                                   std::string_view name,
                                   const ffi::AnyBuffer& operand,
                                   int64_t* num_tokens,
                                   ElementType* element_type) {
  const Dims dims = operand.dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(op, name, dims, {-1, g.config.hidden}, "[T, H]"));
  *num_tokens = dims[0];
  JAX_EP_FFI_RETURN_IF_ERROR(CheckTokens(op, name, *num_tokens, g));
  return CheckGroupDtype(op, name, operand.element_type(), g, element_type);
}

inline ffi::Error CheckAttrEquals(std::string_view op, std::string_view attr,
                                  int64_t value, std::string_view what,
                                  int64_t expected) {
  if (value == expected) return ffi::Error::Success();
  return ffi_utils::InvalidArgument(
      op, "attribute " + std::string(attr) + " is " + std::to_string(value) +
              " but the native group has " + std::string(what) + " = " +
              std::to_string(expected));
}

// GetGroup for the peer ops that place rows by expert (dispatch,
// combine_vjp): their `num_experts` attribute must be the group's, their
// `capacity` a valid one.
inline ffi::Error GetPlacingGroup(
    std::string_view op, const GroupRef& ref, int64_t num_experts,
    int64_t capacity, std::shared_ptr<const runtime::Group>* group) {
  JAX_EP_FFI_RETURN_IF_ERROR(GetGroup(op, ref, group));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckAttrEquals(op, "num_experts", num_experts,
                                             "num_experts",
                                             (*group)->config.num_experts));
  return ffi_utils::CheckCapacity(op, capacity);
}

// The per-entry routing of the received side, as dispatch returns it and the
// later ops take it: entry_row, entry_weights `[R * T_max, K]`, recv_counts
// `[R]`.
inline ffi::Error CheckReceivedEntries(std::string_view op,
                                       const runtime::Group& g,
                                       Dims entry_row, Dims entry_weights,
                                       Dims recv_counts) {
  const int64_t num_rows = g.config.num_ranks * g.config.max_tokens;
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(op, "entry_row", entry_row,
                                        {num_rows, g.config.num_topk},
                                        "[R * T_max, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(op, "entry_weights", entry_weights,
                                        {num_rows, g.config.num_topk},
                                        "[R * T_max, K]"));
  return CheckShape(op, "recv_counts", recv_counts, {g.config.num_ranks},
                    "[R]");
}

}  // namespace jax_ep::group_ffi

// `group` decoded by field name: a field missing, added or of another type is
// an error of XLA's attribute decoding, never a field read in the wrong place.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jax_ep::group_ffi::GroupRef,
    ::xla::ffi::StructMember<int64_t>("id"),
    ::xla::ffi::StructMember<int64_t>("num_ranks"),
    ::xla::ffi::StructMember<int64_t>("num_experts"),
    ::xla::ffi::StructMember<int64_t>("num_topk"),
    ::xla::ffi::StructMember<int64_t>("hidden"),
    ::xla::ffi::StructMember<int64_t>("max_tokens_per_rank"),
    ::xla::ffi::StructMember<int64_t>("itemsize"),
    ::xla::ffi::StructMember<int64_t>("capacity"),
    ::xla::ffi::StructMember<int64_t>("expert_alignment"));

#endif  // JAX_EP_FFI_HANDLERS_GROUP_COMMON_H_
