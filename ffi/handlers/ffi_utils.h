// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// Helpers shared by the XLA FFI adapters in ffi/handlers/: error macros that
// turn a failed CUDA call into an `ffi::Error` (nothing is ever thrown across
// the FFI boundary), shape checks whose messages name the operand, its shape
// and what was expected, and the prologue of the local ops' handlers
// (CheckLeadingOperand; the group ops': group_common.h).
//
// Shape convention of every jax_ep op: operands and results may carry the
// same extra LEADING batch dims `B...` (added by `vmap` with
// `vmap_method="broadcast_all"`); their product is `num_batches` and the
// kernels run all batch elements in one launch.

#ifndef JAX_EP_FFI_HANDLERS_FFI_UTILS_H_
#define JAX_EP_FFI_HANDLERS_FFI_UTILS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ffi/kernels/ep_common.h"
#include "ffi/kernels/launch_budget.h"
#include "ffi/runtime/side_stream.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_utils {

namespace ffi = ::xla::ffi;

using Dims = ffi::Span<const int64_t>;

// Returns the ffi::Error of `expr` if it is a failure.
#define JAX_EP_FFI_RETURN_IF_ERROR(expr)        \
  do {                                          \
    ::xla::ffi::Error jax_ep_ffi_err_ = (expr); \
    if (jax_ep_ffi_err_.failure()) {            \
      return jax_ep_ffi_err_;                   \
    }                                           \
  } while (0)

