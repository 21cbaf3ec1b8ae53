// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The checks both fp8 dispatch handlers (jax_ep_local_dispatch_fp8,
// jax_ep_peer_dispatch_fp8) make of their rows: the `format` attribute, the
// source rows (activations to quantise, or e4m3 rows with their scales) and
// the two split results, each message naming the value and what it takes.
// The wire format itself: ffi/kernels/fp8_rows.h.

#ifndef JAX_EP_FFI_HANDLERS_FP8_CHECKS_H_
#define JAX_EP_FFI_HANDLERS_FP8_CHECKS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/kernels/fp8_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::fp8_checks {

namespace ffi = ::xla::ffi;
using ffi_utils::Dims;
using ffi_utils::InvalidArgument;
using ffi_utils::ShapeString;

// `format` (0 FP8, 1 FP8_POW2_SCALES, 2 FP8_UE8M0) and `hidden` for it.
inline ffi::Error CheckFormat(std::string_view op, int64_t format,
                              int64_t hidden, fp8::ScaleFormat* out) {
  if (!fp8::ValidScaleFormat(format)) {
    return InvalidArgument(
        op, "attribute format is " + std::to_string(format) +
                ", expected 0 (fp8, scales amax / 448), 1 (power-of-two "
                "scales) or 2 (UE8M0 scales)");
  }
  *out = static_cast<fp8::ScaleFormat>(format);
  if (!fp8::ValidHidden(hidden, *out)) {
    const bool ue8m0 = *out == fp8::ScaleFormat::kUe8m0;
    return InvalidArgument(
        op, "x hidden size H is " + std::to_string(hidden) +
                ", expected a multiple of " +
                std::to_string(ue8m0 ? fp8::kUe8m0Word : fp8::kScaleBlock) +
                (ue8m0 ? " (four UE8M0 scales per int32)"
                       : " (one scale per 128 channels)"));
  }
  return ffi::Error::Success();
}

// Scale words per row: H / 128 float32, or H / 512 int32 for UE8M0.
inline int64_t ScaleWords(int64_t hidden, fp8::ScaleFormat f) {
  return fp8::ScaleBytes(hidden, f) / 4;
}

inline ffi::DataType ScaleDtype(fp8::ScaleFormat f) {
  return f == fp8::ScaleFormat::kUe8m0 ? ffi::DataType::S32
                                       : ffi::DataType::F32;
}

inline std::string ScaleDoc(fp8::ScaleFormat f, std::string_view rows) {
  return f == fp8::ScaleFormat::kUe8m0
             ? "[" + std::string(rows) + ", H/512] int32"
             : "[" + std::string(rows) + ", H/128] float32";
}

// `scales` (operand or result `name`) must be `[B..., rows, ScaleWords]` of
// the format's dtype, with the batch dims `batch` (nb of them).
inline ffi::Error CheckScales(std::string_view op, std::string_view name,
                              Dims dims, ffi::DataType dtype, Dims batch,
                              size_t nb, int64_t rows,
                              std::string_view rows_doc, int64_t hidden,
                              fp8::ScaleFormat f) {
  const std::string doc = ScaleDoc(f, rows_doc);
  const int64_t words = ScaleWords(hidden, f);
  bool ok = dims.size() == nb + 2 && dims[nb] == rows && dims[nb + 1] == words;
  for (size_t i = 0; ok && i < nb; ++i) ok = dims[i] == batch[i];
  if (!ok) {
    return InvalidArgument(
        op, std::string(name) + " must have shape " + doc + " = [" +
                (nb > 0 ? "B..., " : "") + std::to_string(rows) + ", " +
                std::to_string(words) + "], got shape " + ShapeString(dims));
  }
  if (dtype != ScaleDtype(f)) {
    return InvalidArgument(op, std::string(name) + " must be " + doc +
                                   " for this format, got dtype code " +
                                   std::to_string(static_cast<int>(dtype)));
  }
  return ffi::Error::Success();
}

// The source rows: `x` `[B..., T, H]` (dims; nb batch dims) in an activation
// dtype, quantised by the kernel (`given` false: `x_scales` is not read),
// or float8_e4m3fn with `x_scales` `[B..., T, ScaleWords]` (`given` true).
// `itemsize` > 0: the activations' element size the group was made for.
inline ffi::Error CheckSource(std::string_view op, bool given,
                              const ffi::AnyBuffer& x,
                              const ffi::AnyBuffer& x_scales, size_t nb,
                              int64_t num_tokens, int64_t hidden,
                              fp8::ScaleFormat f, int64_t itemsize,
                              fp8::Rows* rows) {
  rows->format = f;
  rows->x = x.untyped_data();
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(op, "x", x.untyped_data()));
  if (given) {
    if (x.element_type() != ffi::DataType::F8E4M3FN) {
      return InvalidArgument(
          op, "x must be float8_e4m3fn rows when given with x_scales, got "
              "dtype code " +
                  std::to_string(static_cast<int>(x.element_type())));
    }
    JAX_EP_FFI_RETURN_IF_ERROR(CheckScales(
        op, "x_scales", x_scales.dimensions(), x_scales.element_type(),
        x.dimensions(), nb, num_tokens, "T", hidden, f));
    rows->source = fp8::Source::kGiven;
    rows->scales = x_scales.untyped_data();
    return ffi::Error::Success();
  }
  JAX_EP_FFI_RETURN_IF_ERROR(ffi_utils::CheckActivationDtype(
      op, "x (rows to quantise)", x.element_type(), &rows->dtype));
  const int64_t bytes = rows->dtype == ElementType::kF32 ? 4 : 2;
  if (itemsize > 0 && bytes != itemsize) {
    return InvalidArgument(
        op, "x has " + std::to_string(bytes) +
                "-byte elements but the group was created for itemsize " +
                std::to_string(itemsize));
  }
  rows->source = fp8::Source::kQuantize;
  rows->scales = nullptr;
  return ffi::Error::Success();
}

// The split results: recv_x `[B..., rows, H]` float8_e4m3fn and
// recv_scales `[B..., rows, ScaleWords]`, batch dims `batch` (nb).
inline ffi::Error CheckResults(std::string_view op,
                               const ffi::AnyBuffer& recv_x,
                               const ffi::AnyBuffer& recv_scales, Dims batch,
                               size_t nb, int64_t rows,
                               std::string_view rows_doc, int64_t hidden,
                               fp8::ScaleFormat f) {
  const Dims dims = recv_x.dimensions();
  bool ok = dims.size() == nb + 2 && dims[nb] == rows && dims[nb + 1] == hidden;
  for (size_t i = 0; ok && i < nb; ++i) ok = dims[i] == batch[i];
  if (!ok) {
    return InvalidArgument(
        op, "recv_x must have shape [" + std::string(nb > 0 ? "B..., " : "") +
                std::string(rows_doc) + ", H] = [" + std::to_string(rows) +
                ", " + std::to_string(hidden) + "], got shape " +
                ShapeString(dims));
  }
  if (recv_x.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(
        op, "recv_x must be float8_e4m3fn, got dtype code " +
                std::to_string(static_cast<int>(recv_x.element_type())));
  }
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(op, "recv_x", recv_x.untyped_data()));
  return CheckScales(op, "recv_scales", recv_scales.dimensions(),
                     recv_scales.element_type(), batch, nb, rows, rows_doc,
                     hidden, f);
}

}  // namespace jax_ep::fp8_checks

#endif  // JAX_EP_FFI_HANDLERS_FP8_CHECKS_H_
