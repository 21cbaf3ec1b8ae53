// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The one declaration header for every jax_ep kernel launcher.
//
// Framework-free on purpose: raw device pointers, `cudaStream_t`, launchers
// return `cudaError_t` and never throw. No XLA, nanobind or Python header may
// be included here (the FFI adapters in ffi/handlers/ are the only layer that
// knows about XLA). Launchers are grouped by op family, one namespace each,
// and every launcher's kernels live in the .cu file of its op
// (`layout::LocalLayout` -> ffi/kernels/layout.cu, `local::Combine` ->
// ffi/kernels/local_combine.cu, `intranode::Dispatch` ->
// ffi/kernels/intranode_dispatch.cu, the intranode backward ops ->
// intranode_backward.cu).
//
// Batching: every layout / local launcher takes `num_batches`, the product of
// the leading batch dims a `vmap` added to every operand. Batch element `b` of
// an operand of per-element size `n` starts at `ptr + b * n`; all batch
// elements run in one launch. The intranode (peer) launchers take no batch.
//
// Shape names follow DESIGN.md: `num_tokens` (T), `num_topk` (K),
// `num_experts` (E), `hidden` (H), `capacity` (rows of the expert-grouped
// buffer).

#ifndef JAX_EP_FFI_KERNELS_EP_KERNELS_H_
#define JAX_EP_FFI_KERNELS_EP_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

// Element types of the activation tensors (`x`, `recv_x`, `expert_out`...).
enum class ElementType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

// Limits shared by every op; the FFI handlers reject anything outside them.
inline constexpr int64_t kMaxExperts = 1024;
inline constexpr int64_t kMaxTopk = 32;
// Most slots (T * K) one call may have per batch element (per rank for the
// intranode transport's received entries, R * T_max * K). NOTES: int32 slot
// indices with headroom: the layout's last chunk ends at most one chunk (<=
// 2^22 slots) past T * K, which must still fit int32.
inline constexpr int64_t kMaxSlots = int64_t{1} << 30;
// Rows are moved as 16-byte vectors; `hidden` must be a multiple of this many
// elements for every element type (8 x bf16 = 16 bytes, 8 x f32 = 2 vectors).
inline constexpr int64_t kHiddenMultiple = 8;
// Rows of `recv_x` (capacity): row indices are int32.
inline constexpr int64_t kMaxCapacity = INT32_MAX;
// The SM budget of an intranode group's send kernels (num_sms): far above any
// GPU's multiprocessor count, and keeps every send grid well inside int32.
inline constexpr int64_t kMaxNumSms = 1024;

// ---------------------------------------------------------------------------
// Layout: slot -> row assignment of the expert-grouped buffer (one rank).
// ---------------------------------------------------------------------------
namespace layout {

// NOTES: the slots `(t, k)` of one batch element are processed in chunks of
// `LocalLayoutChunkSlots(T * K)` consecutive row-major slots, one thread block
// per chunk. The chunk grows with T * K so that there are never more than
// `kMaxChunks` chunks: that bounds the serial part of the per-expert scan over
// chunks. Both functions are pure host arithmetic, safe to call anywhere.
inline constexpr int64_t kThreads = 256;  // 8 warps per block.
inline constexpr int64_t kWarps = kThreads / 32;
inline constexpr int64_t kMinChunkSlots = 1024;  // Multiple of kThreads.
inline constexpr int64_t kMaxChunks = 512;

inline int64_t LocalLayoutChunkSlots(int64_t num_slots) {
  int64_t slots = (num_slots + kMaxChunks - 1) / kMaxChunks;
  if (slots < kMinChunkSlots) slots = kMinChunkSlots;
  return (slots + kThreads - 1) / kThreads * kThreads;
}

inline int64_t LocalLayoutNumChunks(int64_t num_slots) {
  const int64_t chunk = LocalLayoutChunkSlots(num_slots);
  return (num_slots + chunk - 1) / chunk;
}

// Elements of the int32 scratch buffer `LocalLayout` needs PER BATCH ELEMENT:
// per-chunk counts `[num_chunks, E + 1]` (column E counts invalid ids) followed
// by per-expert totals `[E + 1]`, i.e. `(num_chunks + 1) * (E + 1)`.
inline int64_t LocalLayoutWorkspaceElems(int64_t num_tokens, int64_t num_topk,
                                         int64_t num_experts) {
  return (LocalLayoutNumChunks(num_tokens * num_topk) + 1) * (num_experts + 1);
}

// An upper bound of LocalLayoutWorkspaceElems(T, K, E) over every T <=
// max_tokens, for a workspace sized once and used with any T up to it.
// NOTES: LocalLayoutWorkspaceElems is not monotone in T once T * K passes
// kMaxChunks * kMinChunkSlots (the chunk size is rounded up to whole blocks,
// so a smaller T can need more chunks); below that the chunks are
// ceil(T * K / kMinChunkSlots), above it at most kMaxChunks.
inline int64_t LocalLayoutMaxWorkspaceElems(int64_t max_tokens,
                                            int64_t num_topk,
                                            int64_t num_experts) {
  const int64_t max_slots = max_tokens * num_topk;
  const int64_t chunks = max_slots <= kMaxChunks * kMinChunkSlots
                             ? (max_slots + kMinChunkSlots - 1) / kMinChunkSlots
                             : kMaxChunks;
  return (chunks + 1) * (num_experts + 1);
}

// Assigns every valid slot a row of the expert-grouped buffer (see DESIGN.md
// and the `jax_ep_local_layout` handler): rows grouped by expert ascending,
// (t, k) ascending inside one expert; rows >= capacity are dropped.
//
// Per batch element:
//   topk_idx      `[T, K]` int32 in; ids < -1 or >= E are counted as invalid.
//   slot_row      `[T, K]` int32 out; row of the slot or -1.
//   group_sizes   `[E]`    int32 out; kept rows per expert.
//   num_dropped   `[]`     int32 out; valid slots with row >= capacity.
//   num_invalid   `[]`     int32 out; slots with id < -1 or id >= E.
//   workspace     `[LocalLayoutWorkspaceElems(T, K, E)]` int32 scratch.
// Requires 1 <= E <= kMaxExperts, T * K <= kMaxSlots, capacity >= 0.
// Deterministic: no atomic decides an order.
cudaError_t LocalLayout(const int32_t* topk_idx, int32_t* slot_row,
                        int32_t* group_sizes, int32_t* num_dropped,
                        int32_t* num_invalid, int32_t* workspace,
                        int64_t num_batches, int64_t num_tokens,
                        int64_t num_topk, int64_t num_experts, int64_t capacity,
                        cudaStream_t stream);

// Forces the module load of every kernel of this family on the current
// device (cudaFuncGetAttributes), so no lazy load happens later.
cudaError_t PreloadKernels();

}  // namespace layout