// Wraps a kernel launcher (which returns cudaError_t and checks
// cudaGetLastError after each of its launches): a failure becomes an
// ffi::Error naming the op, the call and the CUDA error.
#define JAX_EP_FFI_RETURN_IF_CUDA_ERROR(op, expr)                           \
  do {                                                                      \
    const cudaError_t jax_ep_cuda_err_ = (expr);                            \
    if (jax_ep_cuda_err_ != cudaSuccess) {                                  \
      return ::jax_ep::ffi_utils::CudaError((op), #expr, jax_ep_cuda_err_); \
    }                                                                       \
  } while (0)

inline ffi::Error CudaError(std::string_view op, std::string_view call,
                            cudaError_t err) {
  std::string msg(op);
  msg += ": CUDA error in ";
  msg += call;
  msg += ": ";
  msg += cudaGetErrorName(err);
  msg += " (";
  msg += cudaGetErrorString(err);
  msg += ")";
  return ffi::Error(ffi::ErrorCode::kInternal, std::move(msg));
}

inline std::string ShapeString(Dims dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

inline ffi::Error InvalidArgument(std::string_view op, std::string msg) {
  std::string full(op);
  full += ": ";
  full += msg;
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::move(full));
}

// Operand `name` must have rank `num_batch_dims + trailing_rank`.
// `shape_doc` is the documented shape, e.g. "[B..., T, K]".
inline ffi::Error CheckRank(std::string_view op, std::string_view name,
                            Dims dims, size_t num_batch_dims,
                            size_t trailing_rank, std::string_view shape_doc) {
  if (dims.size() == num_batch_dims + trailing_rank) {
    return ffi::Error::Success();
  }
  return InvalidArgument(
      op, std::string(name) + " must have shape " + std::string(shape_doc) +
              " (rank " + std::to_string(num_batch_dims + trailing_rank) +
              " with " + std::to_string(num_batch_dims) +
              " leading batch dims), got shape " + ShapeString(dims));
}

// The first `num_batch_dims` dims of `dims` must equal those of `ref`.
inline ffi::Error CheckBatchDims(std::string_view op, std::string_view name,
                                 Dims dims, std::string_view ref_name, Dims ref,
                                 size_t num_batch_dims) {
  for (size_t i = 0; i < num_batch_dims; ++i) {
    if (dims[i] != ref[i]) {
      return InvalidArgument(
          op, "leading batch dims of " + std::string(name) + " " +
                  ShapeString(dims) + " must equal those of " +
                  std::string(ref_name) + " " + ShapeString(ref));
    }
  }
  return ffi::Error::Success();
}

// dims[axis] must equal `expected`, which is described by `what`.
inline ffi::Error CheckDim(std::string_view op, std::string_view name,
                           Dims dims, size_t axis, std::string_view dim_name,
                           int64_t expected, std::string_view what) {
  if (dims[axis] == expected) return ffi::Error::Success();
  return InvalidArgument(
      op, std::string(name) + " dim " + std::to_string(axis) + " (" +
              std::string(dim_name) + ") is " + std::to_string(dims[axis]) +
              " but must equal " + std::string(what) + " = " +
              std::to_string(expected) + "; " + std::string(name) + " shape " +
              ShapeString(dims));
}

// Per-slot operand `name`: shape `[B..., T, K]` with the batch dims of `ref`
// and the given T and K (`t_from` / `k_from` say where they come from).
inline ffi::Error CheckSlotsShape(std::string_view op, std::string_view name,
                                  Dims dims, std::string_view ref_name,
                                  Dims ref, size_t num_batch_dims,
                                  int64_t num_tokens, std::string_view t_from,
                                  int64_t num_topk, std::string_view k_from) {
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckRank(op, name, dims, num_batch_dims, 2, "[B..., T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(op, name, dims, ref_name, ref, num_batch_dims));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckDim(op, name, dims, num_batch_dims, "T", num_tokens, t_from));
  return CheckDim(op, name, dims, num_batch_dims + 1, "K", num_topk, k_from);
}

inline int64_t NumBatches(Dims dims, size_t num_batch_dims) {
  int64_t n = 1;
  for (size_t i = 0; i < num_batch_dims; ++i) n *= dims[i];
  return n;
}

inline ffi::Error CheckTopk(std::string_view op, std::string_view name,
                            int64_t num_tokens, int64_t num_topk) {
  if (num_topk < 1 || num_topk > kMaxTopk) {
    return InvalidArgument(
        op, std::string(name) + " last dim K (top-k) is " +
                std::to_string(num_topk) +
                ", expected 1 <= K <= " + std::to_string(kMaxTopk));
  }
  if (num_tokens * num_topk > kMaxSlots) {
    return InvalidArgument(
        op, std::string(name) + " has T * K = " + std::to_string(num_tokens) +
                " * " + std::to_string(num_topk) + " slots, expected at most " +
                std::to_string(kMaxSlots));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckNumExperts(std::string_view op, std::string_view what,
                                  int64_t num_experts) {
  if (num_experts >= 1 && num_experts <= kMaxExperts) {
    return ffi::Error::Success();
  }
  return InvalidArgument(
      op, std::string(what) + " (E) is " + std::to_string(num_experts) +
              ", expected 1 <= E <= " + std::to_string(kMaxExperts));
}

inline ffi::Error CheckCapacity(std::string_view op, int64_t capacity) {
  if (capacity >= 0) return ffi::Error::Success();
  return InvalidArgument(op, "capacity is " + std::to_string(capacity) +
                                 ", expected capacity >= 0");
}

inline ffi::Error CheckExpertAlignment(std::string_view op,
                                       int64_t expert_alignment) {
  if (expert_alignment >= 1 && expert_alignment <= kMaxExpertAlignment) {
    return ffi::Error::Success();
  }
  return InvalidArgument(op, "expert_alignment is " +
                                 std::to_string(expert_alignment) +
                                 ", expected 1 <= expert_alignment <= " +
                                 std::to_string(kMaxExpertAlignment));
}

inline ffi::Error CheckHidden(std::string_view op, std::string_view name,
                              int64_t hidden) {
  if (hidden % kHiddenMultiple == 0) return ffi::Error::Success();
  return InvalidArgument(
      op, std::string(name) + " hidden size H is " + std::to_string(hidden) +
              ", expected a multiple of " + std::to_string(kHiddenMultiple));
}

inline std::optional<ElementType> ToElementType(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::BF16:
      return ElementType::kBF16;
    case ffi::DataType::F16:
      return ElementType::kF16;
    case ffi::DataType::F32:
      return ElementType::kF32;
    default:
      return std::nullopt;
  }
}

// Activation dtype: bf16, f16 or f32.
inline ffi::Error CheckActivationDtype(std::string_view op,
                                       std::string_view name,
                                       ffi::DataType dtype,
                                       ElementType* element_type) {
  const std::optional<ElementType> t = ToElementType(dtype);
  if (!t.has_value()) {
    return InvalidArgument(op, std::string(name) + " has dtype code " +
                                   std::to_string(static_cast<int>(dtype)) +
                                   ", expected bfloat16, float16 or float32");
  }
  *element_type = *t;
  return ffi::Error::Success();
}

inline ffi::Error CheckSameDtype(std::string_view op, std::string_view name,
                                 ffi::DataType dtype, std::string_view ref_name,
                                 ffi::DataType ref) {
  if (dtype == ref) return ffi::Error::Success();
  return InvalidArgument(op, std::string(name) + " dtype (code " +
                                 std::to_string(static_cast<int>(dtype)) +
                                 ") must equal " + std::string(ref_name) +
                                 " dtype (code " +
                                 std::to_string(static_cast<int>(ref)) + ")");
}

// The operand a local op takes its sizes from, `[B..., N, H]` (N: T, or the
// capacity of expert_out): every other operand and result has its batch dims.
// Handlers unpack it with a structured binding, in this order.
struct LeadingOperand {
  Dims dims;                  // the operand's shape
  size_t num_batch_dims = 0;  // B...
  int64_t num_rows = 0;       // N
  int64_t hidden = 0;         // H, a multiple of kHiddenMultiple
  ElementType dtype = ElementType::kBF16;  // bf16, f16 or f32
};

// The prologue of every local op's handler: operand `name` must have shape
// `shape_doc` (rank >= 2), an activation dtype and H a multiple of
// kHiddenMultiple.
inline ffi::Error CheckLeadingOperand(std::string_view op,
                                      std::string_view name,
                                      std::string_view shape_doc,
                                      const ffi::AnyBuffer& operand,
                                      LeadingOperand* lead) {
  const Dims dims = operand.dimensions();
  if (dims.size() < 2) {
    return InvalidArgument(op, std::string(name) + " must have shape " +
                                   std::string(shape_doc) +
                                   " (rank >= 2), got shape " +
                                   ShapeString(dims));
  }
  lead->dims = dims;
  lead->num_batch_dims = dims.size() - 2;
  lead->num_rows = dims[lead->num_batch_dims];
  lead->hidden = dims[lead->num_batch_dims + 1];
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckActivationDtype(op, name, operand.element_type(), &lead->dtype));
  return CheckHidden(op, name, lead->hidden);
}

// The routing operand `name` of a local op, `[B..., T, K]` int32, beside the
// leading operand `lead_name` (whose batch dims it has): T (which must be
// `expected_tokens`, named `tokens_doc`, when that is >= 0; into *num_tokens
// when not null) and K (into *num_topk), within the kernels' limits.
inline ffi::Error CheckSlotRows(std::string_view op, std::string_view name,
                                Dims dims, std::string_view lead_name,
                                const LeadingOperand& lead,
                                int64_t expected_tokens,
                                std::string_view tokens_doc,
                                int64_t* num_tokens, int64_t* num_topk) {
  const size_t nb = lead.num_batch_dims;
  JAX_EP_FFI_RETURN_IF_ERROR(CheckRank(op, name, dims, nb, 2, "[B..., T, K]"));
  JAX_EP_FFI_RETURN_IF_ERROR(
      CheckBatchDims(op, name, dims, lead_name, lead.dims, nb));
  if (expected_tokens >= 0) {
    JAX_EP_FFI_RETURN_IF_ERROR(
        CheckDim(op, name, dims, nb, "T", expected_tokens, tokens_doc));
  }
  if (num_tokens != nullptr) *num_tokens = dims[nb];
  *num_topk = dims[nb + 1];
  return CheckTopk(op, name, dims[nb], *num_topk);
}

// Rows are moved as 16-byte vectors.
inline ffi::Error CheckAligned(std::string_view op, std::string_view name,
                               const void* ptr) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 == 0) return ffi::Error::Success();
  return InvalidArgument(op,
                         std::string(name) + " buffer is not 16-byte aligned");
}

