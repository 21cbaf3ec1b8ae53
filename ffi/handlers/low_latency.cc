// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapters of the low-latency pair (kernels: ffi/kernels/low_latency_*.cu),
// two custom calls per op so that XLA can run independent work between the
// send and the wait. Per rank, no batch dims (L local experts, S = R * T_max
// rows per expert slab):
//
// jax_ep_low_latency_dispatch_send
//   x `[T, H]` group dtype, topk_idx `[T, K]` int32, slot_scale `[T, K]` f32
//   (read only when `weighted`; plain rows only) ->
//   num_invalid `[]` int32 (the wait takes it: it orders the wait after the
//   send). attrs: group, format (0 plain, 1 fp8, 2 fp8 with power-of-two
//   scales), weighted.
// jax_ep_low_latency_dispatch_wait
//   sent `[]` int32 -> recv_x `[L, S, H]` (group dtype, or f8e4m3fn), scales
//   (`[L, S, H/128]` f32, `[L, S, H/512]` s32 with ue8m0, any one-element
//   array for plain rows), count `[L]` int32, recv_src `[L, S]` int32,
//   status `[]` int32. attrs: group, format, ue8m0.
// jax_ep_low_latency_combine_send
//   expert_out `[L, S, H]`, recv_src `[L, S]`, count `[L]` -> sent `[]` int32
//   (zero). attrs: group.
// jax_ep_low_latency_combine_wait
//   sent `[]`, topk_idx `[T, K]` int32, weights `[T, K]` f32 -> out `[T, H]`
//   (or `[T, K, H]` with gather), status `[]`. attrs: group, num_experts,
//   gather.
// Every op also takes `group`: the group's id and the configuration the
// program was built for (group_common.h, GroupRef).
// jax_ep_low_latency_dispatch / jax_ep_low_latency_combine: the pair fused in
// one custom call (the operands of the send, the results of both). At one
// rank the fused ops use no transport: the dispatch writes its results
// straight from x, the combine reduces straight from expert_out
// (low_latency::DispatchLocal / CombineLocal).

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/group_common.h"
#include "ffi/handlers/handlers.h"
#include "ffi/kernels/low_latency_kernels.h"
#include "ffi/kernels/network.h"
#include "ffi/runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using group_ffi::CheckShape;
using low_latency::RowFormat;

constexpr char kDispatchSend[] = "jax_ep_low_latency_dispatch_send";
constexpr char kDispatchWait[] = "jax_ep_low_latency_dispatch_wait";
constexpr char kCombineSend[] = "jax_ep_low_latency_combine_send";
constexpr char kCombineWait[] = "jax_ep_low_latency_combine_wait";

// Handler invocations, and those made while XLA recorded a command buffer
// (stream capture): a replay of the recorded graph runs the kernels without
// calling the handler, which is how a test tells that a decode step really
// replays (LowLatencyHandlerCalls).
std::atomic<int64_t> handler_calls{0};
std::atomic<int64_t> captured_calls{0};

void CountCall(cudaStream_t stream) {
  handler_calls.fetch_add(1, std::memory_order_relaxed);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status == cudaStreamCaptureStatusActive) {
    captured_calls.fetch_add(1, std::memory_order_relaxed);
  }
}

// The group, which must have been created with the low-latency buffers.
ffi::Error GetLowLatencyGroup(
    const char* op, const group_ffi::GroupRef& ref,
    std::shared_ptr<const runtime::Group>* group) {
  JAX_EP_FFI_RETURN_IF_ERROR(
      group_ffi::GetGroup(op, ref, group, /*network_ok=*/true));
  if (!(*group)->config.low_latency) {
    return ffi_utils::InvalidArgument(
        op, "native group " + std::to_string(ref.id) +
                " has no low-latency buffers (create the jax_ep.Group with "
                "low_latency=True)");
  }
  return ffi::Error::Success();
}