// ---------------------------------------------------------------------------
// Local (one rank) row movement between token order and expert-grouped order.
// ---------------------------------------------------------------------------
namespace local {

// Tokens of an intranode placement (local::Dispatch of received rows) whose
// rows the caller has already placed in `recv_x` (a dispatch places its own
// rank's tokens while its rows travel): tokens n in [begin, begin + count) are
// neither read nor written. Only with x_from_peers and one batch element
// (Dispatch refuses it otherwise, and a range outside [0, num_tokens]).
struct PlacedTokens {
  int64_t begin = 0;
  int64_t count = 0;
};

// recv_x[slot_row[t, k]] = x[t] (* slot_weights[t, k] in fp32, rounded once,
// when `weighted`) for every slot with 0 <= slot_row < capacity; no other row
// is written (rows past the used ones are unspecified). Each x row is read
// once.
//   x            `[T, H]` dtype      in
//   slot_row     `[T, K]` int32      in
//   slot_weights `[T, K]` float32    in (not read when !weighted; may be null)
//   recv_x       `[capacity, H]` dtype out
// All activation pointers must be 16-byte aligned and H % kHiddenMultiple == 0.
// Tokens none of whose slots has a row are not read at all.
// `x_from_peers`: `x` is a peer-transport receive buffer that other GPUs wrote
// (before this kernel was launched): its rows are read with ld.global.cg
// (L2, no L1 / non-coherent cache) instead of ld.global.nc.
// `placed`: see PlacedTokens.
cudaError_t Dispatch(ElementType dtype, const void* x, const int32_t* slot_row,
                     const float* slot_weights,
                     void* recv_x, int64_t num_batches, int64_t num_tokens,
                     int64_t num_topk, int64_t num_experts, int64_t hidden,
                     int64_t capacity, bool weighted, cudaStream_t stream,
                     bool x_from_peers = false,
                     const PlacedTokens& placed = {});

// out[t] = sum_{k ascending, slot_row[t,k] >= 0} w[t,k] * expert_out[slot_row]
// with w = slot_weights when `weighted`, else 1; fp32 accumulation with one
// fmaf per (k, element) in k-ascending order, rounded to dtype once. Tokens
// without a valid slot get zeros.
//   expert_out   `[capacity, H]` dtype in
//   slot_row     `[T, K]` int32      in
//   slot_weights `[T, K]` float32    in (not read when !weighted; may be null)
//   out          `[T, H]` dtype      out
cudaError_t Combine(ElementType dtype, const void* expert_out,
                    const int32_t* slot_row, const float* slot_weights,
                    void* out, int64_t num_batches, int64_t num_tokens,
                    int64_t num_topk, int64_t hidden, int64_t capacity,
                    bool weighted, cudaStream_t stream);

// dots[t, k] = sum_h float(d_out[t, h]) * float(expert_out[slot_row[t, k], h])
// in fp32 (fixed per-thread order, then a fixed tree), 0 where slot_row < 0.
//   d_out        `[T, H]` dtype      in
//   expert_out   `[capacity, H]` dtype in
//   slot_row     `[T, K]` int32      in
//   dots         `[T, K]` float32    out
cudaError_t CombineVjp(ElementType dtype, const void* d_out,
                       const void* expert_out, const int32_t* slot_row,
                       float* dots, int64_t num_batches, int64_t num_tokens,
                       int64_t num_topk, int64_t hidden, int64_t capacity,
                       cudaStream_t stream);

// Forces the module load of every kernel of this family on the current
// device (cudaFuncGetAttributes), so no lazy load happens later.
cudaError_t PreloadKernels();

}  // namespace local