// The start of every handler's binding: the CUDA stream XLA runs the op on.
inline auto BindOp() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>();
}

// Defines the handler symbol `symbol` of `impl`: the stream (BindOp), then
// `binding`, the operands, results and attributes in the order `impl` takes
// them (`.Arg<...>() .Ret<...>() .Attr<...>("name")`, one comment each).
// Every jax_ep handler is command-buffer compatible: no allocation, no sync,
// no host state per call (ffi/README.md).
#define JAX_EP_FFI_DEFINE_HANDLER(symbol, impl, binding)              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                         \
                                ::jax_ep::ffi_utils::BindOp() binding, \
                                {::xla::ffi::Traits::kCmdBufferCompatible})

// The error of a failed call `call` of runtime/side_stream.h.
inline ffi::Error OwnStreamError(std::string_view call, cudaError_t err) {
  if (err == cudaErrorNotReady) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_ep's own stream is not prepared on this device: "
                      "a jax_ep.Group(comm_stream='jax_ep') of the cuda "
                      "backend prepares it on its devices");
  }
  return CudaError("jax_ep own stream", call, err);
}

// `Impl` (an op's implementation, `ffi::Error(cudaStream_t, A...)`) run on
// jax_ep's own stream (runtime/side_stream.h) instead of XLA's: the own stream
// waits for XLA's work so far, runs the op, and marks its end for the
// `jax_ep_join` that makes XLA's stream wait for it. Its grids are sized to
// `sms` SMs (the group's num_sms; kernels/launch_budget.h): beside XLA's
// kernels, the GPU's other SMs are theirs.
template <typename Fn, Fn* kImpl>
struct OnOwnStream;