// A network group: the send kernel staged the rows for ranks on other hosts;
// the network transport puts them, then their flags (same stream, after it).
ffi::Error SendOverNetwork(const char* op, const runtime::Group& g,
                           int32_t ll_op, const int32_t* recv_src,
                           const int32_t* count, cudaStream_t stream) {
  if (g.network_send == nullptr) return ffi::Error::Success();
  const network::Send send{ll_op, g.view, recv_src, count, nullptr, 0};
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      op, static_cast<cudaError_t>(g.network_send(&send, stream)));
  return ffi::Error::Success();
}

ffi::Error CheckFormat(const char* op, int32_t format,
                       const runtime::Group& g) {
  if (format < 0 || format > 2) {
    return ffi_utils::InvalidArgument(
        op, "attribute format is " + std::to_string(format) +
                ", expected 0 (plain), 1 (fp8) or 2 (fp8, power-of-two "
                "scales)");
  }
  if (format != 0 && g.config.hidden % 128 != 0) {
    return ffi_utils::InvalidArgument(
        op, "fp8 rows need hidden to be a multiple of 128, got hidden = " +
                std::to_string(g.config.hidden));
  }
  return ffi::Error::Success();
}

ffi::Error CheckTopk(const char* op, ffi_utils::Dims dims,
                     const runtime::Group& g, int64_t* num_tokens) {
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(op, "topk_idx", dims, {-1, g.config.num_topk}, "[T, K]"));
  *num_tokens = dims[0];
  return group_ffi::CheckTokens(op, "topk_idx", *num_tokens, g);
}

// The send's operands and attributes against the group; the group, T and the
// element type out.
ffi::Error CheckDispatchSend(
    ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
    ffi::Buffer<ffi::F32> slot_scale, const group_ffi::GroupRef& ref,
    int32_t format,
    bool weighted, std::shared_ptr<const runtime::Group>* group,
    int64_t* num_tokens, ElementType* dtype) {
  JAX_EP_FFI_RETURN_IF_ERROR(
      GetLowLatencyGroup(kDispatchSend, ref, group));
  const runtime::Group& g = **group;
  JAX_EP_FFI_RETURN_IF_ERROR(CheckFormat(kDispatchSend, format, g));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckTopk(kDispatchSend, topk_idx.dimensions(), g, num_tokens));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kDispatchSend, "x", x.dimensions(),
                                        {*num_tokens, g.config.hidden},
                                        "[T, H]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kDispatchSend, "slot_scale", slot_scale.dimensions(),
                 {*num_tokens, g.config.num_topk}, "[T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupDtype(
      kDispatchSend, "x", x.element_type(), g, dtype));
  if (weighted && format != 0) {
    return ffi_utils::InvalidArgument(
        kDispatchSend,
        "weighted=True takes plain rows (format 0), got format " +
            std::to_string(format));
  }
  return ffi_utils::CheckAligned(kDispatchSend, "x", x.untyped_data());
}

ffi::Error DispatchSendImpl(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> topk_idx,
                            ffi::Buffer<ffi::F32> slot_scale,
                            ffi::ResultBuffer<ffi::S32> num_invalid,
                            group_ffi::GroupRef ref,
                            int32_t format, bool weighted) {
  CountCall(stream);
  std::shared_ptr<const runtime::Group> group;
  int64_t num_tokens = 0;
  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(CheckDispatchSend(
      x, topk_idx, slot_scale, ref, format, weighted,
      &group, &num_tokens, &dtype));
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kDispatchSend,
      low_latency::DispatchSend(
          group->view, dtype, static_cast<RowFormat>(format), x.untyped_data(),
          topk_idx.typed_data(), weighted ? slot_scale.typed_data() : nullptr,
          num_tokens, num_invalid->typed_data(), stream));
  return SendOverNetwork(kDispatchSend, *group, group::kLowLatencyDispatch,
                         nullptr, nullptr, stream);
}

// The wait's results against the group; `local` (one rank, the fused op)
// writes them at once from the send's operands instead of waiting.
struct LocalDispatch {
  const void* x;
  const int32_t* topk_idx;
  const float* slot_scale;
  int64_t num_tokens;
  int32_t* num_invalid;
};