// ---------------------------------------------------------------------------
// Intranode (intranode transport): multi-rank dispatch / combine through a
// table of peer pointers (CUDA IPC or P2P). Protocol: docs/intranode.md and
// the NOTES of ffi/kernels/intranode_protocol.cuh. Host-side set-up
// (allocation, IPC, registry): ffi/handlers/intranode_group.{h,cc}.
// ---------------------------------------------------------------------------
namespace intranode {

// Ranks of one intranode group (a flag array per region is indexed by rank; one
// warp stages a token's destinations in two ballots).
inline constexpr int64_t kMaxRanks = 64;
// Hosts of a network group (the rail exchange stages them in one warp pair).
inline constexpr int64_t kMaxHosts = 64;
inline constexpr int64_t kRegionAlign = 256;  // bytes; >= 16 for row vectors
inline constexpr int64_t kHeaderBytes =
    256;  // config header, checked on connect

// Regions of a rank's buffer that peers write into. Each has its own sequence
// counter, arrival flags and `consumed` counter, so their reuse is independent.
enum Region : int32_t {
  kDispatchRegion = 0,  // rows (x / d_out), meta, weights, token index
  kCombineRegion = 1,   // partial rows of combine (CombineWire: bf16 or fp32)
  kDotsRegion = 2,      // fp32 slot dots of combine_vjp
  kNumRegions = 3,
};

// Monotonic "blocks done" counters, one per communication (send) kernel.
enum SendCounter : int32_t {
  kDispatchSendCounter = 0,
  kRowsSendCounter = 1,
  kCombineSendCounter = 2,
  kDotsSendCounter = 3,
  // The low-latency send kernels (low_latency.cu).
  kLowLatencyDispatchSendCounter = 4,
  kLowLatencyCombineSendCounter = 5,
  // The low-latency waits' copying grids (not monotonic: the last block
  // resets its counter, so their grids may differ between calls).
  kLowLatencyDispatchPackCounter = 6,
  kLowLatencyCombineReduceCounter = 7,
  // The network transport's put kernels (ffi/nvshmem/low_latency_puts.cu;
  // resetting, like the waits' grids).
  kLowLatencyDispatchPutCounter = 8,
  kLowLatencyCombinePutCounter = 9,
  // The rail exchange's put kernel (ffi/nvshmem/rail_puts.cu; resetting).
  kRailPutCounter = 10,
  kNumSendCounters = 11,
};

// The two low-latency ops; each has its own sequence counter, buffer sets and
// flags (DeviceState::ll_seq, BufferLayout::ll_*).
enum LowLatencyOp : int32_t {
  kLowLatencyDispatch = 0,
  kLowLatencyCombine = 1,
  kNumLowLatencyOps = 2,
};

// Op codes recorded in the error mailbox.
enum class OpCode : int32_t {
  kNone = 0,
  kDispatch = 1,
  kDispatchCached = 2,
  kCombine = 3,
  kCombineVjp = 4,
  kLowLatencyDispatch = 5,
  kLowLatencyCombine = 6,
  kRailExchange = 7,
};

// What a timed-out spin was waiting for.
enum class WaitKind : int32_t {
  kNone = 0,
  kConsumed = 1,  // the peer to release its region from the previous call
  kArrival = 2,   // the peer's data of this call
  kCounts = 3,    // the peer's dispatch counts of this call (notify)
  // Not a wait: a low-latency send issued before the wait of its previous
  // call, or a wait with no send before it (`peer` is this rank).
  kOutOfOrder = 4,
};

// Byte offsets of the regions of one rank's buffer (the receiver side).
// NOTES: every region is sized for the worst routing skew (every token of
// every source sent to this one rank), so no flow control depends on the
// workload:
//   header            kHeaderBytes (config, checked by every peer on connect)
//   dispatch_rows     [R src][T_max][H] x dtype      R*T_max*H*itemsize
//                     (a dispatch leaves its own source's rows out: it places
//                     them from x while the others travel; the cached dispatch
//                     and the combine VJP copy them)
//   dispatch_meta     [R src][T_max][K] int32         local expert or -1
//   dispatch_weights  [R src][T_max][K] float32
//   dispatch_rank     [R src][T_max][K] int32         the slot's row in the
//                     source's own expert-grouped order of the slots it sends
//                     this rank (see intranode::Dispatch)
//   notify_counts     [R src][kMaxExperts] int32     slots per local expert
//   notify_chunks     [R src][T_max + 1] int32       receive position of the
//                     first token of each of the source's send chunks
//   chunk_done        [R src][T_max + 1] u32         tokens of each chunk the
//                     source has finished (the receiver resets them)
//   combine_rows      [R expert rank][T_max][H] partial sums, sized for
//                     float32; they travel in bf16 for bf16 activations (half
//                     the wire bytes), else in fp32 (CombineWire,
//                     intranode_protocol.cuh)
//   dots              [R expert rank][T_max][K] float32
//   flags             arrival[kNumRegions][R] u64, consumed[kNumRegions] u64,
//                     notify[R] u64 (dispatch counts, dispatch region's seq)
// and, only in a group created with low-latency buffers (L = E / R local
// experts, two sets b = 0, 1 of each; see ffi/kernels/low_latency.cu):
//   ll_dispatch_rows[b]  [L][R src][T_max] rows of ll_row_bytes = H * itemsize
//                        (an fp8 row is H bytes of e4m3 then H / 128 float32
//                        scales, which fit in H * itemsize for itemsize >= 2)
//   ll_dispatch_meta[b]  [L][R src][T_max] int32  t * K + k of the row's token
//                        and (first) slot on its source
//   ll_combine_rows[b]   [T_max][K] rows of ll_row_bytes (the expert output
//                        row of each of this rank's slots)
//   ll_send_counts       [E] int32: rows per expert this rank sends in the
//                        current call (only its own kernels touch it)
//   ll_recv_start        [L][R + 1] int32: where each source's rows start in
//                        an expert's packed rows, this call (own kernels only)
//   ll_flags             dispatch[2][L][R src] u64, then combine[2][R] u64
// and, only in a group whose peers include ranks on other hosts (the network
// transport: the buffer lives in NVSHMEM's symmetric heap, and a row for such
// a rank is staged here, in memory the network can read, then put):
//   ll_outbox_rows[op]   [L][R dst][T_max] rows of ll_row_bytes, one per op (so
//                        that a dispatch and a combine in flight together never
//                        share one): dispatch rows for rank d's local expert l
//                        at (l, d, j); combine rows at the row of the expert
//                        slab they come from
//   ll_outbox_meta       [L][R dst][T_max] int32 (dispatch: t * K + k)
//   ll_outbox_counts     [E] int32: the dispatch's rows per expert for ranks
//                        reached through the network (the put kernel's flags)
// and, only in a network group of Hn >= 2 hosts, the rail exchange's regions
// (ffi/kernels/rail_exchange.cu; records of rail_record_bytes, the widest
// being a dispatched token: its row, K expert ids and K weights):
//   rail_inbox[b]        [Hn src host][T_max] records, two sets b = 0, 1
//   rail_outbox          [Hn dst host][T_max] records (what is put)
//   rail_flags           [2][Hn src host] u64: seq << 32 | rows
// each rounded up to kRegionAlign bytes (all zero without them).
struct BufferLayout {
  int64_t dispatch_rows;
  int64_t dispatch_meta;
  int64_t dispatch_weights;
  int64_t dispatch_rank;
  int64_t notify_counts;
  int64_t notify_chunks;
  int64_t chunk_done;
  int64_t combine_rows;
  int64_t dots;
  int64_t flags;
  int64_t ll_dispatch_rows[2];
  int64_t ll_dispatch_meta[2];
  int64_t ll_combine_rows[2];
  int64_t ll_send_counts;
  int64_t ll_recv_start;
  int64_t ll_flags;
  int64_t ll_outbox_rows[2];  // [LowLatencyOp]
  int64_t ll_outbox_meta;
  int64_t ll_outbox_counts;
  int64_t rail_inbox[2];
  int64_t rail_outbox;
  int64_t rail_flags;
  int64_t rail_record_bytes;
  int64_t ll_row_bytes;
  int64_t total;  // bytes of the whole buffer
};

inline int64_t AlignRegion(int64_t bytes) {
  return (bytes + kRegionAlign - 1) / kRegionAlign * kRegionAlign;
}

// Bytes of one record of the rail exchange: fields start at 16-byte offsets.
__host__ __device__ inline int64_t AlignRecord(int64_t bytes) {
  return (bytes + 15) / 16 * 16;
}
inline int64_t RailRecordBytes(int64_t hidden, int64_t itemsize,
                               int64_t num_topk) {
  return AlignRecord(hidden * itemsize) + 2 * AlignRecord(num_topk * 4);
}

// Pure host arithmetic; callers validate the arguments (all >= 1).
// `num_experts` > 0 adds the low-latency buffers (0: none), `network` their
// outbox (ll_outbox_*), `num_hosts` >= 2 (network groups) the rail exchange's
// regions.
inline BufferLayout MakeBufferLayout(int64_t num_ranks, int64_t max_tokens,
                                     int64_t hidden, int64_t num_topk,
                                     int64_t itemsize,
                                     int64_t low_latency_experts = 0,
                                     bool network = false,
                                     int64_t num_hosts = 0) {
  const int64_t rows = num_ranks * max_tokens;  // N
  BufferLayout l;
  int64_t at = kHeaderBytes;
  l.dispatch_rows = at;
  at += AlignRegion(rows * hidden * itemsize);
  l.dispatch_meta = at;
  at += AlignRegion(rows * num_topk * 4);
  l.dispatch_weights = at;
  at += AlignRegion(rows * num_topk * 4);
  l.dispatch_rank = at;
  at += AlignRegion(rows * num_topk * 4);
  l.notify_counts = at;
  at += AlignRegion(num_ranks * kMaxExperts * 4);
  l.notify_chunks = at;
  at += AlignRegion(num_ranks * (max_tokens + 1) * 4);
  l.chunk_done = at;
  at += AlignRegion(num_ranks * (max_tokens + 1) * 4);
  l.combine_rows = at;
  at += AlignRegion(rows * hidden * 4);
  l.dots = at;
  at += AlignRegion(rows * num_topk * 4);
  l.flags = at;
  at += AlignRegion((kNumRegions * num_ranks + kNumRegions + num_ranks) * 8);
  l.ll_row_bytes = low_latency_experts > 0 ? hidden * itemsize : 0;
  const int64_t num_local =
      low_latency_experts > 0 ? low_latency_experts / num_ranks : 0;
  const int64_t slab_rows = num_local * num_ranks * max_tokens;
  for (int b = 0; b < 2; ++b) {
    l.ll_dispatch_rows[b] = at;
    at += AlignRegion(slab_rows * l.ll_row_bytes);
    l.ll_dispatch_meta[b] = at;
    at += AlignRegion(slab_rows * 4);
    l.ll_combine_rows[b] = at;
    at += AlignRegion(
        low_latency_experts > 0 ? max_tokens * num_topk * l.ll_row_bytes : 0);
  }
  l.ll_send_counts = at;
  at += AlignRegion(low_latency_experts * 4);
  l.ll_recv_start = at;
  at += AlignRegion(low_latency_experts > 0 ? num_local * (num_ranks + 1) * 4
                                            : 0);
  l.ll_flags = at;
  at += AlignRegion(low_latency_experts > 0
                        ? (2 * num_local * num_ranks + 2 * num_ranks) * 8
                        : 0);
  const bool outbox = network && low_latency_experts > 0;
  for (int op = 0; op < 2; ++op) {
    l.ll_outbox_rows[op] = at;
    at += AlignRegion(outbox ? slab_rows * l.ll_row_bytes : 0);
  }
  l.ll_outbox_meta = at;
  at += AlignRegion(outbox ? slab_rows * 4 : 0);
  l.ll_outbox_counts = at;
  at += AlignRegion(outbox ? low_latency_experts * 4 : 0);
  const bool rail = network && num_hosts >= 2;
  l.rail_record_bytes = rail ? RailRecordBytes(hidden, itemsize, num_topk) : 0;
  const int64_t rail_bytes =
      rail ? num_hosts * max_tokens * l.rail_record_bytes : 0;
  for (int b = 0; b < 2; ++b) {
    l.rail_inbox[b] = at;
    at += AlignRegion(rail_bytes);
  }
  l.rail_outbox = at;
  at += AlignRegion(rail_bytes);
  l.rail_flags = at;
  at += AlignRegion(rail ? 2 * num_hosts * 8 : 0);
  l.total = at;
  return l;
}

// Per-group device state (device memory of the group's device, zeroed at
// creation). Only this rank's kernels touch it.
struct DeviceState {
  unsigned long long seq[kNumRegions];  // completed calls per region
  unsigned long long blocks_done[kNumSendCounters];  // monotonic
  // Completed calls of each low-latency op (its wait advances it; call n,
  // 0-based, uses buffer set n % 2 and tags its flags with n + 1), and
  // whether its send was issued and its wait not yet.
  unsigned long long ll_seq[kNumLowLatencyOps];
  unsigned int ll_pending[kNumLowLatencyOps];
  unsigned int ll_invalid;     // invalid ids of the current dispatch send
  unsigned int aborted;        // sticky: a spin of this group timed out
                               // (never reset: send blocks that returned
                               // early left blocks_done out of phase)
  unsigned int error_claimed;  // the first timeout fills the mailbox
  // Completed rail exchanges (network groups; call n, 0-based, uses inbox set
  // n % 2 and tags its flags with n + 1; its last kernel advances it).
  unsigned long long rail_seq;
};

// Error mailbox in host-mapped pinned memory: the device writes it once
// (fields, system fence, then `state` = 1); the host reads it without a sync.
struct Mailbox {
  unsigned int state;      // 0: no error, 1: the fields below are valid
  int32_t op;              // OpCode
  int32_t rank;            // this rank
  int32_t peer;            // the rank waited for
  int32_t wait_kind;       // WaitKind
  int32_t region;          // Region
  unsigned long long seq;  // the call (1-based, per region) that timed out
};

// Everything a peer kernel needs about its group, passed by value. All
// pointers are fixed at connect time (none changes per call), so launches are
// safe to capture into CUDA graphs.
struct GroupView {
  char* const* peers;  // device array [R]: base of each rank's buffer; null
                       // for a rank reached through the network transport
  char* own;           // this rank's buffer (== peers[rank]), device memory
  DeviceState* state;  // device memory
  Mailbox* mailbox;    // device pointer of the host-mapped mailbox
  BufferLayout layout;
  int64_t max_tokens;  // T_max
  int64_t hidden;      // H
  int64_t timeout_ns;  // every spin gives up after this long
  int32_t rank;
  int32_t num_ranks;   // R
  int32_t num_topk;    // K
  int32_t itemsize;    // bytes per activation element of the buffers
  int32_t num_blocks;  // SM budget: send kernels run num_blocks times their
                       // blocks per SM of sending blocks
                       // (intranode_protocol.cuh), on whichever SMs are free;
                       // it bounds their threads, not which SMs (the dispatch's
                       // placing blocks use the rest)
  int32_t
      receive_while_sending;  // 1: every rank has a GPU of its own and
                              // every pair has native P2P atomics, so a
                              // dispatch receives in blocks that spin beside
                              // its sends (intranode_dispatch.cu); 0: ranks
                              // share a GPU (MPS), where a spinning block could
                              // hold the SMs a peer's sender needs, or chunk
                              // counts could not be added atomically
  int32_t num_local;          // L = E / R local experts (low-latency ops)
  int32_t low_latency;        // 1: the buffer has the low-latency regions
  int32_t network;            // 1: some peers are reached through the network
                              // transport (their peers[] entry is null; the
                              // buffer has the ll_outbox_* regions)
  int32_t num_hosts;          // Hn >= 2 for a network group (the rail_*
                              // regions), else 0
};

// The `workspace` result of jax_ep_intranode_dispatch (int32 elements),
// sized and carved in this one place: offsets of its parts, in order, and the
// total. NOTES: Dispatch carves its pointers from these offsets and the
// handler sizes the result from `elems`, so the two cannot disagree.
inline constexpr int64_t kSendTileTokens = 512;
inline int64_t DispatchSendTiles(int64_t max_tokens) {
  const int64_t tiles = (max_tokens + kSendTileTokens - 1) / kSendTileTokens;
  return tiles > 1 ? tiles : 1;
}
struct DispatchWorkspace {
  int64_t count_to;        // [R] tokens sent to each rank
  int64_t layout_dropped;  // [R] layout scratch (never drops)
  int64_t layout_invalid;  // [R] layout scratch (invalid ids counted apart)
  int64_t source_chunks;   // [R] chunks of each source
  int64_t chunk_start;     // [R, T_max + 1] send position of each chunk's
                           // first token per destination
  int64_t dest_ids;        // [R, T_max, K] the slots' local expert ids per
                           // destination (-1 for other ranks' slots)
  int64_t slot_rank;       // [R, T_max, K] each slot's row in this rank's
                           // expert-grouped order of what it sends there
  int64_t dest_counts;     // [R, E/R] slots per (destination, local expert)
  int64_t offset;          // [R, E/R] receive offsets per (source, expert)
  int64_t tile_count;      // [R, tiles] tokens of each tile of
                           // kSendTileTokens tokens that go to each rank
  int64_t invalid_count;   // [tiles] invalid ids per tile
  int64_t layout;          // the batched local layout's workspace (R batches
                           // of up to T_max rows of K slots over E/R experts)
  int64_t elems;           // the total
};
inline DispatchWorkspace MakeDispatchWorkspace(int64_t num_ranks,
                                               int64_t max_tokens,
                                               int64_t num_topk,
                                               int64_t num_experts) {
  DispatchWorkspace w;
  int64_t at = 0;
  const auto take = [&at](int64_t elems) {
    const int64_t here = at;
    at += elems;
    return here;
  };
  const int64_t slots = num_ranks * max_tokens * num_topk;
  w.count_to = take(num_ranks);
  w.layout_dropped = take(num_ranks);
  w.layout_invalid = take(num_ranks);
  w.source_chunks = take(num_ranks);
  w.chunk_start = take(num_ranks * (max_tokens + 1));
  w.dest_ids = take(slots);
  w.slot_rank = take(slots);
  w.dest_counts = take(num_experts);
  w.offset = take(num_experts);
  w.tile_count = take(num_ranks * DispatchSendTiles(max_tokens));
  w.invalid_count = take(DispatchSendTiles(max_tokens));
  w.layout =
      take(num_ranks * layout::LocalLayoutMaxWorkspaceElems(
                           max_tokens, num_topk, num_experts / num_ranks));
  w.elems = at;
  return w;
}
inline int64_t DispatchWorkspaceElems(int64_t num_ranks, int64_t max_tokens,
                                      int64_t num_topk, int64_t num_experts) {
  return MakeDispatchWorkspace(num_ranks, max_tokens, num_topk, num_experts)
      .elems;
}

// Forces the module load of every kernel the intranode ops launch (this
// family's, the layout kernels and the local kernels) on the current device.
cudaError_t PreloadKernels();

// Notify + dispatch + layout (jax_ep_intranode_dispatch). Per rank:
//   x             `[T, H]`   dtype   in      topk_idx `[T, K]` int32 in
//   topk_weights  `[T, K]`   float32 in
//   recv_x        `[capacity, H]` dtype out  group_sizes `[E/R]` int32 out
//   num_dropped, num_invalid `[]` int32 out
//   send_pos      `[T, R]`   int32 out: position of t in the send list for d
//   entry_row     `[R*T_max, K]` int32 out: row of recv_x of entry (s, i, k)
//   entry_weights `[R*T_max, K]` float32 out (0 where no entry)
//   recv_counts   `[R]` int32 out        status `[]` int32 out (0 ok)
//   workspace     `[DispatchWorkspaceElems(R, T_max, K, E)]` int32 scratch
cudaError_t Dispatch(const GroupView& g, ElementType dtype, const void* x,
                     const int32_t* topk_idx, const float* topk_weights,
                     int64_t num_tokens, int64_t num_experts, int64_t capacity,
                     void* recv_x, int32_t* group_sizes, int32_t* num_dropped,
                     int32_t* num_invalid, int32_t* send_pos,
                     int32_t* entry_row, float* entry_weights,
                     int32_t* recv_counts, int32_t* status, int32_t* workspace,
                     cudaStream_t stream);

// Dispatch with the layout of an earlier Dispatch
// (jax_ep_intranode_dispatch_cached): rows only; entry (s, i, k) lands at
// entry_row (times entry_weights in fp32, rounded once, when `weighted`); rows
// >= sum(group_sizes) are not written (unspecified).
//   x `[T, H]`, send_pos `[T, R]`, entry_row / entry_weights `[R*T_max, K]`
//   (rows past each source's count are -1 there), group_sizes `[L]` in;
//   recv_x `[capacity, H]`, status out.
cudaError_t DispatchCached(const GroupView& g, ElementType dtype, const void* x,
                           const int32_t* send_pos, const int32_t* entry_row,
                           const float* entry_weights,
                           const int32_t* group_sizes, int64_t num_tokens,
                           int64_t num_local_experts, int64_t capacity,
                           bool weighted, void* recv_x, int32_t* status,
                           cudaStream_t stream);

// Combine (jax_ep_intranode_combine): expert side reduces each received token's
// rows over k ascending in fp32 (weighted or not) and writes one partial row
// to its home (bf16 for bf16 activations, else fp32: CombineWire); home sums
// the partials of ranks d ascending in fp32, rounds once.
//   expert_out `[capacity, H]` in; entry_row, entry_weights, recv_counts,
//   send_pos `[T, R]` in; out `[T, H]`, status out.
cudaError_t Combine(const GroupView& g, ElementType dtype,
                    const void* expert_out, const int32_t* entry_row,
                    const float* entry_weights, const int32_t* recv_counts,
                    const int32_t* send_pos, int64_t num_tokens,
                    int64_t capacity, bool weighted, void* out, int32_t* status,
                    cudaStream_t stream);

// Cotangents of the weighted combine (jax_ep_intranode_combine_vjp):
//   d_expert_out `[capacity, H]` = weighted cached dispatch of d_out `[T, H]`;
//   d_weights `[T, K]` float32 = <d_out[t], expert_out[row(t, k)]> (0 for
//   slots that select nothing or were dropped), dot taken on the expert side.
cudaError_t CombineVjp(const GroupView& g, ElementType dtype, const void* d_out,
                       const void* expert_out, const int32_t* topk_idx,
                       const int32_t* send_pos, const int32_t* entry_row,
                       const float* entry_weights, const int32_t* recv_counts,
                       const int32_t* group_sizes, int64_t num_tokens,
                       int64_t num_experts, int64_t capacity,
                       void* d_expert_out, float* d_weights, int32_t* status,
                       cudaStream_t stream);

}  // namespace intranode

