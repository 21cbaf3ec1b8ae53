// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep's own stream per GPU (`Group(comm_stream="jax_ep")`): the
// high-throughput ops' `_side` handlers launch their kernels on it, and
// `jax_ep_join` makes XLA's compute stream wait for them.
//
// Host C++ and the CUDA runtime only (no XLA header); nothing throws.
//
//   xla stream:  ... -> Fork (event) ........................ Join (wait) -> ...
//   own stream:           `-> wait -> the op's kernels -> Finish (event) -'
//
// NOTES:
// - Each op carries a key (the program position that issued it: 0 for a plain
//   call, a micro-batch's own key in the layer's pipeline), and its join waits
//   for the latest op of that key, not for one op: the own stream runs its ops
//   in launch order, so the latest op of a key finishes after every earlier one,
//   its join's own op included, and a join that waits on more than its op is
//   only later, never wrong. No value needs to travel from an op to its join
//   (XLA may copy or loop over any buffer a ticket could ride on, e.g. under
//   vmap), and ops and joins pair whatever order XLA runs them in. The key lets
//   one micro-batch's join leave another's op running beside the compute.
// - Neither handler may be captured into a command buffer: Fork leaves a
//   stream that the capture would have to join before it ends, and Join waits
//   on an event recorded outside the capture. Their registrations carry no
//   command-buffer trait, so XLA runs them as thunks between its graphs.
// - The own stream has the device's greatest priority: its kernels are few
//   and short against the GEMMs beside them, and a dispatch that waits for
//   SMs delays the micro-batch whose experts wait for it.
// - Where asked, it belongs to a green context of the group's `num_sms` SMs (a
//   partition of the GPU; the driver rounds up, to 8 on Hopper): an op's grid
//   is sized to its budget, but the hardware places blocks on any SM with
//   room, so a bounded grid still spreads over the whole GPU and the kernels
//   beside it wait for SMs; in the partition it runs on those SMs alone. The
//   partition binds only the own stream: XLA's kernels may still take its
//   SMs while the own stream is idle (a persistent grid of every SM holds them
//   to its end: `jax_ep.experts.override(kernel_sms=...)`). Where the driver
//   has no green contexts, or making one fails, a plain stream (and the
//   reason, for the caller to report).
// - One mutex guards all devices' state: the calls are a few per op, host
//   side only.
// - The stream and its events are made when a group asks for them
//   (PrepareOwnStream, from `Group(comm_stream="jax_ep")`), never inside a
//   handler. Keys share `kOwnStreamKeys` events (key % kOwnStreamKeys): a join
//   whose slot a later op of another key recorded waits longer, never less.

#ifndef JAX_EP_FFI_RUNTIME_SIDE_STREAM_H_
#define JAX_EP_FFI_RUNTIME_SIDE_STREAM_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jax_ep::runtime {

inline constexpr int64_t kOwnStreamKeys = 64;

// Makes device `device`'s own stream and its events (once; later calls do
// nothing): on a green context of at least `sms` SMs where `sms` > 0 and the
// driver makes one, else a plain stream. The handlers fail with
// cudaErrorNotReady on a device without it.
cudaError_t PrepareOwnStream(int device, int sms);

// The SMs of the green context device `device`'s own stream runs on (0: none,
// and why not in `*why_not` where one was asked for; may be null).
int OwnStreamPartition(int device, std::string* why_not);

// Makes the own stream of `xla_stream`'s device wait for the work queued on
// `xla_stream` so far, and returns it in `*own`.
cudaError_t ForkOwnStream(cudaStream_t xla_stream, cudaStream_t* own);

// Marks the end of an op of `key` launched on `own` (from ForkOwnStream).
cudaError_t FinishOnOwnStream(cudaStream_t own, int64_t key);

// Makes `xla_stream` wait for the latest op of `key` finished on its device's
// own stream (and so for every op launched before it there).
cudaError_t JoinOwnStream(cudaStream_t xla_stream, int64_t key);

// Makes `xla_stream` wait for every op launched on its device's own stream:
// what a handler does before it returns an error, so that XLA, which gives an
// execution's buffers back once its stream is done, never does so while an
// op of this execution still runs there (an error in a step of XLA's own
// skips the joins after it, and nothing here can cover that).
cudaError_t JoinAllOwnStream(cudaStream_t xla_stream);

}  // namespace jax_ep::runtime

#endif  // JAX_EP_FFI_RUNTIME_SIDE_STREAM_H_
