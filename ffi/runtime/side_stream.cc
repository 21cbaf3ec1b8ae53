// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep's own stream per GPU (runtime/side_stream.h).

#include "ffi/runtime/side_stream.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace jax_ep::runtime {
namespace {

struct OwnStream {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;  // recorded on XLA's stream, waited by ours
  // Per key, recorded on ours after each op of that key.
  std::unordered_map<int64_t, cudaEvent_t> finished;
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

cudaError_t Create(int device, OwnStream* s) {
  return OnDevice(device, [s] {
    int least = 0, greatest = 0;
    cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (err != cudaSuccess) return err;
    err = cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking,
                                       greatest);
    if (err != cudaSuccess) return err;
    err = cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      cudaStreamDestroy(s->stream);
      s->stream = nullptr;
    }
    return err;
  });
}

// The own stream of `xla_stream`'s device, created on first use. Called with
// the mutex held.
cudaError_t Get(cudaStream_t xla_stream, OwnStream** out) {
  int device = 0;
  cudaError_t err = cudaStreamGetDevice(xla_stream, &device);
  if (err != cudaSuccess) return err;
  auto& streams = Streams();
  auto it = streams.find(device);
  if (it == streams.end()) {
    OwnStream s;
    s.device = device;
    if ((err = Create(device, &s)) != cudaSuccess) return err;
    it = streams.emplace(device, s).first;
  }
  *out = &it->second;
  return cudaSuccess;
}

}  // namespace

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
    auto it = s.finished.find(key);
    if (it == s.finished.end()) {
      cudaEvent_t event = nullptr;
      const cudaError_t err = OnDevice(s.device, [&event] {
        return cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
      });
      if (err != cudaSuccess) return err;
      it = s.finished.emplace(key, event).first;
    }
    // A join waits on the latest record at its call: one event per key.
    return cudaEventRecord(it->second, own);
  }
  return cudaErrorInvalidResourceHandle;
}

cudaError_t JoinOwnStream(cudaStream_t xla_stream, int64_t key) {
  std::lock_guard<std::mutex> lock(Mutex());
  OwnStream* s = nullptr;
  cudaError_t err = Get(xla_stream, &s);
  if (err != cudaSuccess) return err;
  const auto it = s->finished.find(key);
  // No op of this key ever finished on this device: nothing to wait for.
  if (it == s->finished.end()) return cudaSuccess;
  return cudaStreamWaitEvent(xla_stream, it->second, 0);
}

cudaError_t JoinAllOwnStream(cudaStream_t xla_stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  OwnStream* s = nullptr;
  cudaError_t err = Get(xla_stream, &s);
  if (err != cudaSuccess) return err;
  for (const auto& [key, event] : s->finished) {
    if ((err = cudaStreamWaitEvent(xla_stream, event, 0)) != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

}  // namespace jax_ep::runtime
