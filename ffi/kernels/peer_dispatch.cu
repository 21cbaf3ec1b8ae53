// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// jax_ep::peer, Dispatch: after the send lists and the counts
// (peer_send_lists.cu), one kernel sends the rows to every rank while
// other blocks place this rank's own tokens, and, where every rank has a GPU
// of its own, the other sources' rows chunk by chunk as they land; then the
// arrival wait and the received entries' rows (docs/intranode.md).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ffi/kernels/fp8_rows.h"
#include "ffi/kernels/kernel_utils.cuh"
#include "ffi/kernels/layout_kernels.h"
#include "ffi/kernels/local_kernels.h"
#include "ffi/kernels/peer_dispatch_rows.cuh"
#include "ffi/kernels/peer_kernels.h"
#include "ffi/kernels/peer_launch.h"
#include "ffi/kernels/peer_protocol.cuh"

namespace jax_ep::peer {
namespace {

// Spins (thread 0 of the block) until *counter >= want; block-uniform result,
// false when the group aborted or the wait timed out (then recorded).
__device__ bool BlockWaitCount(const GroupView& g, const unsigned* counter,
                               unsigned want, int peer) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    const uint64_t start = GlobalTimerNs();
    int ok = 1;
    while (true) {
      unsigned v;
      asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
                   : "=r"(v)
                   : "l"(counter)
                   : "memory");
      if (v >= want) break;
      if (Aborted(g)) {
        ok = 0;
        break;
      }
      if (GlobalTimerNs() - start > static_cast<uint64_t>(g.timeout_ns)) {
        RecordTimeout(g, OpCode::kDispatch, kDispatchRegion, WaitKind::kArrival,
                      peer, CurrentSeq(g, kDispatchRegion));
        ok = 0;
        break;
      }
    }
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

// The sends of a dispatch, the placement of this rank's own tokens and, where
// every rank has a GPU of its own, the placement of the other sources' rows as
// they land: one kernel, three roles by block index.
// * Senders, blocks [0, num_senders) (the group's SM budget): items are
//   tokens t, grid-stride; chunk c = tokens [c * chunk_tokens, (c + 1) *
//   chunk_tokens), chunk_tokens a multiple of num_senders. Row t is read
//   once and written to every other rank d with send_pos[t, d] >= 0 at
//   dispatch_rows[this rank][send_pos]; for every rank d the token goes to,
//   this one included, its K local expert ids (-1 for slots of other ranks),
//   K weights and K grouped ranks (dispatch_rank, from slot_rank[d, t, k])
//   go to d's region. After its last token of chunk c, thread 0 adds the
//   block's tokens of the chunk for every other rank d to d's
//   chunk_done[this rank][c]. The last sender releases the arrival flags.
// * Placers, blocks [num_senders, num_senders + num_placers): items are
//   tokens t with slots on this rank; row t goes straight from x to
//   recv_x[offset[me][l] + slot_rank[me, t, k]] for each (rows >= capacity
//   dropped). Rows past the used ones are never written (unspecified).
// * Receivers (only with `receive`), the remaining blocks: the other sources'
//   positions, chunk by chunk (chunks ascending, then sources), spread over
//   the receivers; a block waits until a chunk's tokens are all done
//   (chunk_done[s][c] == its positions, notify_chunks[s] gives them), then
//   places each position's row at offset[s][l] + dispatch_rank.
// Placers and senders never spin. Receivers spin only on other GPUs' senders,
// which have the lowest block indices of their kernels (see the deadlock
// NOTES at the top).
// NOTES: the placement needs every source's counts (the contract orders
// sources inside an expert), hence the notify in front of this kernel; with
// it the placement runs under the sends instead of after the arrivals. Pushes
// are evict-first stores (plain rows). `Rows`: PlainRows or Fp8Rows, how a
// row moves (rows: SendRows).
template <typename Rows>
__global__ void __launch_bounds__(kCommThreads, kRowsSendBlocksPerSm)
    DispatchSendKernel(GroupView g, SendRows rows,
                       const int32_t* __restrict__ send_pos,
                       const int32_t* __restrict__ topk_idx,
                       const float* __restrict__ topk_weights,
                       const int32_t* __restrict__ count_to,
                       const int32_t* __restrict__ slot_rank,
                       const int32_t* __restrict__ offset,
                       const int32_t* __restrict__ source_chunks,
                       int64_t capacity,
                       int32_t num_tokens, int32_t num_experts,
                       int32_t num_local, int32_t num_senders,
                       int32_t chunk_tokens, int32_t num_placers) {
  __shared__ char* s_peer[kMaxR];
  __shared__ int32_t s_dest[kMaxR];
  __shared__ int32_t s_pos[kMaxR];
  __shared__ int32_t s_num;
  __shared__ int32_t s_idx[kMaxK];
  __shared__ float s_w[kMaxK];
  __shared__ int32_t s_row[kMaxK];
  if (BlockSeesAbort(g)) return;
  const int me = g.rank;
  const int32_t num_topk = g.num_topk;
  const int64_t t_max = g.max_tokens;
  const int64_t slots = static_cast<int64_t>(num_tokens) * num_topk;
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  if (block >= num_senders + num_placers) {
    // Receiver.
    const int32_t num_receivers = gridDim.x - num_senders - num_placers;
    const int32_t q = block - num_senders - num_placers;
    const int32_t* chunks =
        reinterpret_cast<const int32_t*>(g.own + g.layout.notify_chunks);
    const unsigned* done =
        reinterpret_cast<const unsigned*>(g.own + g.layout.chunk_done);
    const int32_t* meta =
        reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_meta);
    const int32_t* ranks =
        reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_rank);
    int64_t item = 0;  // items (positions) of the chunks before this one
    for (int32_t c = 0;; ++c) {
      bool any = false;
      for (int s = 0; s < g.num_ranks; ++s) {
        if (s == me || c >= source_chunks[s]) continue;
        any = true;
        const int32_t* start = chunks + s * (t_max + 1);
        const int32_t begin =
            min(max(__ldcg(start + c), 0), static_cast<int32_t>(t_max));
        const int32_t end =
            min(max(__ldcg(start + c + 1), begin), static_cast<int32_t>(t_max));
        const int32_t n = end - begin;
        int32_t j = static_cast<int32_t>(
            (q - item % num_receivers + num_receivers) % num_receivers);
        item += n;
        if (j >= n) continue;  // block-uniform: nothing of this chunk here
        if (!BlockWaitCount(g, done + s * (t_max + 1) + c,
                            static_cast<unsigned>(n), s)) {
          return;
        }
        for (; j < n; j += num_receivers) {
          const int64_t entry = s * t_max + begin + j;
          __syncthreads();  // the previous row's readers of s_row are done
          int32_t my_row = -1;
          if (threadIdx.x < num_topk) {
            const int64_t at = entry * num_topk + threadIdx.x;
            const int32_t l = __ldcg(meta + at);
            if (l >= 0 && l < num_local) {
              my_row =
                  CheckedRow64(static_cast<int64_t>(offset[s * num_local + l]) +
                                   __ldcg(ranks + at),
                               capacity);
            }
            s_row[threadIdx.x] = my_row;
          }
          if (!__syncthreads_or(my_row >= 0)) continue;  // block-uniform
          Rows::PlaceReceived(g, rows, entry, s_row);
        }
      }
      if (!any) break;  // block-uniform
    }
    return;
  }
  if (block >= num_senders) {
    // Placer.
    const int32_t* rank_me = slot_rank + me * slots;
    const int32_t* offset_me = offset + me * num_local;
    for (int32_t t = block - num_senders; t < num_tokens; t += num_placers) {
      __syncthreads();  // the previous token's readers of s_row are done
      int32_t my_row = -1;
      if (threadIdx.x < num_topk) {
        const int64_t at = static_cast<int64_t>(t) * num_topk + threadIdx.x;
        const int32_t e = topk_idx[at];
        if (e >= 0 && e < num_experts && e / num_local == me) {
          my_row = CheckedRow64(
              static_cast<int64_t>(offset_me[e - me * num_local]) + rank_me[at],
              capacity);
        }
        s_row[threadIdx.x] = my_row;
      }
      if (!__syncthreads_or(my_row >= 0)) continue;  // block-uniform
      Rows::Place(g, rows, t, s_row);
    }
    return;
  }
  // Sender.
  __shared__ unsigned s_done[kMaxR];  // this chunk's tokens done per rank
  if (threadIdx.x < g.num_ranks) {
    s_peer[threadIdx.x] = g.peers[threadIdx.x];
    s_done[threadIdx.x] = 0u;
  }
  const int64_t stride = t_max + 1;
  for (int32_t t = block; t < num_tokens; t += num_senders) {
    __syncthreads();  // the previous token's readers of shared are done
    if (threadIdx.x < 32) {
      StageDestinations(send_pos, t, g, s_dest, s_pos, &s_num);
    }
    if (threadIdx.x < num_topk) {
      // A slot selects at most one rank's expert: its grouped rank is staged
      // beside its id (-1 for no expert).
      const int64_t at = static_cast<int64_t>(t) * num_topk + threadIdx.x;
      const int32_t e = topk_idx[at];
      s_idx[threadIdx.x] = e;
      s_w[threadIdx.x] = topk_weights[at];
      s_row[threadIdx.x] = e >= 0 && e < num_experts
                               ? slot_rank[(e / num_local) * slots + at]
                               : -1;
    }
    __syncthreads();
    const int32_t n = s_num;  // block-uniform
    // Block-uniform: a token kept on this rank alone (or sent nowhere) moves
    // no row.
    if (!(n == 0 || (n == 1 && s_dest[0] == me))) {
      Rows::Push(g, s_peer, s_dest, s_pos, n, rows, t);
    }
    for (int32_t q = threadIdx.x; q < n * num_topk; q += kCommThreads) {
      const int32_t j = q / num_topk;
      const int32_t k = q - j * num_topk;
      const int32_t d = s_dest[j];
      const int32_t e = s_idx[k];
      const bool mine = e >= 0 && e < num_experts && e / num_local == d;
      const int64_t at = (me * t_max + s_pos[j]) * num_topk + k;
      char* base = s_peer[d];
      reinterpret_cast<int32_t*>(base + g.layout.dispatch_meta)[at] =
          mine ? e - d * num_local : -1;
      reinterpret_cast<float*>(base + g.layout.dispatch_weights)[at] = s_w[k];
      reinterpret_cast<int32_t*>(base + g.layout.dispatch_rank)[at] =
          mine ? s_row[k] : -1;
    }
    if (threadIdx.x < n) s_done[s_dest[threadIdx.x]] += 1u;  // distinct d
    // This block's last token of chunk c: its tokens of the chunk are done
    // at every other rank.
    // NOTES: the barrier orders every thread's stores above before thread
    // 0's system fence, which orders them before the counts (the receiver
    // acquires them); once per chunk and block, not per token: the fence
    // waits out the block's NVLink stores, and per token it held every block
    // a round trip per token.
    const int32_t c = t / chunk_tokens;
    const int32_t next = t + num_senders;
    if (next >= num_tokens || next / chunk_tokens != c) {  // block-uniform
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();
        for (int d = 0; d < g.num_ranks; ++d) {
          const unsigned k = s_done[d];
          if (k == 0u || d == me) continue;
          atomicAdd_system(
              reinterpret_cast<unsigned*>(s_peer[d] + g.layout.chunk_done) +
                  me * stride + c,
              k);
        }
        for (int d = 0; d < g.num_ranks; ++d) s_done[d] = 0u;
      }
    }
  }
  if (!ArriveLastBlock(&g.state->blocks_done[kDispatchSendCounter],
                       num_senders)) {
    return;
  }
  // NOTES: seq is read here, not at entry: this op's FinishKernel is the
  // only writer and runs later; held across the token loop it spilled.
  const uint64_t seq = CurrentSeq(g, kDispatchRegion);
  if (threadIdx.x < g.num_ranks) {
    const int d = threadIdx.x;
    StoreReleaseSys(ArrivalFlag(s_peer[d], g, kDispatchRegion, me),
                    FlagValue(seq, count_to[d]));
  }
}

