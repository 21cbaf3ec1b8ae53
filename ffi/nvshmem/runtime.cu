// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// NVSHMEM's life cycle for jax_ep (runtime.h). Compiled as relocatable device
// code and device-linked with libnvshmem_device.a; the host library
// (libnvshmem_host.so.3, from the same wheel) is loaded by jax_ep/backends/nvshmem.py
// before this module.

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "ffi/nvshmem/runtime.h"

namespace jax_ep::nvshmem {
namespace {

// Whether this module's Init initialised NVSHMEM (then Finalize may end it).
bool initialised_here = false;

void ThrowIfCuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) {
    throw std::runtime_error("jax_ep.nvshmem: " + what + ": " +
                             cudaGetErrorString(e));
  }
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint8_t Pattern(int pe, int64_t i) {
  return static_cast<uint8_t>((pe * 131 + i * 7 + 1) & 0xff);
}

__global__ void FillKernel(uint8_t* src, int64_t bytes) {
  const int me = nvshmem_my_pe();
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    src[i] = Pattern(me, i);
  }
}

// One block: the put with its signal to the next PE, then this PE's own
// arrival (bounded by timeout_ns), then every byte from the previous PE.
__global__ void RingKernel(uint8_t* dst, const uint8_t* src, int64_t bytes,
                           uint64_t* signal, int64_t timeout_ns, int* ok) {
  const int me = nvshmem_my_pe();
  const int n = nvshmem_n_pes();
  nvshmemx_putmem_signal_nbi_block(dst, src, bytes, signal, 1ull,
                                   NVSHMEM_SIGNAL_SET, (me + 1) % n);
  __shared__ int s_arrived;
  if (threadIdx.x == 0) {
    const uint64_t start = GlobalTimerNs();
    int arrived = 1;
    while (nvshmem_signal_fetch(signal) != 1ull) {
      if (GlobalTimerNs() - start > static_cast<uint64_t>(timeout_ns)) {
        arrived = 0;
        break;
      }
    }
    s_arrived = arrived;
  }
  __syncthreads();
  const int prev = (me + n - 1) % n;
  int bad = s_arrived ? 0 : 1;
  if (s_arrived) {
    for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) {
      bad |= dst[i] != Pattern(prev, i);
    }
  }
  if (__syncthreads_or(bad) == 0 && threadIdx.x == 0) *ok = 1;
  // The put must be complete before the buffers are freed.
  if (threadIdx.x == 0) nvshmem_quiet();
}

}  // namespace

std::string CompiledVersion() {
  return std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}

std::string LibraryVersion() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return std::to_string(major) + "." + std::to_string(minor) + "." +
         std::to_string(patch);
}

int InitStatus() { return nvshmemx_init_status(); }

std::string UniqueId() {
  nvshmemx_uniqueid_t id;
  std::memset(&id, 0, sizeof(id));
  const int status = nvshmemx_get_uniqueid(&id);
  if (status != 0) {
    throw std::runtime_error(
        "jax_ep.nvshmem: nvshmemx_get_uniqueid failed with status " +
        std::to_string(status));
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

InitResult Init(const std::string& unique_id, int rank, int num_ranks,
                int device) {
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("jax_ep.nvshmem: rank " + std::to_string(rank) +
                                " of " + std::to_string(num_ranks) +
                                ": expected 0 <= rank < num_ranks");
  }
  ThrowIfCuda(cudaSetDevice(device),
              "cudaSetDevice(" + std::to_string(device) + ")");
  InitResult r{};
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    // Another library (or an earlier group) initialised it: use it if its PEs
    // are this group's ranks.
    r.pe = nvshmem_my_pe();
    r.num_pes = nvshmem_n_pes();
    r.status = nvshmemx_init_status();
    r.joined = true;
    if (r.pe != rank || r.num_pes != num_ranks) {
      throw std::runtime_error(
          "jax_ep.nvshmem: NVSHMEM is already initialised in this process as "
          "PE " +
          std::to_string(r.pe) + " of " + std::to_string(r.num_pes) +
          ", but this group needs PE " + std::to_string(rank) + " of " +
          std::to_string(num_ranks));
    }
    return r;
  }
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    throw std::invalid_argument("jax_ep.nvshmem: unique_id must be " +
                                std::to_string(sizeof(nvshmemx_uniqueid_t)) +
                                " bytes, got " +
                                std::to_string(unique_id.size()));
  }
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr);
  if (status != 0) {
    throw std::runtime_error(
        "jax_ep.nvshmem: nvshmemx_set_attr_uniqueid_args failed with status " +
        std::to_string(status));
  }
  // NOTES: nvshmemi_init_thread directly: nvshmemx_init_attr (the header's
  // inline wrapper) calls exit() when initialisation fails, which would end
  // the Python process without an error message.
  nvshmemx_init_init_attr_ver_only(attr);
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION,
                                      NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  if (status != 0) {
    throw std::runtime_error(
        "jax_ep.nvshmem: NVSHMEM initialisation (unique id, PE " +
        std::to_string(rank) + " of " + std::to_string(num_ranks) +
        ") failed with status " + std::to_string(status) +
        "; NVSHMEM_DEBUG=INFO shows why");
  }
  initialised_here = true;
  r.pe = nvshmem_my_pe();
  r.num_pes = nvshmem_n_pes();
  r.status = nvshmemx_init_status();
  r.joined = false;
  return r;
}