// ---------------------------------------------------------------------------
// Low-latency (decode) ops over the intranode group's low-latency buffers:
// every address is known before the call, so the send is the first action;
// each op is a send and a wait, two launchers (and two custom calls) so that
// independent work can run between them. Protocol: ffi/kernels/low_latency.cu.
// Slots of one token that name the same expert are one row (the first slot's).
// ---------------------------------------------------------------------------
namespace low_latency {

// Rows of a low-latency dispatch's output: plain (x's dtype), or e4m3 with one
// float32 scale per 128 channels (kFp8: amax / 448; kFp8PowerOfTwo: rounded up
// to a power of two).
enum class RowFormat : int32_t { kPlain = 0, kFp8 = 1, kFp8PowerOfTwo = 2 };

// Sends every token's row to the rank of each expert it selects, at
// ll_dispatch_rows[set][l][this rank][j] (j: the token's position among this
// rank's tokens that select the expert), then each (rank, local expert)'s
// count as its arrival flag. `slot_scale` (`[T, K]` float32, may be null;
// plain rows only) multiplies the row sent for slot k (the weighted dispatch
// of combine's gradient). num_invalid `[]` int32 out: ids < -1 or >= E.
cudaError_t DispatchSend(const intranode::GroupView& g, ElementType dtype,
                         RowFormat format, const void* x,
                         const int32_t* topk_idx, const float* slot_scale,
                         int64_t num_tokens, int32_t* num_invalid,
                         cudaStream_t stream);

// Waits for every source's counts and packs expert l's rows at the front of
// recv_x[l] in (source rank, source token) order.
//   recv_x     `[L, R*T_max, H]` x dtype or e4m3 out (rows past count[l] are
//              left as they were)
//   scales     `[L, R*T_max, H/128]` float32, or UE8M0 `[L, R*T_max, H/512]`
//              int32 with `ue8m0` (fp8 formats only; may be null otherwise)
//   count      `[L]` int32 out   recv_src `[L, R*T_max]` int32 out:
//              s * T_max * K + t * K + k of each row, -1 past count
//   status     `[]` int32 out: 0 ok, 1 the group failed
cudaError_t DispatchWait(const intranode::GroupView& g, ElementType dtype,
                         RowFormat format, bool ue8m0, void* recv_x,
                         void* scales, int32_t* count, int32_t* recv_src,
                         int32_t* status, cudaStream_t stream);

// Sends each valid row (l, i < count[l]) of expert_out `[L, R*T_max, H]` to
// its token's home rank (recv_src), then the arrival flag of every home.
cudaError_t CombineSend(const intranode::GroupView& g, ElementType dtype,
                        const void* expert_out, const int32_t* recv_src,
                        const int32_t* count, cudaStream_t stream);

// Waits for every rank's rows; out[t] = sum over k ascending of
// weights[t, k] * row(t, k) in fp32, rounded once (`[T, H]`; the row of a
// slot is the one of the first slot of t that names the same expert; slots
// with ids outside [0, E) add nothing). With `gather`, out is `[T, K, H]`:
// row(t, k) itself, zeros for slots that select nothing (weights unread).
cudaError_t CombineWait(const intranode::GroupView& g, ElementType dtype,
                        const int32_t* topk_idx, const float* weights,
                        int64_t num_tokens, int64_t num_experts, bool gather,
                        void* out, int32_t* status, cudaStream_t stream);

// One rank (g.num_ranks == 1): the fused dispatch written straight into its
// outputs (DispatchWait's, plus num_invalid), with no buffer, flags or copy;
// rows past count[l] are left as they were, recv_src is -1 there. Takes
// DispatchSend's inputs and needs no wait.
cudaError_t DispatchLocal(const intranode::GroupView& g, ElementType dtype,
                          RowFormat format, bool ue8m0, const void* x,
                          const int32_t* topk_idx, const float* slot_scale,
                          int64_t num_tokens, void* recv_x, void* scales,
                          int32_t* count, int32_t* recv_src,
                          int32_t* num_invalid, int32_t* status,
                          cudaStream_t stream);

// One rank: the fused combine, reading each slot's row straight from
// expert_out `[L, T_max, H]` (where DispatchLocal / the packed slabs put it);
// CombineWait's outputs and semantics.
cudaError_t CombineLocal(const intranode::GroupView& g, ElementType dtype,
                         const void* expert_out, const int32_t* topk_idx,
                         const float* weights, int64_t num_tokens,
                         int64_t num_experts, bool gather, void* out,
                         int32_t* status, cudaStream_t stream);

cudaError_t PreloadKernels();

// Local memory per thread of the most demanding kernel above, as the last
// PreloadKernels found it: 0 by design (a kernel that needs local memory can,
// on its first launch, wait for a GPU shared under MPS to drain, peers'
// spinning waits included).
size_t MaxLocalBytes();

}  // namespace low_latency

