// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The fp8 rows' rounding on the device, for both modes' dispatches (the
// low-latency pair's row formats, the high-throughput dispatch's wire
// formats: fp8_rows.h), and the mover of one token's fp8 row the
// high-throughput kernels share (local_dispatch_fp8.cu, peer_dispatch.cu).
// Internal: included only by kernel translation units.
//
// NOTES: the rounding is jax_ep/_native/fp8.py fp8_quantize's, bit for bit,
// so the reference backend's closed form is the kernels' test oracle: per
// 128-channel block scale = amax * fp32(1 / 448) (1 for an all-zero block),
// optionally the smallest power of two >= that (exactly, on the bits), then
// every element x / scale by IEEE division (no fast math) to e4m3 with
// round-to-nearest-even, saturating at 448 (|x / scale| <= 448 already). A
// UE8M0 scale is its float32's exponent byte.

#ifndef JAX_EP_FFI_KERNELS_FP8_QUANTIZE_CUH_
#define JAX_EP_FFI_KERNELS_FP8_QUANTIZE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/fp8_rows.h"
#include "ffi/kernels/kernel_utils.cuh"

namespace jax_ep::fp8 {
namespace {

// The smallest power of two >= s (s > 0 and finite), exactly.
__device__ __forceinline__ float RoundUpPowerOfTwo(float s) {
  const uint32_t bits = __float_as_uint(s);
  const uint32_t exponent = bits & 0x7f800000u;
  const uint32_t mantissa = bits & 0x007fffffu;
  if (exponent == 0u) {  // subnormal: the next power of two of the mantissa
    if ((mantissa & (mantissa - 1u)) == 0u) return s;
    return __uint_as_float(1u << (32 - __clz(mantissa)));
  }
  if (mantissa == 0u) return s;
  return __uint_as_float(exponent + 0x00800000u);
}

// A UE8M0 scale: the biased exponent byte of a power-of-two float32.
__device__ __forceinline__ uint32_t Ue8m0Byte(float s) {
  return (__float_as_uint(s) >> 23) & 0xffu;
}

// Quantises one 16-byte vector `v` of T (kElems channels) of a 128-channel
// block whose Q = 128 / kElems vectors are held by Q consecutive lanes of
// one warp, in order: q gets its kElems e4m3 bytes (four to a word, the
// first channel in the lowest byte), *scale the block's scale. The block's
// amax is a Q-lane shuffle reduction: every lane of the warp must call it
// (lanes past a row pass zeros, which form whole blocks of their own).
template <typename T, bool kPowerOfTwo>
__device__ __forceinline__ void QuantizeVec(
    const uint4& v, uint32_t (&q)[detail::Vec16<T>::kElems / 4],
    float* scale) {
  constexpr int kElems = detail::Vec16<T>::kElems;
  constexpr int kQ = static_cast<int>(kScaleBlock) / kElems;
  static_assert(32 % kQ == 0, "a scale block spans whole lanes of one warp");
  float f[kElems];
  detail::Vec16<T>::Unpack(v, f);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kElems; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int off = kQ / 2; off > 0; off >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(detail::kFullMask, amax, off));
  }
  // The reference's rounding: amax * fp32(1 / 448), 1 for zeros.
  float s = amax > 0.0f ? amax * static_cast<float>(1.0 / 448.0) : 1.0f;
  if constexpr (kPowerOfTwo) s = RoundUpPowerOfTwo(s);
  *scale = s;
#pragma unroll
  for (int i = 0; i < kElems / 4; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; b += 2) {
      // IEEE division (no fast math), e4m3 round-to-nearest-even,
      // saturating at 448 like the reference's |x / s| <= 448.
      const float2 pair = make_float2(f[4 * i + b] / s, f[4 * i + b + 1] / s);
      const __nv_fp8x2_storage_t p =
          __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
      word |= static_cast<uint32_t>(p) << (8 * b);
    }
    q[i] = word;
  }
}

// Moves token `t`'s fp8 row (rows.source; fp8_rows.h) with the whole block
// of kThreads threads (a multiple of 32): the row is read once, quantised
// once (kQuantize), and written to each destination i < num_dests for which
// `dest(i, &q, &s)` returns true (block-uniform), as its H e4m3 bytes at q
// and its ScaleBytes scale bytes at s (a packed wire row: s = q + H; a split
// one: rows of recv_x and recv_scales). kVecs: source vectors in flight per
// thread. kPeerSource: the source was written by other GPUs before this
// kernel (ld.global.cg, never the non-coherent path).
// Alignment: q 8-byte aligned, s 4-byte aligned, the source rows 16-byte
// aligned (H a multiple of 128, 512 for UE8M0: ValidHidden).
template <typename T, Source kSource, int kThreads, int kVecs,
          bool kPeerSource, typename Dest>
