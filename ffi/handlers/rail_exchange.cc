// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of the rail exchange (kernels: ffi/kernels/rail_exchange.cu;
// puts: the network transport), the network hop of the high-throughput ops
// across hosts (jax_ep/backends/hierarchical.py). Per rank, on a network group of Hn
// hosts, no batch dims:
//
// jax_ep_rail_exchange
//   index `[Hn, T_max]` int32 (row j of the block for host h is row
//   index[h, j] of every source), counts `[Hn]` int32 (rows of each block),
//   pes `[Hn]` int32 (the rail peer on each host: the rank with this rank's
//   local index there, this rank on its own host), then 1 to 4 sources
//   `[N_f, ...]` (any element type, rows of a multiple of 4 bytes) ->
//   recv_counts `[Hn]` int32, status `[]` int32 (0 ok, 1 the group failed),
//   then per source `[Hn * T_max, ...]` of its element type and row size:
//   row h * T_max + j is the row the rail peer on host h sent (zero for
//   j >= recv_counts[h]). attrs: group.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/group_common.h"
#include "ffi/handlers/handlers.h"
#include "ffi/kernels/network.h"
#include "ffi/kernels/rail_kernels.h"
#include "ffi/runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using group_ffi::CheckShape;

constexpr char kOp[] = "jax_ep_rail_exchange";

// Rows and bytes per row of an operand `[N, ...]` (a scalar is one row).
void RowsAndBytes(ffi::Span<const int64_t> dims, size_t size_bytes,
                  int64_t* rows, int64_t* row_bytes) {
  *rows = dims.size() == 0 ? 1 : dims[0];
  *row_bytes = *rows > 0 ? static_cast<int64_t>(size_bytes) / *rows : 0;
}

ffi::Error RailExchangeImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> index,
                            ffi::Buffer<ffi::S32> counts,
                            ffi::Buffer<ffi::S32> pes, ffi::RemainingArgs srcs,
                            ffi::ResultBuffer<ffi::S32> recv_counts,
                            ffi::ResultBuffer<ffi::S32> status,
                            ffi::RemainingRets dsts, group_ffi::GroupRef ref) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::GetGroup(
      kOp, ref, &group, /*network_ok=*/true));
  const runtime::Group& g = *group;
  const int64_t hosts = g.view.num_hosts;
  const int64_t t_max = g.config.max_tokens;
  if (!g.config.network || hosts < 2 || g.network_send == nullptr) {
    return ffi_utils::InvalidArgument(
        kOp, "native group " + std::to_string(ref.id) +
                 " is not a network group of several hosts");
  }
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kOp, "index", index.dimensions(),
                                        {hosts, t_max}, "[Hn, T_max]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "counts", counts.dimensions(), {hosts}, "[Hn]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kOp, "pes", pes.dimensions(), {hosts}, "[Hn]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(
      kOp, "recv_counts", recv_counts->dimensions(), {hosts}, "[Hn]"));
  if (srcs.size() < 1 || srcs.size() > rail::kMaxRailFields ||
      dsts.size() != srcs.size()) {
    return ffi_utils::InvalidArgument(
        kOp, "expected 1 to " + std::to_string(rail::kMaxRailFields) +
                 " sources and one result per source, got " +
                 std::to_string(srcs.size()) + " sources and " +
                 std::to_string(dsts.size()) + " results");
  }
  rail::Fields fields;
  fields.num = static_cast<int32_t>(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const std::string name = "source " + std::to_string(i);
    auto src = srcs.get<ffi::AnyBuffer>(i);
    auto dst = dsts.get<ffi::AnyBuffer>(i);
    if (!src.has_value() || !dst.has_value()) {
      return ffi_utils::InvalidArgument(kOp, name + " is not an array");
    }
    int64_t rows = 0, row_bytes = 0, out_rows = 0, out_bytes = 0;
    RowsAndBytes(src->dimensions(), src->size_bytes(), &rows, &row_bytes);
    RowsAndBytes((*dst)->dimensions(), (*dst)->size_bytes(), &out_rows,
                 &out_bytes);
    if (rows < 1 || row_bytes < 4 || row_bytes % 4 != 0) {
      return ffi_utils::InvalidArgument(
          kOp, name + " has shape " +
                   ffi_utils::ShapeString(src->dimensions()) +
                   "; expected at least one row of a multiple of 4 bytes");
    }
    if (out_rows != hosts * t_max || out_bytes != row_bytes ||
        (*dst)->element_type() != src->element_type()) {
      return ffi_utils::InvalidArgument(
          kOp, "result " + std::to_string(i) + " has shape " +
                   ffi_utils::ShapeString((*dst)->dimensions()) +
                   ", expected [Hn * T_max = " + std::to_string(hosts * t_max) +
                   ", ...] with the rows of " + name + " (" +
                   std::to_string(row_bytes) + " bytes) and its element type");
    }
    fields.src[i] = src->untyped_data();
    fields.rows[i] = rows;
    fields.dst[i] = (*dst)->untyped_data();
    fields.bytes[i] = row_bytes;
  }
  const int64_t record = rail::RecordBytes(fields);
  if (record > g.view.layout.rail_record_bytes) {
    return ffi_utils::InvalidArgument(
        kOp, "a row of the sources takes " + std::to_string(record) +
                 " bytes (16-byte aligned fields), more than the group's rail "
                 "records hold (" +
                 std::to_string(g.view.layout.rail_record_bytes) +
                 " bytes: a token's row, K ids and K weights)");
  }
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, rail::Pack(g.view, fields, index.typed_data(), counts.typed_data(),
                      pes.typed_data(), stream));
  const network::Send send{network::kRailSend,  g.view,           nullptr,
                           counts.typed_data(), pes.typed_data(), record};
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, static_cast<cudaError_t>(g.network_send(&send, stream)));
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, rail::WaitAndUnpack(g.view, fields, counts.typed_data(),
                               pes.typed_data(), recv_counts->typed_data(),
                               status->typed_data(), stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpRailExchange, jax_ep::RailExchangeImpl,
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // index
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // counts
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // pes
    .RemainingArgs()                                // sources
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // recv_counts
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // status
    .RemainingRets()                                // one per source
    .Attr<jax_ep::group_ffi::GroupRef>("group"));   // group_common.h