// ---------------------------------------------------------------------------
// The rail exchange of a network group (ffi/kernels/rail_exchange.cu): every
// rank sends one block of rows to the rank with its own local index on each
// host (its rail peer there, `pes[h]`; this rank's own entry is itself), and
// receives one from each. A row is a record of up to kMaxRailFields fields,
// each field f taken from row index[h, j] of its source and written to row
// h * T_max + j of its destination. The network transport puts the blocks
// between the pack and the wait (network::Send, op kRailSend).
// ---------------------------------------------------------------------------
namespace rail {

inline constexpr int kMaxRailFields = 3;

struct Fields {
  int32_t num = 0;
  const void* src[kMaxRailFields] = {};  // [rows[f], bytes[f]]
  int64_t rows[kMaxRailFields] = {};     // rows of src (bounds every index)
  void* dst[kMaxRailFields] = {};        // [Hn * T_max, bytes[f]]
  int64_t bytes[kMaxRailFields] = {};    // per row, multiples of 4
};

// Bytes of a record of these fields (16-byte aligned offsets); the group's
// rail_record_bytes bounds it.
__host__ __device__ inline int64_t RecordBytes(const Fields& f) {
  int64_t total = 0;
  for (int i = 0; i < f.num; ++i) total += intranode::AlignRecord(f.bytes[i]);
  return total;
}

// Rows j < counts[h] of block h (index `[Hn, T_max]` int32, -1 rows are
// zero) into the outbox, the own host's block straight into the own inbox.
cudaError_t Pack(const intranode::GroupView& g, const Fields& f,
                 const int32_t* index, const int32_t* counts,
                 const int32_t* pes, cudaStream_t stream);

// Waits for every other host's flag of this call: recv_counts `[Hn]` (the own
// host's is counts[own]); then every destination row h * T_max + j is the
// received record's field (zeros for j >= recv_counts[h]); advances the
// call's sequence; status `[]` = 1 when the group failed, else 0.
cudaError_t WaitAndUnpack(const intranode::GroupView& g, const Fields& f,
                          const int32_t* counts, const int32_t* pes,
                          int32_t* recv_counts, int32_t* status,
                          cudaStream_t stream);

cudaError_t PreloadKernels();

}  // namespace rail

}  // namespace jax_ep

#endif  // JAX_EP_FFI_KERNELS_EP_KERNELS_H_
