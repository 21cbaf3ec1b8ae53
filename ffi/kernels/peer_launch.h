// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Host-side launch helpers of the peer transport, shared by its
// translation units (peer_*.cu); not part of the launcher API
// (peer_kernels.h). The kernels stay private to the file that launches
// them.

#ifndef JAX_EP_FFI_KERNELS_PEER_LAUNCH_H_
#define JAX_EP_FFI_KERNELS_PEER_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/kernels/peer_kernels.h"

namespace jax_ep::peer::launch {

// Whether the view and the dtype fit the kernels' limits (32-bit indices).
bool ValidView(const GroupView& g, ElementType dtype);
bool ValidTokens(const GroupView& g, int64_t num_tokens);

// The device's SMs outside the group's budget (as many as the budget when
// there are none), in SMs: where a send kernel's local roles run.
cudaError_t SmsOutsideBudget(const GroupView& g, int64_t* sms);

// The shared kernels (peer_common.cu): the arrival wait (counts_out, if
// not null, gets each source's count), the consumed wait, the op's last
// kernel, and the rows-only send of the cached dispatch and the combine VJP.
cudaError_t LaunchWait(const GroupView& g, OpCode op, int region,
                       int32_t* counts_out, cudaStream_t stream);
cudaError_t LaunchWaitConsumed(const GroupView& g, OpCode op, int region,
                               cudaStream_t stream);
cudaError_t LaunchFinish(const GroupView& g, unsigned region_mask,
                         int32_t* status, cudaStream_t stream);
cudaError_t LaunchRowsSend(const GroupView& g, OpCode op, const void* x,
                           const int32_t* send_pos, int64_t num_tokens,
                           cudaStream_t stream);

// The dispatch's send lists, notify and counts (peer_send_lists.cu);
// arguments as peer::Dispatch carves them from its workspace.
cudaError_t LaunchSendLists(const int32_t* topk_idx, int32_t* dest_ids,
                            int32_t* tile_count, int32_t* invalid_count,
                            int32_t* send_pos, int32_t* count_to,
                            int32_t* chunk_start, int32_t* num_invalid,
                            int32_t num_tokens, int32_t num_topk,
                            int32_t num_experts, int32_t num_local,
                            int32_t num_ranks, int32_t chunk_tokens,
                            int64_t chunk_stride, cudaStream_t stream);
cudaError_t LaunchNotify(const GroupView& g, const int32_t* dest_counts,
                         const int32_t* chunk_start, int32_t num_local,
                         int32_t num_chunks, cudaStream_t stream);
cudaError_t LaunchWaitCounts(const GroupView& g, int32_t num_local,
                             int64_t capacity, int32_t* offset,
                             int32_t* group_sizes, int32_t* num_dropped,
                             int32_t* source_chunks, cudaStream_t stream);

// Loads the kernels of each translation unit (see peer::PreloadKernels).
cudaError_t PreloadCommonKernels();
cudaError_t PreloadSendListKernels();
cudaError_t PreloadDispatchKernels();
cudaError_t PreloadCombineKernels();
cudaError_t PreloadBackwardKernels();

}  // namespace jax_ep::peer::launch

#endif  // JAX_EP_FFI_KERNELS_PEER_LAUNCH_H_