// Entries n = s * T_max + i, slot k: entry_row[n, k] = offset[s][l] +
// dispatch_rank (see WaitCountsKernel) for entries with i < recv_counts[s]
// whose slot selects local expert l, -1 where that row is >= capacity or there
// is none; entry_weights[n, k] = the weight that came with the entry, 0 where
// the slot is not for this rank. Also resets the chunk counters.
__global__ void EntryRowsKernel(GroupView g,
                                const int32_t* __restrict__ recv_counts,
                                const int32_t* __restrict__ offset,
                                int32_t num_local, int64_t capacity,
                                int32_t* __restrict__ entry_row,
                                float* __restrict__ entry_weights) {
  const int32_t* meta =
      reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_meta);
  const float* weights =
      reinterpret_cast<const float*>(g.own + g.layout.dispatch_weights);
  const int32_t* ranks =
      reinterpret_cast<const int32_t*>(g.own + g.layout.dispatch_rank);
  const int64_t num_topk = g.num_topk;
  const int64_t total = g.num_ranks * g.max_tokens * num_topk;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       q < total; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = q / num_topk;
    const int64_t s = n / g.max_tokens;
    const int64_t i = n - s * g.max_tokens;
    int32_t row = -1;
    float w = 0.0f;
    if (i < recv_counts[s]) {
      const int32_t l = __ldcg(meta + q);
      if (l >= 0 && l < num_local) {
        row = CheckedRow64(
            static_cast<int64_t>(offset[s * num_local + l]) + __ldcg(ranks + q),
            capacity);
        w = __ldcg(weights + q);
      }
    }
    entry_row[q] = row;
    entry_weights[q] = w;
  }
  // Every source's chunk counters back to 0 for the next call: this call's
  // counts all precede the arrival flags acquired before this kernel, and the
  // next call's follow the release of the region after it.
  unsigned* done = reinterpret_cast<unsigned*>(g.own + g.layout.chunk_done);
  const int64_t counters = g.num_ranks * (g.max_tokens + 1);
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       q < counters; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    done[q] = 0u;
  }
}

}  // namespace