ffi::Error DispatchWaitCore(cudaStream_t stream,
                            ffi::Result<ffi::AnyBuffer> recv_x,
                            ffi::Result<ffi::AnyBuffer> scales,
                            ffi::ResultBuffer<ffi::S32> count,
                            ffi::ResultBuffer<ffi::S32> recv_src,
                            ffi::ResultBuffer<ffi::S32> status,
                            const group_ffi::GroupRef& ref,
                            int32_t format, bool ue8m0,
                            const LocalDispatch* local = nullptr) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(GetLowLatencyGroup(kDispatchWait, ref, &group));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckFormat(kDispatchWait, format, *group));
  const runtime::GroupConfig& c = group->config;
  const int64_t num_local = c.num_experts / c.num_ranks;
  const int64_t slab = c.num_ranks * c.max_tokens;
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kDispatchWait, "recv_x", recv_x->dimensions(),
                 {num_local, slab, c.hidden}, "[L, R*T_max, H]"));
  ElementType dtype = ElementType::kBF16;
  if (format == 0) {
    JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupDtype(
        kDispatchWait, "recv_x", recv_x->element_type(), *group, &dtype));
  } else {
    if (recv_x->element_type() != ffi::DataType::F8E4M3FN) {
      return ffi_utils::InvalidArgument(
          kDispatchWait, "recv_x of fp8 rows must be float8_e4m3fn");
    }
    dtype = c.itemsize == 4 ? ElementType::kF32 : ElementType::kBF16;
    if (ue8m0 && (format != 2 || c.hidden % 512 != 0)) {
      return ffi_utils::InvalidArgument(
          kDispatchWait,
          "ue8m0 needs format 2 (power-of-two scales) and hidden a multiple "
          "of 512, got format " +
              std::to_string(format) + ", hidden " + std::to_string(c.hidden));
    }
    const int64_t per_row = ue8m0 ? c.hidden / 512 : c.hidden / 128;
    JAX_EP_FFI_RETURN_IF_ERROR(
        CheckShape(kDispatchWait, "scales", scales->dimensions(),
                   {num_local, slab, per_row},
                   ue8m0 ? "[L, R*T_max, H/512]" : "[L, R*T_max, H/128]"));
    const ffi::DataType want = ue8m0 ? ffi::DataType::S32 : ffi::DataType::F32;
    if (scales->element_type() != want) {
      return ffi_utils::InvalidArgument(
          kDispatchWait, ue8m0 ? "scales must be int32 (packed UE8M0)"
                               : "scales must be float32");
    }
  }
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(
      kDispatchWait, "count", count->dimensions(), {num_local}, "[L]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kDispatchWait, "recv_src",
                                        recv_src->dimensions(),
                                        {num_local, slab}, "[L, R*T_max]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kDispatchWait, "recv_x", recv_x->untyped_data()));
  if (local != nullptr) {
    JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
        kDispatchWait, low_latency::DispatchLocal(
                           group->view, dtype, static_cast<RowFormat>(format),
                           ue8m0, local->x, local->topk_idx, local->slot_scale,
                           local->num_tokens, recv_x->untyped_data(),
                           format == 0 ? nullptr : scales->untyped_data(),
                           count->typed_data(), recv_src->typed_data(),
                           local->num_invalid, status->typed_data(), stream));
    return ffi::Error::Success();
  }
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kDispatchWait,
      low_latency::DispatchWait(
          group->view, dtype, static_cast<RowFormat>(format), ue8m0,
          recv_x->untyped_data(),
          format == 0 ? nullptr : scales->untyped_data(), count->typed_data(),
          recv_src->typed_data(), status->typed_data(), stream));
  return ffi::Error::Success();
}

