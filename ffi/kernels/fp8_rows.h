// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The fp8 rows of the high-throughput dispatch (jax_ep.RowFormat.FP8,
// FP8_POW2_SCALES, FP8_UE8M0 as a group's `wire_format`): what a row is on
// the wire and where the kernels read it from. The device-side rounding:
// fp8_quantize.cuh.
//
// NOTES: the wire row. A token travels as one packed byte row of
// RowBytes(H, format) bytes: its H e4m3 bytes, then its scales (ScaleBytes:
// one float32 per 128 channels, or one UE8M0 exponent byte per 128 channels,
// four to an int32 word, the first in the lowest byte), then zero to 15
// bytes of padding that nothing reads. A whole number of 16-byte vectors, so
// the peer transport moves it with its row loops, at a stride of
// RowBytes / 16 vectors, through the group's staging rows (H * itemsize
// bytes: at least RowBytes for every H >= 128, so a group sized for its
// activations carries either format). Every output splits at the receiver:
// recv_x `[capacity, H]` e4m3 and recv_scales `[capacity, ScaleBytes / 4]`
// 32-bit words (float32, or int32 of packed exponents).

#ifndef JAX_EP_FFI_KERNELS_FP8_ROWS_H_
#define JAX_EP_FFI_KERNELS_FP8_ROWS_H_

#include <cstdint>

#include "ffi/kernels/ep_common.h"

namespace jax_ep::fp8 {

inline constexpr int64_t kScaleBlock = 128;  // channels per scale
inline constexpr int64_t kUe8m0Word = 512;   // channels per int32 of UE8M0

// How a row's scales are computed and stored: jax_ep.RowFormat's fp8
// members (jax_ep/_native/fp8.py fp8_quantize is the rounding).
enum class ScaleFormat : int32_t {
  kFloat = 0,       // amax / 448 (1 for an all-zero block), float32: FP8
  kPowerOfTwo = 1,  // that, rounded up to a power of two: FP8_POW2_SCALES
  kUe8m0 = 2,       // a power of two, stored as its exponent byte: FP8_UE8M0
};

inline bool ValidScaleFormat(int64_t f) { return f >= 0 && f <= 2; }

// H a multiple of 128 (512 for UE8M0): the scales of a row are whole words.
inline bool ValidHidden(int64_t hidden, ScaleFormat f) {
  return hidden > 0 &&
         hidden % (f == ScaleFormat::kUe8m0 ? kUe8m0Word : kScaleBlock) == 0;
}

// Bytes of a row's scales: 4 per 128 channels, or 1 per 128 with UE8M0.
__host__ __device__ inline int64_t ScaleBytes(int64_t hidden, ScaleFormat f) {
  return f == ScaleFormat::kUe8m0 ? hidden / kScaleBlock
                                  : hidden / kScaleBlock * 4;
}

// Bytes of one packed wire row (see the NOTES above).
__host__ __device__ inline int64_t RowBytes(int64_t hidden, ScaleFormat f) {
  return hidden + (ScaleBytes(hidden, f) + 15) / 16 * 16;
}

// Where a dispatch takes its tokens' fp8 rows from.
enum class Source : int32_t {
  kQuantize = 0,  // activations `x` `[T, H]` of `dtype`: quantised here
  kGiven = 1,     // e4m3 rows `x` `[T, H]` with their `scales`
                  // `[T, ScaleBytes / 4]` words, as the caller made them
  kPacked = 2,    // packed wire rows `x` `[T, RowBytes]` (a peer staging
                  // buffer: the e4m3 bytes, the scales at byte H)
};

// A dispatch's source rows: `x` (and `scales` for kGiven), 16-byte aligned.
struct Rows {
  Source source = Source::kQuantize;
  ElementType dtype = ElementType::kBF16;  // kQuantize: x's element type
  ScaleFormat format = ScaleFormat::kFloat;
  const void* x = nullptr;
  const void* scales = nullptr;  // kGiven only
};

}  // namespace jax_ep::fp8

#endif  // JAX_EP_FFI_KERNELS_FP8_ROWS_H_