namespace launch {

cudaError_t PreloadDispatchKernels() {
  using fp8::Source;
  cudaFuncAttributes attr;
  for (const void* kernel : {
           reinterpret_cast<const void*>(DispatchSendKernel<PlainRows>),
           reinterpret_cast<const void*>(
               DispatchSendKernel<Fp8Rows<__nv_bfloat16, Source::kQuantize>>),
           reinterpret_cast<const void*>(
               DispatchSendKernel<Fp8Rows<__half, Source::kQuantize>>),
           reinterpret_cast<const void*>(
               DispatchSendKernel<Fp8Rows<float, Source::kQuantize>>),
           reinterpret_cast<const void*>(
               DispatchSendKernel<Fp8Rows<uint8_t, Source::kGiven>>),
           reinterpret_cast<const void*>(EntryRowsKernel)}) {
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  }
  return cudaSuccess;
}

}  // namespace launch

using namespace launch;  // NOLINT: this file's half of the launch helpers

namespace {

// The send kernel of these rows (DispatchSendKernel<Rows>).
using SendKernel = void (*)(GroupView, SendRows, const int32_t*,
                            const int32_t*, const float*, const int32_t*,
                            const int32_t*, const int32_t*, const int32_t*,
                            int64_t, int32_t, int32_t, int32_t, int32_t,
                            int32_t, int32_t);

SendKernel Fp8SendKernel(const fp8::Rows& src) {
  using fp8::Source;
  if (src.source == Source::kGiven) {
    return DispatchSendKernel<Fp8Rows<uint8_t, Source::kGiven>>;
  }
  if (src.source != Source::kQuantize) return nullptr;
  switch (src.dtype) {
    case ElementType::kBF16:
      return DispatchSendKernel<Fp8Rows<__nv_bfloat16, Source::kQuantize>>;
    case ElementType::kF16:
      return DispatchSendKernel<Fp8Rows<__half, Source::kQuantize>>;
    case ElementType::kF32:
      return DispatchSendKernel<Fp8Rows<float, Source::kQuantize>>;
  }
  return nullptr;
}

// Dispatch of `rows` with `kernel`; `fp8`: the rows are fp8 wire rows.
// Arguments as peer::Dispatch's, checked by the callers.
cudaError_t DispatchRows(const GroupView& g, const SendRows& rows, bool fp8,
                         SendKernel kernel, const int32_t* topk_idx,
                         const float* topk_weights, int64_t num_tokens,
                         int64_t num_experts, int64_t capacity,
                         int32_t* group_sizes, int32_t* num_dropped,
                         int32_t* num_invalid, int32_t* send_pos,
                         int32_t* entry_row, float* entry_weights,
                         int32_t* recv_counts, int32_t* status,
                         int32_t* workspace, cudaStream_t stream) {
  if (!ValidTokens(g, num_tokens) || num_experts < g.num_ranks ||
      num_experts % g.num_ranks != 0 ||
      num_experts / g.num_ranks > kMaxExperts || capacity < 0 ||
      kernel == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_local = num_experts / g.num_ranks;
  const int64_t num_rows = g.num_ranks * g.max_tokens;  // N
  const int64_t chunk_stride = g.max_tokens + 1;
  const DispatchWorkspace w =
      MakeDispatchWorkspace(g.num_ranks, g.max_tokens, g.num_topk, num_experts);
  int32_t* count_to = workspace + w.count_to;
  int32_t* layout_dropped = workspace + w.layout_dropped;
  int32_t* layout_invalid = workspace + w.layout_invalid;
  int32_t* source_chunks = workspace + w.source_chunks;
  int32_t* chunk_start = workspace + w.chunk_start;
  int32_t* dest_ids = workspace + w.dest_ids;
  int32_t* slot_rank = workspace + w.slot_rank;
  int32_t* dest_counts = workspace + w.dest_counts;
  int32_t* offset = workspace + w.offset;
  int32_t* tile_count = workspace + w.tile_count;
  int32_t* invalid_count = workspace + w.invalid_count;
  int32_t* layout_workspace = workspace + w.layout;
  // NOTES: the senders' grid is the same every call (the counter relies on
  // it). A chunk holds whole rounds of it (one token per sender each), about
  // kTargetChunks chunks a call: each costs every sender a system fence, and
  // the receivers trail the last one.
  const int32_t num_senders = g.num_blocks * kRowsSendBlocksPerSm;
  const int64_t rounds = (num_tokens + num_senders - 1) / num_senders;
  const int32_t chunk_tokens = static_cast<int32_t>(
      std::max<int64_t>((rounds + kTargetChunks - 1) / kTargetChunks, 1) *
      num_senders);
  const int32_t num_chunks =
      static_cast<int32_t>((num_tokens + chunk_tokens - 1) / chunk_tokens);

  // 1. Send lists (local): send_pos, count_to, chunk starts, num_invalid, and
  //    each slot's local expert per destination.
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::LaunchSendLists(
      topk_idx, dest_ids, tile_count, invalid_count, send_pos, count_to,
      chunk_start, num_invalid, static_cast<int32_t>(num_tokens), g.num_topk,
      static_cast<int32_t>(num_experts), static_cast<int32_t>(num_local),
      g.num_ranks, chunk_tokens, chunk_stride, stream));
  // 2. Per destination, the slots' rows in this rank's expert-grouped order
  //    of what it sends there, and the counts per local expert (the batched
  //    local layout, one batch element per destination, nothing dropped).
  JAX_EP_CUDA_RETURN_IF_ERROR(layout::LocalLayout(
      dest_ids, slot_rank, dest_counts, layout_dropped, layout_invalid,
      layout_workspace, /*num_batches=*/g.num_ranks, num_tokens, g.num_topk,
      num_local, /*capacity=*/INT32_MAX, /*expert_alignment=*/1, stream));
  // 3. Notify: counts and chunk starts into every rank's region, once it
  //    released it.
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::LaunchNotify(
      g, dest_counts, chunk_start, static_cast<int32_t>(num_local), num_chunks,
      stream));
  // 4. Every source's counts: receive offsets, group_sizes, num_dropped.
  JAX_EP_CUDA_RETURN_IF_ERROR(launch::LaunchWaitCounts(
      g, static_cast<int32_t>(num_local), capacity, offset, group_sizes,
      num_dropped, source_chunks, stream));
  // 5. Rows + meta into the other ranks' regions, then their flags; this
  //    rank's own tokens straight into recv_x meanwhile; with GPUs of their
  //    own, the other sources' rows too, chunk by chunk as they land.
  // NOTES: the placers and receivers take the SMs outside the budget (at
  // least as many as the budget), the placers 1/R of them (their share of
  // the rows), no more placers than tokens. While receiving, neither role
  // gets more blocks than the senders: the rows arrive at the senders' pace,
  // and more blocks only contend with the senders for the SMs they share.
  const bool receive = g.receive_while_sending != 0;
  int64_t others = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(SmsOutsideBudget(g, &others));
  others *= kRowsSendBlocksPerSm;
  int64_t num_placers = receive ? others / g.num_ranks : others;
  if (receive && num_placers > num_senders) num_placers = num_senders;
  if (num_placers < 1) num_placers = 1;
  const int64_t num_receivers =
      receive && g.num_ranks > 1
          ? std::min<int64_t>(others - num_placers, num_senders)
          : 0;
  if (!receive && num_placers > num_tokens) num_placers = num_tokens;
  kernel<<<static_cast<unsigned>(num_senders + num_placers + num_receivers),
           kCommThreads, 0, stream>>>(
      g, rows, send_pos, topk_idx, topk_weights, count_to, slot_rank, offset,
      source_chunks, capacity, static_cast<int32_t>(num_tokens),
      static_cast<int32_t>(num_experts), static_cast<int32_t>(num_local),
      num_senders, chunk_tokens, static_cast<int32_t>(num_placers));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 6. Every source's flag: recv_counts.
  JAX_EP_CUDA_RETURN_IF_ERROR(
      LaunchWait(g, OpCode::kDispatch, kDispatchRegion, recv_counts, stream));
  // 7. Rows and weights of the N*K received entries; chunk counters reset.
  unsigned grid = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(
      ElementwiseGrid(EntryRowsKernel, 256, num_rows * g.num_topk, &grid));
  EntryRowsKernel<<<grid, 256, 0, stream>>>(g, recv_counts, offset,
                                            static_cast<int32_t>(num_local),
                                            capacity, entry_row, entry_weights);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 8. Without receivers: the other sources' rows from the receive buffer
  //    into recv_x (the own tokens were placed in 5).
  if (!receive) {
    local::PlacedTokens placed;
    placed.begin = static_cast<int64_t>(g.rank) * g.max_tokens;
    placed.count = g.max_tokens;
    if (fp8) {
      fp8::Rows packed = rows.src;
      packed.source = fp8::Source::kPacked;
      packed.x = g.own + g.layout.dispatch_rows;
      packed.scales = nullptr;
      JAX_EP_CUDA_RETURN_IF_ERROR(local::DispatchFp8(
          packed, entry_row, rows.recv_x, rows.recv_scales,
          /*num_batches=*/1, num_rows, g.num_topk, g.hidden, capacity, stream,
          /*x_from_peers=*/true, placed));
    } else {
      JAX_EP_CUDA_RETURN_IF_ERROR(local::Dispatch(
          rows.src.dtype, g.own + g.layout.dispatch_rows, entry_row,
          /*slot_weights=*/nullptr, rows.recv_x, /*num_batches=*/1, num_rows,
          g.num_topk, num_local, g.hidden, capacity, /*weighted=*/false,
          stream, /*x_from_peers=*/true, placed));
    }
  }
  // 9. Release the region, advance seq, status.
  return LaunchFinish(g, 1u << kDispatchRegion, status, stream);
}

}  // namespace

