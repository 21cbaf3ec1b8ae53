// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// What the files of the native groups share (runtime/group.cc: create,
// IPC handle, destroy; runtime/connect.cc: the pointer tables;
// runtime/registry.cc: the registry and the lookups): CUDA failures as
// exceptions, the device guard, and the registry's entry points. Internal to
// those files; the management API is runtime/group.h.

#ifndef JAX_EP_FFI_RUNTIME_GROUP_INTERNAL_H_
#define JAX_EP_FFI_RUNTIME_GROUP_INTERNAL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "ffi/runtime/group.h"

namespace jax_ep::runtime::detail {

inline std::string CudaMessage(const std::string& what, cudaError_t err) {
  return what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
         ")";
}

inline void ThrowIfCuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error(CudaMessage(what, err));
}

// Makes `device` current for the scope, restoring the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    ThrowIfCuda(cudaSetDevice(device),
                "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The registry (runtime/registry.cc): every group of this process by id.
// Its lock also publishes a group's `connected` (Lookup reads it under it).
std::mutex& RegistryMutex();

// Gives `group` the next process-unique id and registers it; returns the id.
int64_t Register(std::shared_ptr<Group> group);

// Removes and returns group `group_id`; null if there is none.
std::shared_ptr<Group> Unregister(int64_t group_id);

// Group `group_id`; throws std::invalid_argument naming `fn` if unknown.
std::shared_ptr<Group> FindOrThrow(int64_t group_id, const char* fn);

}  // namespace jax_ep::runtime::detail

#endif  // JAX_EP_FFI_RUNTIME_GROUP_INTERNAL_H_
