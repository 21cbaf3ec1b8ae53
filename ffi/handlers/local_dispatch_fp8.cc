// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_local_dispatch_fp8` (kernel:
// ffi/kernels/local_dispatch_fp8.cu): the fp8 dispatch at one rank, each
// token quantised once (or its e4m3 row and scales taken as given) and
// placed along the local layout.
//
//   x            `[B..., T, H]` bf16/f16/f32 operand (quantised here), or
//                float8_e4m3fn with `given`
//   x_scales     `[B..., T, H/128]` float32 (`[B..., T, H/512]` int32 with
//                format 2) operand, read only with `given` (else any shape)
//   slot_row     `[B..., T, K]` int32 operand (from jax_ep_local_layout)
//   attrs        capacity: int64, format: int64 (0 FP8, 1 FP8_POW2_SCALES,
//                2 FP8_UE8M0), given: bool
//   recv_x       `[B..., capacity, H]` float8_e4m3fn
//   recv_scales  `[B..., capacity, H/128]` float32 (`H/512` int32 with
//                format 2): recv_x[slot_row[t, k]] and recv_scales[...] are
//                token t's; rows no slot names are not written.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/fp8_checks.h"
#include "ffi/handlers/handlers.h"
#include "ffi/kernels/fp8_rows.h"
#include "ffi/kernels/local_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using ffi_utils::CheckBatchDims;
using ffi_utils::CheckRank;
using ffi_utils::InvalidArgument;

constexpr char kOp[] = "jax_ep_local_dispatch_fp8";

ffi::Error LocalDispatchFp8Impl(cudaStream_t stream, ffi::AnyBuffer x,
                                ffi::AnyBuffer x_scales,
                                ffi::Buffer<ffi::S32> slot_row,
                                ffi::Result<ffi::AnyBuffer> recv_x,
                                ffi::Result<ffi::AnyBuffer> recv_scales,
                                int64_t capacity, int64_t format, bool given) {
  const ffi_utils::Dims x_dims = x.dimensions();
  if (x_dims.size() < 2) {
    return InvalidArgument(kOp, "x must have shape [B..., T, H] (rank >= 2), "
                                "got shape " +
                                    ffi_utils::ShapeString(x_dims));
  }
  const size_t nb = x_dims.size() - 2;
  const int64_t num_tokens = x_dims[nb];
  const int64_t hidden = x_dims[nb + 1];
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckCapacity(kOp, capacity));
  fp8::ScaleFormat f;
  JAX_EP_FFI_RETURN_IF_ERROR(fp8_checks::CheckFormat(kOp, format, hidden, &f));
  fp8::Rows rows;
  JAX_EP_FFI_RETURN_IF_ERROR(fp8_checks::CheckSource(
      kOp, given, x, x_scales, nb, num_tokens, hidden, f, /*itemsize=*/0,
      &rows));

  const ffi_utils::Dims sr_dims = slot_row.dimensions();
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(kOp, "slot_row", sr_dims, nb, 2, "[B..., T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(kOp, "slot_row", sr_dims, "x", x_dims, nb));
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckDim(
      kOp, "slot_row", sr_dims, nb, "T", num_tokens, "x T"));
  const int64_t num_topk = sr_dims[nb + 1];
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckTopk(kOp, "slot_row", num_tokens, num_topk));

  JAX_EP_FFI_RETURN_IF_ERROR(fp8_checks::CheckResults(
      kOp, *recv_x, *recv_scales, x_dims, nb, capacity, "capacity", hidden,
      f));

  const int64_t num_batches = ffi_utils::NumBatches(x_dims, nb);
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kOp, local::DispatchFp8(rows, slot_row.typed_data(),
                              recv_x->untyped_data(),
                              recv_scales->untyped_data(), num_batches,
                              num_tokens, num_topk, hidden, capacity, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(
    JaxEpLocalDispatchFp8, jax_ep::LocalDispatchFp8Impl,
    .Arg<xla::ffi::AnyBuffer>()                     // x
    .Arg<xla::ffi::AnyBuffer>()                     // x_scales
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // slot_row
    .Ret<xla::ffi::AnyBuffer>()                     // recv_x
    .Ret<xla::ffi::AnyBuffer>()                     // recv_scales
    .Attr<int64_t>("capacity")                      // capacity
    .Attr<int64_t>("format")                        // fp8::ScaleFormat
    .Attr<bool>("given"));                          // x is e4m3 + x_scales