bool RingProbe(int64_t bytes, double timeout_s) {
  if (bytes < 1) {
    throw std::invalid_argument("jax_ep.nvshmem: bytes must be >= 1, got " +
                                std::to_string(bytes));
  }
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) {
    throw std::runtime_error("jax_ep.nvshmem: NVSHMEM is not initialised");
  }
  auto* src = static_cast<uint8_t*>(nvshmem_malloc(bytes));
  auto* dst = static_cast<uint8_t*>(nvshmem_calloc(bytes, 1));
  auto* signal = static_cast<uint64_t*>(nvshmem_calloc(1, sizeof(uint64_t)));
  if (src == nullptr || dst == nullptr || signal == nullptr) {
    throw std::runtime_error(
        "jax_ep.nvshmem: nvshmem_malloc of the probe buffers failed "
        "(NVSHMEM_SYMMETRIC_SIZE)");
  }
  int* ok = nullptr;
  ThrowIfCuda(cudaMalloc(&ok, sizeof(int)), "cudaMalloc");
  ThrowIfCuda(cudaMemset(ok, 0, sizeof(int)), "cudaMemset");
  FillKernel<<<64, 256>>>(src, bytes);
  ThrowIfCuda(cudaDeviceSynchronize(), "the probe's fill kernel");
  nvshmem_barrier_all();  // every PE's dst and signal are zero, src filled
  RingKernel<<<1, 256>>>(dst, src, bytes, signal,
                         static_cast<int64_t>(timeout_s * 1e9), ok);
  ThrowIfCuda(cudaDeviceSynchronize(), "the probe's ring kernel");
  int host_ok = 0;
  ThrowIfCuda(cudaMemcpy(&host_ok, ok, sizeof(int), cudaMemcpyDeviceToHost),
              "cudaMemcpy");
  cudaFree(ok);
  nvshmem_barrier_all();  // no PE frees what a peer still writes
  nvshmem_free(signal);
  nvshmem_free(dst);
  nvshmem_free(src);
  return host_ok == 1;
}

uint64_t SymmetricAlloc(int64_t bytes) {
  if (bytes < 1) {
    throw std::invalid_argument("jax_ep.nvshmem: bytes must be >= 1, got " +
                                std::to_string(bytes));
  }
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) {
    throw std::runtime_error("jax_ep.nvshmem: NVSHMEM is not initialised");
  }
  void* p = nvshmem_malloc(static_cast<size_t>(bytes));
  if (p == nullptr) {
    throw std::runtime_error(
        "jax_ep.nvshmem: nvshmem_malloc of " + std::to_string(bytes) +
        " bytes failed: the symmetric heap is too small (set "
        "NVSHMEM_SYMMETRIC_SIZE before the first group on the network "
        "transport is created)");
  }
  ThrowIfCuda(cudaMemset(p, 0, static_cast<size_t>(bytes)),
              "cudaMemset of a symmetric buffer");
  ThrowIfCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return reinterpret_cast<uint64_t>(p);
}

void SymmetricFree(uint64_t address) {
  if (address != 0) nvshmem_free(reinterpret_cast<void*>(address));
}

uint64_t PeerAddress(uint64_t address, int pe) {
  if (pe < 0 || pe >= nvshmem_n_pes()) {
    throw std::invalid_argument("jax_ep.nvshmem: pe " + std::to_string(pe) +
                                " out of [0, " +
                                std::to_string(nvshmem_n_pes()) + ")");
  }
  return reinterpret_cast<uint64_t>(
      nvshmem_ptr(reinterpret_cast<void*>(address), pe));
}

void Finalize() {
  if (initialised_here &&
      nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    nvshmem_finalize();
    initialised_here = false;
  }
}

}  // namespace jax_ep::nvshmem
