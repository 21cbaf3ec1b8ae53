// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::nvshmem: NVSHMEM's life cycle in a jax_ep process (the network
// transport's base; docs/multihost.md). Host code only in this header; the
// implementation is relocatable device code linked with NVSHMEM's device
// library, in the separate module `jax_ep._jax_ep_nvshmem`, so that the main
// extension loads where NVSHMEM is not installed.

#ifndef JAX_EP_FFI_NVSHMEM_RUNTIME_H_
#define JAX_EP_FFI_NVSHMEM_RUNTIME_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi/kernels/network.h"

namespace jax_ep::nvshmem {

// The NVSHMEM version the module was compiled against ("3.4.5").
std::string CompiledVersion();

// The version of the host library loaded in this process (libnvshmem_host).
std::string LibraryVersion();

// nvshmemx_init_status() of this process (NVSHMEM_STATUS_*).
int InitStatus();

// A fresh unique id (nvshmemx_get_uniqueid), as bytes: the one process that
// creates it hands it to the others through another channel.
std::string UniqueId();

struct InitResult {
  int pe;
  int num_pes;
  int status;   // nvshmemx_init_status() after the call
  bool joined;  // NVSHMEM was already initialised in this process
};

// Joins PE `rank` of `num_ranks` with the unique id on `device`. If NVSHMEM is
// already initialised in this process (by jax_ep or another library), checks
// that its PE numbering is this one and uses it; throws std::runtime_error
// (with NVSHMEM's status) on failure, never exits the process.
InitResult Init(const std::string& unique_id, int rank, int num_ranks,
                int device);

// Collective over all PEs: PE p puts `bytes` of a pattern to PE p + 1 with a
// signal (put-with-signal, one block), then waits up to `timeout_s` for its
// own from PE p - 1 and checks every byte. True when it arrived intact.
bool RingProbe(int64_t bytes, double timeout_s);

// Finalises NVSHMEM if this module initialised it (collective).
void Finalize();

// --- The symmetric heap (collective over all PEs, in the same order). -------

// nvshmem_malloc of `bytes`, zeroed; its device address. Throws when the heap
// cannot hold it (NVSHMEM_SYMMETRIC_SIZE).
uint64_t SymmetricAlloc(int64_t bytes);

// nvshmem_free of an address SymmetricAlloc returned.
void SymmetricFree(uint64_t address);

// nvshmem_ptr: PE `pe`'s copy of the symmetric `address` as this process can
// load and store it, or 0 where only puts reach it (another host).
uint64_t PeerAddress(uint64_t address, int pe);

// --- The puts (low_latency_puts.cu, rail_puts.cu). ------------------------

// The address of the network::SendFn a network group calls after each kernel
// that staged rows for other hosts (runtime::ConnectTable).
uint64_t SendAddress();

// The rail exchange's puts (rail_puts.cu): network::Send with op kRailSend.
cudaError_t LaunchRailPuts(const network::Send& send, cudaStream_t stream);

// Launches the rail put kernel once on the current device (returning at
// once), and its local memory per thread (WarmPutKernels,
// PutKernelsLocalBytes).
void WarmRailPutKernel();
size_t RailPutKernelLocalBytes();

// Launches the put kernels once on `device` (returning at once) and waits, so
// that no later first launch can wait for a GPU shared with spinning peers to
// drain.
void WarmPutKernels(int device);

// Local memory per thread of the put kernels (NVSHMEM's device calls need
// some: the reason for WarmPutKernels).
size_t PutKernelsLocalBytes();

}  // namespace jax_ep::nvshmem

#endif  // JAX_EP_FFI_NVSHMEM_RUNTIME_H_
