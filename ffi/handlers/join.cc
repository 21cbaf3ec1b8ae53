// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// FFI adapter of `jax_ep_join` (runtime/side_stream.h): XLA's stream waits
// for the latest op of `own_stream_key` on jax_ep's own stream.
//
//   operands  an op's results, then the operands it read (any number, any
//             type): results i alias operands i, so XLA reads the op's
//             results only after this call, and keeps every operand it was
//             given (the op's inputs too) alive until then
//   attrs     own_stream_key: int64, the op's
//   results   the op's results, unchanged (the same buffers; copied after the
//             wait where XLA gave a result a buffer of its own)

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/handlers/ffi_utils.h"
#include "ffi/handlers/handlers.h"
#include "ffi/runtime/side_stream.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;

ffi::Error Fail(cudaStream_t stream, ffi::Error error) {
  runtime::JoinAllOwnStream(stream);  // runtime/side_stream.h: on an error
  return error;
}

ffi::Error JoinImpl(cudaStream_t stream, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, int64_t key) {
  if (rets.size() > args.size()) {
    return Fail(stream, ffi_utils::InvalidArgument(
                            "jax_ep_join",
                            "takes the op's results (aliased to its own) "
                            "first"));
  }
  const cudaError_t err = runtime::JoinOwnStream(stream, key);
  if (err != cudaSuccess) {
    return Fail(stream, ffi_utils::OwnStreamError("JoinOwnStream", err));
  }
  // XLA gives each result its operand's buffer (the alias). Where it does not
  // (a fusion that writes the result elsewhere), the result is copied, after
  // the wait.
  for (size_t i = 0; i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) {
      return Fail(stream, ffi_utils::InvalidArgument(
                              "jax_ep_join", "operands and results must be "
                                             "arrays"));
    }
    void* dst = (*out)->untyped_data();
    const void* src = in->untyped_data();
    const size_t bytes = in->size_bytes();
    if (dst != src && bytes > 0) {
      const cudaError_t copy_err = cudaMemcpyAsync(
          dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
      if (copy_err != cudaSuccess) {
        return Fail(stream, ffi_utils::CudaError("jax_ep_join",
                                                 "cudaMemcpyAsync", copy_err));
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

// Not command-buffer compatible: it waits on an event recorded outside any
// capture (runtime/side_stream.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpJoin, jax_ep::JoinImpl,
                              ::jax_ep::ffi_utils::BindOp()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("own_stream_key"));
