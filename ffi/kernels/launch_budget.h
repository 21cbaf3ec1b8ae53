// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The SMs a launcher sizes its grids to: the device's, or fewer while an op
// runs beside XLA's kernels on jax_ep's own stream (ffi_utils::OnOwnStream
// sets it to the group's `num_sms` for the length of the handler's call).
//
// Host C++ only, framework-free (as ep_common.h): included by the kernels'
// launchers (kernel_utils.cuh's NumSms) and by the FFI adapters that set it.
//
// NOTES: a thread-local rather than one more argument of every launcher: XLA
// calls a handler on one host thread from start to end, the launchers it calls
// return before it does, and every grid of the op (the one-rank kernels, the
// peer transport's local roles and reduce kernels, the layout) reads it the
// same way, through NumSms. 0 (the default, and on XLA's streams): the whole
// GPU, as there nothing else runs beside the op.

#ifndef JAX_EP_FFI_KERNELS_LAUNCH_BUDGET_H_
#define JAX_EP_FFI_KERNELS_LAUNCH_BUDGET_H_

namespace jax_ep::launch {

// SMs' worth of blocks this thread's launches may size a grid to; 0: all.
inline thread_local int sm_budget = 0;

// Sets `sm_budget` to `sms` (0: all) until it goes out of scope.
class ScopedSmBudget {
 public:
  explicit ScopedSmBudget(int sms) : saved_(sm_budget) { sm_budget = sms; }
  ~ScopedSmBudget() { sm_budget = saved_; }
  ScopedSmBudget(const ScopedSmBudget&) = delete;
  ScopedSmBudget& operator=(const ScopedSmBudget&) = delete;

 private:
  int saved_;
};

}  // namespace jax_ep::launch

#endif  // JAX_EP_FFI_KERNELS_LAUNCH_BUDGET_H_
