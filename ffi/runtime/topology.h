// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// What the native groups ask of the host's GPUs: a GPU's UUID, and whether
// every pair of the group's GPUs has native P2P atomics, which a dispatch
// needs to place rows while they land (GroupView::receive_while_sending).
// Host C++, the CUDA runtime and, loaded at run time, NVML; never throws.

#ifndef JAX_EP_FFI_RUNTIME_TOPOLOGY_H_
#define JAX_EP_FFI_RUNTIME_TOPOLOGY_H_

#include <cuda_runtime.h>

#include <string>
#include <vector>

namespace jax_ep::runtime {

// cudaDeviceProp::uuid of `device` (16 bytes into `uuid`).
cudaError_t DeviceUuid(int device, unsigned char* uuid);

// Whether the GPUs given by their ordinals are all distinct and every ordered
// pair has native P2P atomics (CUDA's answer). Query failures count as no.
bool NativeP2PAtomics(const std::vector<int>& devices);

// The same for GPUs given by their UUIDs (16 bytes each), of which this
// process may see only some: CUDA answers where it sees them all, NVML where
// CUDA_VISIBLE_DEVICES hides some.
bool NativeP2PAtomicsByUuid(const std::vector<std::string>& uuids);

}  // namespace jax_ep::runtime

#endif  // JAX_EP_FFI_RUNTIME_TOPOLOGY_H_
