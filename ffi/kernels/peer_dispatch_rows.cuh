// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer, how the dispatch's send kernel (peer_dispatch.cu) moves one
// token's row in each of its three roles (push to the peers' staging rows,
// place this rank's own token, place a received staging row): PlainRows as
// the activations are, Fp8Rows quantised once into one packed wire row
// (fp8_rows.h) and split into recv_x and recv_scales on the receiving side.

#ifndef JAX_EP_FFI_KERNELS_PEER_DISPATCH_ROWS_CUH_
#define JAX_EP_FFI_KERNELS_PEER_DISPATCH_ROWS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/fp8_quantize.cuh"
#include "ffi/kernels/fp8_rows.h"
#include "ffi/kernels/peer_protocol.cuh"

namespace jax_ep::peer {

// Copies one row (rv 16-byte vectors) from src to each of the rows s_row[0..K)
// of recv_x that are >= 0, with the whole block (kCommThreads threads), the
// row read once. Block-uniform arguments.
template <bool kPeerSource>
__device__ __forceinline__ void PlaceRow(const uint4* __restrict__ src,
                                         const int32_t* s_row, int num_topk,
                                         int32_t rv,
                                         uint4* __restrict__ recv_x) {
  // NOTES: 32-bit vector indices (ValidView bounds rv); with 64-bit ones the
  // placing roles spilled at the 64 registers of the sending role.
  for (int32_t v0 = 0; v0 < rv; v0 += kCommThreads * kSendVecs) {
    uint4 v[kSendVecs];
#pragma unroll
    for (int u = 0; u < kSendVecs; ++u) {
      const int32_t j = v0 + u * kCommThreads + threadIdx.x;
      if (j < rv) v[u] = kPeerSource ? __ldcg(src + j) : LoadVec(src + j);
    }
    for (int k = 0; k < num_topk; ++k) {
      const int32_t row = s_row[k];
      if (row < 0) continue;  // block-uniform
      uint4* dst = recv_x + static_cast<int64_t>(row) * rv;
#pragma unroll
      for (int u = 0; u < kSendVecs; ++u) {
        const int32_t j = v0 + u * kCommThreads + threadIdx.x;
        if (j < rv) StoreMaybeStreaming<true>(dst + j, v[u]);
      }
    }
  }
}

// What the send kernel moves per token: the source rows, the split outputs
// and the staging row's size. Plain rows: `src.x` `[T, H]` in the
// activations' dtype into recv_x `[capacity, H]` of it (recv_scales unused);
// fp8 rows (fp8_rows.h): `src` as fp8::Rows, recv_x `[capacity, H]` e4m3 and
// recv_scales `[capacity, ScaleBytes / 4]`.
struct SendRows {
  fp8::Rows src;
  void* recv_x;
  void* recv_scales;
  int32_t rv;  // 16-byte vectors of a staging row (dispatch_rows' stride):
               // H * itemsize / 16 plain, fp8::RowBytes / 16 fp8
};

// The row moves of the send kernel's three roles, for rows moved as they
// are. Block-uniform arguments; s_row[k] < 0: no row for slot k.
struct PlainRows {
  // Token t to every destination s_dest[i < n] but this rank.
  __device__ __forceinline__ static void Push(const GroupView& g,
                                              char* const* s_peer,
                                              const int32_t* s_dest,
                                              const int32_t* s_pos, int32_t n,
                                              const SendRows& r, int64_t t) {
    const uint4* src = static_cast<const uint4*>(r.src.x) + t * r.rv;
    PushRow</*kSkipSelf=*/true, /*kStreaming=*/true>(g, s_peer, s_dest, s_pos,
                                                     n, src, r.rv, r.rv);
  }
  // This rank's token t from x into its rows.
  __device__ __forceinline__ static void Place(const GroupView& g,
                                               const SendRows& r, int64_t t,
                                               const int32_t* s_row) {
    PlaceRow<false>(static_cast<const uint4*>(r.src.x) + t * r.rv, s_row,
                    g.num_topk, r.rv, static_cast<uint4*>(r.recv_x));
  }
  // A received entry's staging row into its rows.
  __device__ __forceinline__ static void PlaceReceived(const GroupView& g,
                                                       const SendRows& r,
                                                       int64_t entry,
                                                       const int32_t* s_row) {
    const uint4* rows =
        reinterpret_cast<const uint4*>(g.own + g.layout.dispatch_rows);
    PlaceRow<true>(rows + entry * r.rv, s_row, g.num_topk, r.rv,
                   static_cast<uint4*>(r.recv_x));
  }
};

// The same for fp8 rows (fp8_rows.h) from `kSource` (T: the activations'
// element type of kQuantize): a token is quantised once per role that reads
// it (its sender, or its placer on this rank), and travels as one packed wire
// row of rv vectors; the receiving side splits it into recv_x and
// recv_scales.
template <typename T, fp8::Source kSource>
struct Fp8Rows {
  // NOTES: 2 vectors in flight per thread when quantising (their fp32 lanes
  // and e4m3 words are live with them): the send kernel's launch bounds
  // leave 64 registers a thread, and more spilled.
  static constexpr int kVecs = kSource == fp8::Source::kQuantize ? 2 : 4;