template <typename... A, ffi::Error (*kImpl)(cudaStream_t, A...)>
struct OnOwnStream<ffi::Error(cudaStream_t, A...), kImpl> {
  static ffi::Error Call(cudaStream_t xla_stream, A... args, int64_t key,
                         int64_t sms) {
    if (sms < 0 || sms > kMaxNumSms) {
      return InvalidArgument("jax_ep own stream",
                             "own_stream_sms is " + std::to_string(sms) +
                                 ", expected 0 <= own_stream_sms <= " +
                                 std::to_string(kMaxNumSms));
    }
    cudaStream_t own = nullptr;
    cudaError_t err = runtime::ForkOwnStream(xla_stream, &own);
    if (err != cudaSuccess) return OwnStreamError("ForkOwnStream", err);
    ffi::Error result = ffi::Error::Success();
    {
      launch::ScopedSmBudget budget(static_cast<int>(sms));
      result = kImpl(own, args...);
    }
    // Marked even when the op failed, so that its join waits for no more
    // than what was launched.
    err = runtime::FinishOnOwnStream(own, key);
    if (result.success() && err == cudaSuccess) return result;
    runtime::JoinAllOwnStream(xla_stream);  // side_stream.h: on an error
    if (result.failure()) return result;
    return OwnStreamError("FinishOnOwnStream", err);
  }
};

// JAX_EP_FFI_DEFINE_HANDLER of `symbol`, and `symbol##OwnStream`: the same op
// on jax_ep's own stream (target "<op>_own_stream"), with two more attributes,
// `own_stream_key` (int64; runtime/side_stream.h) and `own_stream_sms` (int64,
// the SMs its grids are sized to, 0: all). The latter is not command-buffer
// compatible (runtime/side_stream.h says why).
#define JAX_EP_FFI_DEFINE_HANDLER_WITH_OWN_STREAM(symbol, impl, binding) \
  JAX_EP_FFI_DEFINE_HANDLER(symbol, impl, binding);                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                         \
      symbol##OwnStream,                                                 \
      (::jax_ep::ffi_utils::OnOwnStream<decltype(impl), impl>::Call),    \
      ::jax_ep::ffi_utils::BindOp()                                      \
          binding.Attr<int64_t>("own_stream_key")                        \
          .Attr<int64_t>("own_stream_sms"))

}  // namespace jax_ep::ffi_utils

#endif  // JAX_EP_FFI_HANDLERS_FFI_UTILS_H_
