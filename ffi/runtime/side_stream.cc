// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep's own stream per GPU (runtime/side_stream.h).

#include "ffi/runtime/side_stream.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "ffi/kernels/peer_kernels.h"

namespace jax_ep::runtime {
namespace {

struct OwnStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;  // recorded on XLA's stream, waited by ours
  // Recorded on ours after each op of a key, the key's slot
  // `key % kOwnStreamKeys`; made in the stream's context (a green context's
  // where it has one).
  std::array<cudaEvent_t, kOwnStreamKeys> finished{};
  int partition_sms = 0;  // the green context's SMs; 0: none
  std::string why_not;    // why there is none, where one was asked for
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

// A plain stream of the device's greatest priority (the current device's),
// its events in the primary context.
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

// The driver's green-context entry points (CUDA >= 12.5), through the runtime:
// the extension links no libcuda.
struct GreenApi {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetDevResource_v12040 get_resource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 split = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 describe = nullptr;
  PFN_cuGreenCtxCreate_v12040 create = nullptr;
  PFN_cuGreenCtxDestroy_v12040 destroy = nullptr;
  PFN_cuCtxFromGreenCtx_v12040 as_context = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 stream_create = nullptr;
  PFN_cuCtxPushCurrent_v4000 push = nullptr;
  PFN_cuCtxPopCurrent_v4000 pop = nullptr;
  PFN_cuEventCreate_v2000 event_create = nullptr;
};

// The entry points, or a message naming the first one the driver lacks.
std::string LoadGreenApi(GreenApi* api) {
  std::string missing;
  auto load = [&missing](const char* name, unsigned version, auto* fn) {
    if (!missing.empty()) return;
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess || p == nullptr) {
      missing = std::string("the driver has no ") + name + " (CUDA " +
                std::to_string(version / 1000) + "." +
                std::to_string(version % 1000 / 10) + ")";
      return;
    }
    *fn = reinterpret_cast<std::remove_reference_t<decltype(*fn)>>(p);
  };
  load("cuDeviceGet", 2000, &api->device_get);
  load("cuDeviceGetDevResource", 12040, &api->get_resource);
  load("cuDevSmResourceSplitByCount", 12040, &api->split);
  load("cuDevResourceGenerateDesc", 12040, &api->describe);
  load("cuGreenCtxCreate", 12040, &api->create);
  load("cuGreenCtxDestroy", 12040, &api->destroy);
  load("cuCtxFromGreenCtx", 12040, &api->as_context);
  load("cuGreenCtxStreamCreate", 12050, &api->stream_create);
  load("cuCtxPushCurrent", 4000, &api->push);
  load("cuCtxPopCurrent", 4000, &api->pop);
  load("cuEventCreate", 2000, &api->event_create);
  return missing;
}

std::string DriverFailure(const char* call, CUresult r) {
  return std::string(call) + " failed (CUresult " + std::to_string(r) + ")";
}

// With `green`'s context current: the finished events (a record must be of
// its stream's context; a wait may be of any), and every kernel's module
// load, so that none happens inside a handler's first launch there.
std::string InGreenContext(const GreenApi& api, CUgreenCtx green,
                           OwnStream* made) {
  CUcontext context = nullptr;
  CUresult r = api.as_context(&context, green);
  if (r != CUDA_SUCCESS) return DriverFailure("cuCtxFromGreenCtx", r);
  if ((r = api.push(context)) != CUDA_SUCCESS) {
    return DriverFailure("cuCtxPushCurrent", r);
  }
  std::string why;
  for (cudaEvent_t& event : made->finished) {
    CUevent e = nullptr;
    if ((r = api.event_create(&e, CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS) {
      why = DriverFailure("cuEventCreate", r);
      break;
    }
    event = e;
  }
  if (why.empty() && peer::PreloadKernels() != cudaSuccess) {
    why = "loading the kernels in the green context failed";
  }
  CUcontext popped = nullptr;
  api.pop(&popped);
  return why;
}

// `s` on a green context of at least `sms` SMs of `device` (the driver rounds
// up to its granularity: 8 on Hopper), or the reason there is none (`s` then
// untouched). The fork event stays the primary context's: it is recorded on
// XLA's stream.
std::string CreatePartitioned(int device, int sms, OwnStream* s) {
  GreenApi api;
  std::string why = LoadGreenApi(&api);
  if (!why.empty()) return why;
  CUdevice dev = 0;
  CUresult r = api.device_get(&dev, device);
  if (r != CUDA_SUCCESS) return DriverFailure("cuDeviceGet", r);
  CUdevResource all{};
  r = api.get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM);
  if (r != CUDA_SUCCESS) return DriverFailure("cuDeviceGetDevResource", r);
  if (static_cast<unsigned>(sms) >= all.sm.smCount) {
    return "the budget, " + std::to_string(sms) + " SMs, is the whole GPU's " +
           std::to_string(all.sm.smCount);
  }
  unsigned groups = 1;
  CUdevResource part{};
  r = api.split(&part, &groups, &all, nullptr, 0, static_cast<unsigned>(sms));
  if (r != CUDA_SUCCESS || groups != 1) {
    return DriverFailure("cuDevSmResourceSplitByCount", r);
  }
  CUdevResourceDesc desc = nullptr;
  r = api.describe(&desc, &part, 1);
  if (r != CUDA_SUCCESS) return DriverFailure("cuDevResourceGenerateDesc", r);
  CUgreenCtx green = nullptr;
  r = api.create(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
  if (r != CUDA_SUCCESS) return DriverFailure("cuGreenCtxCreate", r);

  OwnStream made;
  int least = 0, greatest = 0;
  CUstream stream = nullptr;
  if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess) {
    why = "cudaDeviceGetStreamPriorityRange failed";
  } else if ((r = api.stream_create(&stream, green, CU_STREAM_NON_BLOCKING,
                                    greatest)) != CUDA_SUCCESS) {
    why = DriverFailure("cuGreenCtxStreamCreate", r);
  } else {
    why = InGreenContext(api, green, &made);
  }
  if (why.empty() &&
      cudaEventCreateWithFlags(&made.fork, cudaEventDisableTiming) !=
          cudaSuccess) {
    why = "cudaEventCreateWithFlags failed";
  }
  if (!why.empty()) {  // give back what was made
    for (cudaEvent_t event : made.finished) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (made.fork != nullptr) cudaEventDestroy(made.fork);
    if (stream != nullptr) cudaStreamDestroy(stream);
    api.destroy(green);
    return why;
  }
  made.stream = stream;
  made.partition_sms = static_cast<int>(part.sm.smCount);
  *s = made;
  return "";
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

cudaError_t PrepareOwnStream(int device, int sms) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (Streams().count(device) > 0) return cudaSuccess;
  OwnStream s;
  std::string why_not;
  const cudaError_t err = OnDevice(device, [&] {
    if (sms > 0) why_not = CreatePartitioned(device, sms, &s);
    return s.stream != nullptr ? cudaSuccess : Create(&s);
  });
  s.why_not = why_not;
  if (err == cudaSuccess) Streams().emplace(device, s);
  return err;
}

int OwnStreamPartition(int device, std::string* why_not) {
  std::lock_guard<std::mutex> lock(Mutex());
  auto it = Streams().find(device);
  if (it == Streams().end()) {
    if (why_not != nullptr) *why_not = "no own stream on this device";
    return 0;
  }
  if (why_not != nullptr) *why_not = it->second.why_not;
  return it->second.partition_sms;
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
