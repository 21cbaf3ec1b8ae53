// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// See runtime/topology.h.

#include "ffi/runtime/topology.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

namespace jax_ep::runtime {
namespace {

// NVML's name of the GPU with this cudaDeviceProp::uuid: "GPU-" and the 16
// bytes as 8-4-4-4-12 lowercase hex digits.
std::string NvmlUuid(const std::string& uuid) {
  static const char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    const auto byte = static_cast<unsigned char>(uuid[i]);
    out += kHex[byte >> 4];
    out += kHex[byte & 15];
  }
  return out;
}

// Whether every ordered pair of these distinct GPUs (cudaDeviceProp::uuid)
// has native P2P atomics, asked of NVML. NOTES: NVML sees every GPU of the
// host whatever CUDA_VISIBLE_DEVICES hides from this process, so a process
// narrowed to one GPU that way can still check its peers (CUDA can only ask
// about the GPUs it sees). Where a container or cgroup hides the peers'
// device nodes, NVML cannot see them either, and the answer is no. The
// driver's libnvidia-ml.so.1 is loaded at run time, so nothing links against
// it; any failure counts as no. (nvmlInit may take a while without
// persistence mode; it runs once per connect, and only in this case.)
bool NvmlP2PAtomics(const std::vector<std::string>& uuids) {
  // The few declarations needed, from NVML's stable C API (nvml.h is not
  // part of the CUDA toolkit's headers).
  using NvmlDevice = void*;
  constexpr int kNvmlSuccess = 0;
  constexpr int kP2PCapsIndexAtomics = 3;  // NVML_P2P_CAPS_INDEX_ATOMICS
  constexpr int kP2PStatusOk = 0;          // NVML_P2P_STATUS_OK
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return false;
  using InitFn = int (*)();
  using HandleFn = int (*)(const char*, NvmlDevice*);
  using P2PFn = int (*)(NvmlDevice, NvmlDevice, int, int*);
  const auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
  const auto shutdown = reinterpret_cast<InitFn>(dlsym(lib, "nvmlShutdown"));
  const auto by_uuid =
      reinterpret_cast<HandleFn>(dlsym(lib, "nvmlDeviceGetHandleByUUID"));
  const auto p2p =
      reinterpret_cast<P2PFn>(dlsym(lib, "nvmlDeviceGetP2PStatus"));
  bool ok = init != nullptr && shutdown != nullptr && by_uuid != nullptr &&
            p2p != nullptr && init() == kNvmlSuccess;
  if (ok) {
    std::vector<NvmlDevice> devices(uuids.size(), nullptr);
    for (size_t i = 0; ok && i < uuids.size(); ++i) {
      ok = by_uuid(NvmlUuid(uuids[i]).c_str(), &devices[i]) == kNvmlSuccess;
    }
    for (size_t a = 0; ok && a < devices.size(); ++a) {
      for (size_t b = 0; ok && b < devices.size(); ++b) {
        if (a == b) continue;
        int status = -1;
        ok = p2p(devices[a], devices[b], kP2PCapsIndexAtomics, &status) ==
                 kNvmlSuccess &&
             status == kP2PStatusOk;
      }
    }
    shutdown();  // NVML counts its inits; this one is ours
  }
  dlclose(lib);
  return ok;
}

// The ordinal of the visible device with this UUID, or -1.
int DeviceWithUuid(const std::string& uuid) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  for (int d = 0; d < count; ++d) {
    unsigned char other[16];
    if (DeviceUuid(d, other) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    if (uuid.compare(0, 16, reinterpret_cast<const char*>(other), 16) == 0) {
      return d;
    }
  }
  return -1;
}

}  // namespace

cudaError_t DeviceUuid(int device, unsigned char* uuid) {
  cudaDeviceProp prop;
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err == cudaSuccess) std::memcpy(uuid, &prop.uuid, 16);
  return err;
}

// Whether a dispatch may receive while it sends (GroupView::
// receive_while_sending): the ranks' GPUs, given by their ordinals, are all
// distinct, and every ordered pair has native P2P atomics (the senders add
// chunk counts into the receivers' memory). Query failures count as no.
bool NativeP2PAtomics(const std::vector<int>& devices) {
  if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
    return false;
  }
  for (int a : devices) {
    for (int b : devices) {
      if (a == b) continue;
      int native = 0;
      if (cudaDeviceGetP2PAttribute(&native,
                                    cudaDevP2PAttrNativeAtomicSupported, a,
                                    b) != cudaSuccess) {
        cudaGetLastError();  // clear it
        return false;
      }
      if (native == 0) return false;
    }
  }
  return true;
}

bool NativeP2PAtomicsByUuid(const std::vector<std::string>& uuids) {
  // NOTES: every rank reads every rank's GPU; ranks that see different
  // sets of devices may decide differently, which is safe (senders always
  // add the counts, only a rank's own receivers read them). Where this
  // process cannot see every GPU of the group (one GPU per process through
  // CUDA_VISIBLE_DEVICES), NVML answers for the atomics instead of CUDA.
  std::vector<int> devices;
  bool all_visible = true;
  for (const std::string& uuid : uuids) {
    const int d = DeviceWithUuid(uuid);
    all_visible = all_visible && d >= 0;
    devices.push_back(d);
  }
  const bool distinct =
      std::set<std::string>(uuids.begin(), uuids.end()).size() == uuids.size();
  return distinct &&
         (all_visible ? NativeP2PAtomics(devices) : NvmlP2PAtomics(uuids));
}

}  // namespace jax_ep::runtime