// `sent` orders the wait after its send (XLA sees the data dependence).
ffi::Error DispatchWaitImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> sent,
                            ffi::Result<ffi::AnyBuffer> recv_x,
                            ffi::Result<ffi::AnyBuffer> scales,
                            ffi::ResultBuffer<ffi::S32> count,
                            ffi::ResultBuffer<ffi::S32> recv_src,
                            ffi::ResultBuffer<ffi::S32> status,
                            group_ffi::GroupRef ref,
                            int32_t format, bool ue8m0) {
  CountCall(stream);
  (void)sent;
  return DispatchWaitCore(stream, recv_x, scales, count, recv_src, status,
                          ref, format, ue8m0);
}

// The combine send's operands against the group; the element type out.
ffi::Error CheckCombineSend(ffi::AnyBuffer expert_out,
                            ffi::Buffer<ffi::S32> recv_src,
                            ffi::Buffer<ffi::S32> count,
                            const runtime::Group& g,
                            ElementType* dtype = nullptr) {
  const runtime::GroupConfig& c = g.config;
  const int64_t num_local = c.num_experts / c.num_ranks;
  const int64_t slab = c.num_ranks * c.max_tokens;
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckShape(kCombineSend, "expert_out", expert_out.dimensions(),
                 {num_local, slab, c.hidden}, "[L, R*T_max, H]"));
  ElementType type;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupDtype(
      kCombineSend, "expert_out", expert_out.element_type(), g, &type));
  if (dtype != nullptr) *dtype = type;
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kCombineSend, "recv_src",
                                        recv_src.dimensions(),
                                        {num_local, slab}, "[L, R*T_max]"));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(
      kCombineSend, "count", count.dimensions(), {num_local}, "[L]"));
  return ffi_utils::CheckAligned(kCombineSend, "expert_out",
                                 expert_out.untyped_data());
}

ffi::Error CombineSendImpl(cudaStream_t stream, ffi::AnyBuffer expert_out,
                           ffi::Buffer<ffi::S32> recv_src,
                           ffi::Buffer<ffi::S32> count,
                           ffi::ResultBuffer<ffi::S32> sent,
                           group_ffi::GroupRef ref) {
  CountCall(stream);
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(GetLowLatencyGroup(
      kCombineSend, ref, &group));
  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckCombineSend(expert_out, recv_src, count, *group, &dtype));
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kCombineSend,
      cudaMemsetAsync(sent->typed_data(), 0, sizeof(int32_t), stream));
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kCombineSend, low_latency::CombineSend(
                        group->view, dtype, expert_out.untyped_data(),
                        recv_src.typed_data(), count.typed_data(), stream));
  return SendOverNetwork(kCombineSend, *group, group::kLowLatencyCombine,
                         recv_src.typed_data(), count.typed_data(), stream);
}

// `local_expert_out` (one rank, the fused op): reduce straight from the
// expert outputs instead of waiting for the rows.
ffi::Error CombineWaitCore(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                           ffi::Buffer<ffi::F32> weights,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::ResultBuffer<ffi::S32> status,
                           const group_ffi::GroupRef& ref,
                           int64_t num_experts, bool gather,
                           const void* local_expert_out = nullptr) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(GetLowLatencyGroup(kCombineWait, ref, &group));
  const runtime::GroupConfig& c = group->config;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckAttrEquals(
      kCombineWait, "num_experts", num_experts, "num_experts", c.num_experts));
  int64_t num_tokens = 0;
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckTopk(kCombineWait, topk_idx.dimensions(), *group, &num_tokens));
  JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kCombineWait, "weights",
                                        weights.dimensions(),
                                        {num_tokens, c.num_topk}, "[T, K]"));
  if (gather) {
    JAX_EP_FFI_RETURN_IF_ERROR(
        CheckShape(kCombineWait, "out", out->dimensions(),
                   {num_tokens, c.num_topk, c.hidden}, "[T, K, H]"));
  } else {
    JAX_EP_FFI_RETURN_IF_ERROR(CheckShape(kCombineWait, "out",
                                          out->dimensions(),
                                          {num_tokens, c.hidden}, "[T, H]"));
  }
  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(group_ffi::CheckGroupDtype(
      kCombineWait, "out", out->element_type(), *group, &dtype));
  JAX_EP_FFI_RETURN_IF_ERROR(
      ffi_utils::CheckAligned(kCombineWait, "out", out->untyped_data()));
  if (local_expert_out != nullptr) {
    JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
        kCombineWait,
        low_latency::CombineLocal(
            group->view, dtype, local_expert_out, topk_idx.typed_data(),
            weights.typed_data(), num_tokens, num_experts, gather,
            out->untyped_data(), status->typed_data(), stream));
    return ffi::Error::Success();
  }
  JAX_EP_FFI_RETURN_IF_CUDA_ERROR(
      kCombineWait, low_latency::CombineWait(
                        group->view, dtype, topk_idx.typed_data(),
                        weights.typed_data(), num_tokens, num_experts, gather,
                        out->untyped_data(), status->typed_data(), stream));
  return ffi::Error::Success();
}