__device__ __forceinline__ void MoveRow(const Rows& rows, int64_t t,
                                        int32_t hidden, int num_dests,
                                        Dest&& dest) {
  static_assert(kThreads % 32 == 0, "whole warps");
  const ScaleFormat format = rows.format;
  if constexpr (kSource == Source::kQuantize) {
    constexpr int kElems = detail::Vec16<T>::kElems;
    constexpr int kQ = static_cast<int>(kScaleBlock) / kElems;
    const int32_t xv = hidden / kElems;  // source vectors (a multiple of kQ)
    const uint4* src = static_cast<const uint4*>(rows.x) + t * xv;
    const bool pow2 = format != ScaleFormat::kFloat;
    for (int32_t v0 = 0; v0 < xv; v0 += kThreads * kVecs) {
      uint32_t q[kVecs][kElems / 4];
      float scale[kVecs];
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const int32_t j = v0 + u * kThreads + static_cast<int32_t>(threadIdx.x);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (j < xv) {
          v = kPeerSource ? __ldcg(src + j) : detail::LoadVec(src + j);
        }
        // NOTES: v0 and u * kThreads are multiples of 32, so the kQ lanes of
        // one block are kQ consecutive lanes of one warp, as QuantizeVec
        // needs; the branch is block-uniform.
        if (pow2) {
          QuantizeVec<T, true>(v, q[u], &scale[u]);
        } else {
          QuantizeVec<T, false>(v, q[u], &scale[u]);
        }
      }
      for (int i = 0; i < num_dests; ++i) {
        char* qd = nullptr;
        char* sd = nullptr;
        if (!dest(i, &qd, &sd)) continue;  // block-uniform
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          const int32_t j =
              v0 + u * kThreads + static_cast<int32_t>(threadIdx.x);
          if (j >= xv) continue;
          if constexpr (kElems == 8) {
            reinterpret_cast<uint2*>(qd)[j] = make_uint2(q[u][0], q[u][1]);
          } else {
            reinterpret_cast<uint32_t*>(qd)[j] = q[u][0];
          }
          if (j % kQ == 0) {
            if (format == ScaleFormat::kUe8m0) {
              reinterpret_cast<uint8_t*>(sd)[j / kQ] =
                  static_cast<uint8_t>(Ue8m0Byte(scale[u]));
            } else {
              reinterpret_cast<float*>(sd)[j / kQ] = scale[u];
            }
          }
        }
      }
    }
  } else {
    // kGiven: x `[T, H]` e4m3 and scales `[T, ScaleBytes]`; kPacked: rows of
    // RowBytes, the scales at byte H of each.
    const int64_t scale_bytes = ScaleBytes(hidden, format);
    const int64_t stride =
        kSource == Source::kPacked ? RowBytes(hidden, format) : hidden;
    const char* q_src = static_cast<const char*>(rows.x) + t * stride;
    const char* s_src =
        kSource == Source::kPacked
            ? q_src + hidden
            : static_cast<const char*>(rows.scales) + t * scale_bytes;
    const int32_t qv = hidden / 16;
    const uint4* qs = reinterpret_cast<const uint4*>(q_src);
    for (int32_t v0 = 0; v0 < qv; v0 += kThreads * kVecs) {
      uint4 v[kVecs];
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const int32_t j = v0 + u * kThreads + static_cast<int32_t>(threadIdx.x);
        if (j < qv) {
          v[u] = kPeerSource ? __ldcg(qs + j) : detail::LoadVec(qs + j);
        }
      }
      for (int i = 0; i < num_dests; ++i) {
        char* qd = nullptr;
        char* sd = nullptr;
        if (!dest(i, &qd, &sd)) continue;  // block-uniform
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          const int32_t j =
              v0 + u * kThreads + static_cast<int32_t>(threadIdx.x);
          if (j < qv) reinterpret_cast<uint4*>(qd)[j] = v[u];
        }
      }
    }
    const int32_t sw = static_cast<int32_t>(scale_bytes / 4);
    const uint32_t* ss = reinterpret_cast<const uint32_t*>(s_src);
    for (int32_t w0 = 0; w0 < sw; w0 += kThreads) {
      const int32_t w = w0 + static_cast<int32_t>(threadIdx.x);
      uint32_t word = 0;
      if (w < sw) word = kPeerSource ? __ldcg(ss + w) : __ldg(ss + w);
      for (int i = 0; i < num_dests; ++i) {
        char* qd = nullptr;
        char* sd = nullptr;
        if (!dest(i, &qd, &sd)) continue;  // block-uniform
        if (w < sw) reinterpret_cast<uint32_t*>(sd)[w] = word;
      }
    }
  }
}

}  // namespace
}  // namespace jax_ep::fp8

#endif  // JAX_EP_FFI_KERNELS_FP8_QUANTIZE_CUH_
