// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep's own stream per GPU (runtime/side_stream.h).

#include "ffi/runtime/side_stream.h"

#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>

namespace jax_ep::runtime {
namespace {

struct OwnStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;      // recorded on XLA's stream, waited by ours
  cudaEvent_t finished = nullptr;  // recorded on ours after each op
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

cudaError_t Create(int device, OwnStream* s) {
  int prev = 0;
  cudaError_t err = cudaGetDevice(&prev);
  if (err != cudaSuccess) return err;
  if (prev != device && (err = cudaSetDevice(device)) != cudaSuccess) {
    return err;
  }
  int least = 0, greatest = 0;
  err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (err == cudaSuccess) {
    err = cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking,
                                       greatest);
  }
  if (err == cudaSuccess) {
    err = cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming);
  }
  if (err == cudaSuccess) {
    err = cudaEventCreateWithFlags(&s->finished, cudaEventDisableTiming);
  }
  if (prev != device) {
    const cudaError_t restore = cudaSetDevice(prev);
    if (err == cudaSuccess) err = restore;
  }
  return err;
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

cudaError_t FinishOnOwnStream(cudaStream_t own) {
  std::lock_guard<std::mutex> lock(Mutex());
  for (auto& [device, s] : Streams()) {
    if (s.stream == own) return cudaEventRecord(s.finished, own);
  }
  return cudaErrorInvalidResourceHandle;
}

cudaError_t JoinOwnStream(cudaStream_t xla_stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  OwnStream* s = nullptr;
  cudaError_t err = Get(xla_stream, &s);
  if (err != cudaSuccess) return err;
  return cudaStreamWaitEvent(xla_stream, s->finished, 0);
}

}  // namespace jax_ep::runtime