  __device__ __forceinline__ static void Push(const GroupView& g,
                                              char* const* s_peer,
                                              const int32_t* s_dest,
                                              const int32_t* s_pos, int32_t n,
                                              const SendRows& r, int64_t t) {
    const int me = g.rank;
    const int64_t row_bytes = static_cast<int64_t>(r.rv) * 16;
    const int64_t hidden = g.hidden;
    const int64_t t_max = g.max_tokens;
    fp8::MoveRow<T, kSource, kCommThreads, kVecs, false>(
        r.src, t, static_cast<int32_t>(hidden), n,
        [&](int i, char** q, char** s) {
          const int d = s_dest[i];
          if (d == me) return false;
          *q = s_peer[d] + g.layout.dispatch_rows +
               (me * t_max + s_pos[i]) * row_bytes;
          *s = *q + hidden;
          return true;
        });
  }
  __device__ __forceinline__ static void Place(const GroupView& g,
                                               const SendRows& r, int64_t t,
                                               const int32_t* s_row) {
    PlaceSplit<T, kSource, kVecs, false>(g, r, r.src, t, s_row);
  }
  __device__ __forceinline__ static void PlaceReceived(const GroupView& g,
                                                       const SendRows& r,
                                                       int64_t entry,
                                                       const int32_t* s_row) {
    fp8::Rows packed = r.src;
    packed.source = fp8::Source::kPacked;
    packed.x = g.own + g.layout.dispatch_rows;
    packed.scales = nullptr;
    PlaceSplit<uint8_t, fp8::Source::kPacked, 4, true>(g, r, packed, entry,
                                                       s_row);
  }

 private:
  // Row t of `src` into the rows s_row[k] of recv_x and recv_scales.
  template <typename U, fp8::Source kFrom, int kFromVecs, bool kPeerSource>
  __device__ __forceinline__ static void PlaceSplit(const GroupView& g,
                                                    const SendRows& r,
                                                    const fp8::Rows& src,
                                                    int64_t t,
                                                    const int32_t* s_row) {
    const int64_t hidden = g.hidden;
    const int64_t scale_bytes = fp8::ScaleBytes(hidden, src.format);
    char* recv_x = static_cast<char*>(r.recv_x);
    char* recv_scales = static_cast<char*>(r.recv_scales);
    fp8::MoveRow<U, kFrom, kCommThreads, kFromVecs, kPeerSource>(
        src, t, static_cast<int32_t>(hidden), g.num_topk,
        [&](int k, char** q, char** s) {
          const int32_t row = s_row[k];
          if (row < 0) return false;
          *q = recv_x + static_cast<int64_t>(row) * hidden;
          *s = recv_scales + static_cast<int64_t>(row) * scale_bytes;
          return true;
        });
  }
};

}  // namespace jax_ep::peer

#endif  // JAX_EP_FFI_KERNELS_PEER_DISPATCH_ROWS_CUH_
