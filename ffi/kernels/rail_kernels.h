// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::rail: the rail exchange of a network group (kernels:
// ffi/kernels/rail_exchange.cu): every rank sends one block of rows to the
// rank with its own local index on each host (its rail peer there, `pes[h]`;
// this rank's own entry is itself), and receives one from each. A row is a
// record of up to kMaxRailFields fields, each field f taken from row
// index[h, j] of its source and written to row h * T_max + j of its
// destination. The network transport puts the blocks between the pack and
// the wait (network::Send, op kRailSend).

#ifndef JAX_EP_FFI_KERNELS_RAIL_KERNELS_H_
#define JAX_EP_FFI_KERNELS_RAIL_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/group_buffer_layout.h"
#include "ffi/kernels/group_view.h"

namespace jax_ep::rail {

// NOTES: four: a token's row, its K ids and K weights, and (fp8 rows) its
// scales beside its e4m3 bytes. A record of them still fits the group's
// rail_record_bytes (sized for the activations' row): H + H / 32 bytes
// rounded to 16 is at most 2 H for every H >= 128.
inline constexpr int kMaxRailFields = 4;

struct Fields {
  int32_t num = 0;
  const void* src[kMaxRailFields] = {};  // [rows[f], bytes[f]]
  int64_t rows[kMaxRailFields] = {};     // rows of src (bounds every index)
  void* dst[kMaxRailFields] = {};        // [Hn * T_max, bytes[f]]
  int64_t bytes[kMaxRailFields] = {};    // per row, multiples of 4
};

// Bytes of a record of these fields (16-byte aligned offsets); the group's
// rail_record_bytes bounds it.
__host__ __device__ inline int64_t RecordBytes(const Fields& f) {
  int64_t total = 0;
  for (int i = 0; i < f.num; ++i) total += group::AlignRecord(f.bytes[i]);
  return total;
}

// Rows j < counts[h] of block h (index `[Hn, T_max]` int32, -1 rows are
// zero) into the outbox, the own host's block straight into the own inbox.
cudaError_t Pack(const group::GroupView& g, const Fields& f,
                 const int32_t* index, const int32_t* counts,
                 const int32_t* pes, cudaStream_t stream);

// Waits for every other host's flag of this call: recv_counts `[Hn]` (the own
// host's is counts[own]); then every destination row h * T_max + j is the
// received record's field (zeros for j >= recv_counts[h]); advances the
// call's sequence; status `[]` = 1 when the group failed, else 0.
cudaError_t WaitAndUnpack(const group::GroupView& g, const Fields& f,
                          const int32_t* counts, const int32_t* pes,
                          int32_t* recv_counts, int32_t* status,
                          cudaStream_t stream);

cudaError_t PreloadKernels();

}  // namespace jax_ep::rail

#endif  // JAX_EP_FFI_KERNELS_RAIL_KERNELS_H_