ffi::Error CombineWaitImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> sent,
                           ffi::Buffer<ffi::S32> topk_idx,
                           ffi::Buffer<ffi::F32> weights,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::ResultBuffer<ffi::S32> status,
                           group_ffi::GroupRef ref,
                           int64_t num_experts, bool gather) {
  CountCall(stream);
  (void)sent;
  return CombineWaitCore(stream, topk_idx, weights, out, status,
                         ref, num_experts, gather);
}

// The fused ops (send then wait in one custom call): what a program that has
// nothing to overlap uses, and the unit a vmap loops over (a vmap of the split
// calls would issue every send before any wait).
ffi::Error DispatchImpl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
    ffi::Buffer<ffi::F32> slot_scale, ffi::ResultBuffer<ffi::S32> num_invalid,
    ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> scales,
    ffi::ResultBuffer<ffi::S32> count, ffi::ResultBuffer<ffi::S32> recv_src,
    ffi::ResultBuffer<ffi::S32> status, group_ffi::GroupRef ref,
    int32_t format, bool weighted, bool ue8m0) {
  std::shared_ptr<const runtime::Group> group;
  int64_t num_tokens = 0;
  ElementType dtype;
  JAX_EP_FFI_RETURN_IF_ERROR(CheckDispatchSend(x, topk_idx, slot_scale, ref,
                                               format, weighted, &group,
                                               &num_tokens, &dtype));
  if (group->config.num_ranks == 1) {  // no transport: straight to the outputs
    CountCall(stream);
    const LocalDispatch local{x.untyped_data(), topk_idx.typed_data(),
                              weighted ? slot_scale.typed_data() : nullptr,
                              num_tokens, num_invalid->typed_data()};
    return DispatchWaitCore(stream, recv_x, scales, count, recv_src, status,
                            ref, format, ue8m0, &local);
  }
  JAX_EP_FFI_RETURN_IF_ERROR(DispatchSendImpl(
      stream, x, topk_idx, slot_scale, num_invalid, ref, format, weighted));
  return DispatchWaitCore(stream, recv_x, scales, count, recv_src, status, ref,
                          format, ue8m0);
}

ffi::Error CombineImpl(cudaStream_t stream, ffi::AnyBuffer expert_out,
                       ffi::Buffer<ffi::S32> recv_src,
                       ffi::Buffer<ffi::S32> count,
                       ffi::Buffer<ffi::S32> topk_idx,
                       ffi::Buffer<ffi::F32> weights,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::ResultBuffer<ffi::S32> status,
                       group_ffi::GroupRef ref,
                       int64_t num_experts, bool gather) {
  std::shared_ptr<const runtime::Group> group;
  JAX_EP_FFI_RETURN_IF_ERROR(GetLowLatencyGroup(kCombineSend, ref, &group));
  if (group->config.num_ranks == 1) {  // no transport: straight from expert_out
    CountCall(stream);
    JAX_EP_FFI_RETURN_IF_ERROR(
        CheckCombineSend(expert_out, recv_src, count, *group));
    return CombineWaitCore(stream, topk_idx, weights, out, status, ref,
                           num_experts, gather, expert_out.untyped_data());
  }
  JAX_EP_FFI_RETURN_IF_ERROR(
      CombineSendImpl(stream, expert_out, recv_src, count, status, ref));
  return CombineWaitCore(stream, topk_idx, weights, out, status, ref,
                         num_experts, gather);
}

}  // namespace

