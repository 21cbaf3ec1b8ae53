// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep's own stream per GPU (runtime/side_stream.h).

#include "ffi/runtime/side_stream.h"

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace jax_ep::runtime {
namespace {

struct OwnStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;  // recorded on XLA's stream, waited by ours
  // Recorded on ours after each op of a key, the key's slot `key % kOwnStreamKeys`.
  std::array<cudaEvent_t, kOwnStreamKeys> finished{};
};

std::mutex& Mutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// Never freed: the streams live as long as the process's contexts.
std::unordered_map<int, OwnStream>& Streams() {
  static auto* streams = new std::unordered_map<int, OwnStream>;
  return *streams;
}

// Runs `fn` with `device` current, then restores the caller's device.
template <typename Fn>
cudaError_t OnDevice(int device, Fn fn) {
  int prev = 0;
  cudaError_t err = cudaGetDevice(&prev);
  if (err != cudaSuccess) return err;
  if (prev != device && (err = cudaSetDevice(device)) != cudaSuccess) {
    return err;
  }
  err = fn();
  if (prev != device) {
    const cudaError_t restore = cudaSetDevice(prev);
    if (err == cudaSuccess) err = restore;
  }
  return err;
}

cudaError_t Create(OwnStream* s) {
  int least = 0, greatest = 0;
  cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (err == cudaSuccess) {
    err = cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking,
                                       greatest);
  }
  if (err == cudaSuccess) {
    err = cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming);
  }
  for (cudaEvent_t& event : s->finished) {
    if (err == cudaSuccess) {
      err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    }
  }
  if (err != cudaSuccess) {  // give back what was made
    for (cudaEvent_t event : s->finished) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (s->fork != nullptr) cudaEventDestroy(s->fork);
    if (s->stream != nullptr) cudaStreamDestroy(s->stream);
    *s = OwnStream{};
  }
  return err;
}

// The own stream of `xla_stream`'s device, prepared before (cudaErrorNotReady
// where it was not). Called with the mutex held.
cudaError_t Get(cudaStream_t xla_stream, OwnStream** out) {
  int device = 0;
  const cudaError_t err = cudaStreamGetDevice(xla_stream, &device);
  if (err != cudaSuccess) return err;
  auto it = Streams().find(device);
  if (it == Streams().end()) return cudaErrorNotReady;
  *out = &it->second;
  return cudaSuccess;
}

}  // namespace

cudaError_t PrepareOwnStream(int device) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (Streams().count(device) > 0) return cudaSuccess;
  OwnStream s;
  const cudaError_t err = OnDevice(device, [&s] { return Create(&s); });
  if (err == cudaSuccess) Streams().emplace(device, s);
  return err;
}

cudaError_t ForkOwnStream(cudaStream_t xla_stream, cudaStream_t* own) {
  std::lock_guard<std::mutex> lock(Mutex());
  OwnStream* s = nullptr;
  cudaError_t err = Get(xla_stream, &s);
  if (err != cudaSuccess) return err;
  // The wait takes the event's state at this call, so one event serves every
  // fork.
  if ((err = cudaEventRecord(s->fork, xla_stream)) != cudaSuccess) return err;
  if ((err = cudaStreamWaitEvent(s->stream, s->fork, 0)) != cudaSuccess) {
    return err;
  }
  *own = s->stream;
  return cudaSuccess;
}

cudaError_t FinishOnOwnStream(cudaStream_t own, int64_t key) {
  std::lock_guard<std::mutex> lock(Mutex());
  for (auto& [device, s] : Streams()) {
    if (s.stream != own) continue;
    // A join waits on the latest record at its call: one event per slot.
    return cudaEventRecord(s.finished[key % kOwnStreamKeys], own);
  }
  return cudaErrorInvalidResourceHandle;
}

cudaError_t JoinOwnStream(cudaStream_t xla_stream, int64_t key) {
  std::lock_guard<std::mutex> lock(Mutex());
  OwnStream* s = nullptr;
  const cudaError_t err = Get(xla_stream, &s);
  if (err != cudaSuccess) return err;
  // An event never recorded (no op of the slot yet) is waited for at once.
  return cudaStreamWaitEvent(xla_stream, s->finished[key % kOwnStreamKeys], 0);
}

cudaError_t JoinAllOwnStream(cudaStream_t xla_stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  OwnStream* s = nullptr;
  cudaError_t err = Get(xla_stream, &s);
  if (err != cudaSuccess) return err;
  for (cudaEvent_t event : s->finished) {
    if ((err = cudaStreamWaitEvent(xla_stream, event, 0)) != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

}  // namespace jax_ep::runtime
