// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Host-side launch helpers of the low-latency pair, shared by its translation
// units (low_latency_*.cu); not part of the launcher API
// (low_latency_kernels.h). The kernels stay private to the file that launches
// them.

#ifndef JAX_EP_FFI_KERNELS_LOW_LATENCY_LAUNCH_H_
#define JAX_EP_FFI_KERNELS_LOW_LATENCY_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstddef>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/group_view.h"

namespace jax_ep::low_latency::launch {

// Whether the view (a group with the low-latency buffers) and the dtype fit
// the kernels' limits (32-bit indices); every launcher checks it first.
bool ValidView(const group::GroupView& g, ElementType dtype);

// Raises the most local memory per thread seen by the current PreloadKernels
// (MaxLocalBytes) to `bytes`.
void NoteLocalBytes(size_t bytes);

// Forces the module load of `kernel` and notes its local memory.
template <typename Kernel>
cudaError_t Load(Kernel kernel) {
  cudaFuncAttributes attr;
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  NoteLocalBytes(attr.localSizeBytes);
  return cudaSuccess;
}

// Loads the kernels of each translation unit (see PreloadKernels).
cudaError_t PreloadDispatchKernels();
cudaError_t PreloadCombineKernels();
cudaError_t PreloadLocalKernels();

}  // namespace jax_ep::low_latency::launch

#endif  // JAX_EP_FFI_KERNELS_LOW_LATENCY_LAUNCH_H_
