// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The host side the low-latency launchers share (low_latency_launch.h): the
// check of the group view every launcher makes first, and the preload of
// every kernel of the pair with the local memory it found.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/group_view.h"
#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/low_latency_kernels.h"
#include "ffi/kernels/low_latency_launch.h"

namespace jax_ep::low_latency {
namespace {

// The most local memory (bytes per thread) any low-latency kernel needs, as
// the last PreloadKernels found it (must stay 0: see SpinArrival's NOTES in
// low_latency_common.cuh).
size_t max_local_bytes = 0;

}  // namespace

namespace launch {

bool ValidView(const group::GroupView& g, ElementType dtype) {
  return g.low_latency != 0 && g.peers != nullptr && g.own != nullptr &&
         g.state != nullptr && g.num_ranks >= 1 &&
         g.num_ranks <= group::kMaxRanks && g.rank >= 0 &&
         g.rank < g.num_ranks && g.num_local >= 1 &&
         g.num_local <= kMaxExperts && g.num_topk >= 1 &&
         g.num_topk <= kMaxTopk && g.hidden % kHiddenMultiple == 0 &&
         g.itemsize == detail::ElementBytes(dtype) &&
         g.layout.ll_row_bytes == g.hidden * g.itemsize &&
         g.num_ranks * g.max_tokens * g.num_topk <= INT32_MAX;
}

void NoteLocalBytes(size_t bytes) {
  if (bytes > max_local_bytes) max_local_bytes = bytes;
}

}  // namespace launch

cudaError_t PreloadKernels() {
  max_local_bytes = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadDispatchKernels());
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::PreloadCombineKernels());
  return launch::PreloadLocalKernels();
}

size_t MaxLocalBytes() { return max_local_bytes; }

}  // namespace jax_ep::low_latency