void LowLatencyHandlerCalls(int64_t* calls, int64_t* captured) {
  *calls = handler_calls.load();
  *captured = captured_calls.load();
}

}  // namespace jax_ep

// The operands and results each op of the pair binds, in the order its
// handler takes them; the fused ops bind their send's and their wait's.
#define JAX_EP_LL_DISPATCH_SEND_ARGS                                         \
  .Arg<xla::ffi::AnyBuffer>()                /* x */                         \
  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    /* topk_idx */                  \
  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    /* slot_scale */                \
  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()    /* num_invalid */
#define JAX_EP_LL_DISPATCH_WAIT_RETS                                         \
  .Ret<xla::ffi::AnyBuffer>()                /* recv_x */                    \
  .Ret<xla::ffi::AnyBuffer>()                /* scales */                    \
  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()    /* count */                     \
  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()    /* recv_src */                  \
  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()    /* status */
#define JAX_EP_LL_COMBINE_SEND_ARGS                                          \
  .Arg<xla::ffi::AnyBuffer>()                /* expert_out */                \
  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    /* recv_src */                  \
  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    /* count */
#define JAX_EP_LL_COMBINE_WAIT                                               \
  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    /* topk_idx */                  \
  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    /* weights */                   \
  .Ret<xla::ffi::AnyBuffer>()                /* out */                       \
  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()    /* status */                    \
  .Attr<jax_ep::group_ffi::GroupRef>("group")                                \
  .Attr<int64_t>("num_experts")                                              \
  .Attr<bool>("gather")

JAX_EP_FFI_DEFINE_HANDLER(
    JaxEpLowLatencyDispatch, jax_ep::DispatchImpl,
    JAX_EP_LL_DISPATCH_SEND_ARGS JAX_EP_LL_DISPATCH_WAIT_RETS
    .Attr<jax_ep::group_ffi::GroupRef>("group")
    .Attr<int32_t>("format")
    .Attr<bool>("weighted")
    .Attr<bool>("ue8m0"));

JAX_EP_FFI_DEFINE_HANDLER(
    JaxEpLowLatencyCombine, jax_ep::CombineImpl,
    JAX_EP_LL_COMBINE_SEND_ARGS JAX_EP_LL_COMBINE_WAIT);

JAX_EP_FFI_DEFINE_HANDLER(
    JaxEpLowLatencyDispatchSend, jax_ep::DispatchSendImpl,
    JAX_EP_LL_DISPATCH_SEND_ARGS
    .Attr<jax_ep::group_ffi::GroupRef>("group")
    .Attr<int32_t>("format")
    .Attr<bool>("weighted"));

JAX_EP_FFI_DEFINE_HANDLER(
    JaxEpLowLatencyDispatchWait, jax_ep::DispatchWaitImpl,
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // sent
    JAX_EP_LL_DISPATCH_WAIT_RETS
    .Attr<jax_ep::group_ffi::GroupRef>("group")
    .Attr<int32_t>("format")
    .Attr<bool>("ue8m0"));

JAX_EP_FFI_DEFINE_HANDLER(
    JaxEpLowLatencyCombineSend, jax_ep::CombineSendImpl,
    JAX_EP_LL_COMBINE_SEND_ARGS
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // sent
    .Attr<jax_ep::group_ffi::GroupRef>("group"));

JAX_EP_FFI_DEFINE_HANDLER(
    JaxEpLowLatencyCombineWait, jax_ep::CombineWaitImpl,
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // sent
    JAX_EP_LL_COMBINE_WAIT);