cudaError_t Dispatch(const GroupView& g, ElementType dtype, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     int64_t num_tokens, int64_t num_experts, int64_t capacity,
                     void* recv_x, int32_t* group_sizes, int32_t* num_dropped,
                     int32_t* num_invalid, int32_t* send_pos,
                     int32_t* entry_row, float* entry_weights,
                     int32_t* recv_counts, int32_t* status, int32_t* workspace,
                     cudaStream_t stream) {
  if (!ValidView(g, dtype)) return cudaErrorInvalidValue;
  SendRows rows;
  rows.src.dtype = dtype;
  rows.src.x = x;
  rows.recv_x = recv_x;
  rows.recv_scales = nullptr;
  rows.rv = static_cast<int32_t>(g.hidden * g.itemsize / 16);
  return DispatchRows(g, rows, /*fp8=*/false, DispatchSendKernel<PlainRows>,
                      topk_idx, topk_weights, num_tokens, num_experts,
                      capacity, group_sizes, num_dropped, num_invalid,
                      send_pos, entry_row, entry_weights, recv_counts, status,
                      workspace, stream);
}

cudaError_t DispatchFp8(const GroupView& g, const fp8::Rows& src,
                        const int32_t* topk_idx, const float* topk_weights,
                        int64_t num_tokens, int64_t num_experts,
                        int64_t capacity, void* recv_x, void* recv_scales,
                        int32_t* group_sizes, int32_t* num_dropped,
                        int32_t* num_invalid, int32_t* send_pos,
                        int32_t* entry_row, float* entry_weights,
                        int32_t* recv_counts, int32_t* status,
                        int32_t* workspace, cudaStream_t stream) {
  // The group's own element type sizes its staging rows; a wire row must
  // fit in one (fp8_rows.h).
  const ElementType group_dtype =
      g.itemsize == 4 ? ElementType::kF32 : ElementType::kBF16;
  const int64_t row_bytes = fp8::RowBytes(g.hidden, src.format);
  if (!ValidView(g, group_dtype) || !fp8::ValidHidden(g.hidden, src.format) ||
      row_bytes > g.hidden * g.itemsize || src.x == nullptr ||
      recv_x == nullptr || recv_scales == nullptr ||
      (src.source == fp8::Source::kQuantize &&
       detail::ElementBytes(src.dtype) != g.itemsize) ||
      (src.source == fp8::Source::kGiven && src.scales == nullptr)) {
    return cudaErrorInvalidValue;
  }
  SendRows rows;
  rows.src = src;
  rows.recv_x = recv_x;
  rows.recv_scales = recv_scales;
  rows.rv = static_cast<int32_t>(row_bytes / 16);
  return DispatchRows(g, rows, /*fp8=*/true, Fp8SendKernel(src), topk_idx,
                      topk_weights, num_tokens, num_experts, capacity,
                      group_sizes, num_dropped, num_invalid, send_pos,
                      entry_row, entry_weights, recv_counts, status, workspace,
                      stream);
}

}  // namespace jax_ep::peer
