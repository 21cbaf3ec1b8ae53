"""Trace-time validation: every bad input raises ValueError/TypeError naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_test_base import host_value, local_rank_mask, rank_mesh


def _mesh(n):
  return rank_mesh(n)


def _group(**overrides):
  kwargs = dict(num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                dtype=jnp.float32, backend="reference")
  kwargs.update(overrides)
  return jax_ep.Group(_mesh(kwargs.pop("ranks", 2)), "ep", **kwargs)


def _trace(group, fn, *args):
  """Traces `fn` per shard (leading R axis) inside shard_map; returns nothing."""
  specs = P("ep")
  mapped = jax.shard_map(lambda *a: fn(*(b[0] for b in a)), mesh=group.mesh, in_specs=specs,
                         out_specs=P(), check_vma=False)
  structs = [jax.ShapeDtypeStruct((group.num_ranks, *a.shape), a.dtype,
                                  sharding=jax.NamedSharding(group.mesh, specs)) for a in args]
  jax.jit(mapped).trace(*structs)


def _inputs(t=16, h=128, k=2, x_dtype=jnp.float32, idx_dtype=jnp.int32, w_dtype=jnp.float32):
  return (jax.ShapeDtypeStruct((t, h), x_dtype), jax.ShapeDtypeStruct((t, k), idx_dtype),
          jax.ShapeDtypeStruct((t, k), w_dtype))


def _dispatch_only(group):
  def fn(x, idx, w):
    recv, _ = jax_ep.dispatch(group, x, idx, w)
    return recv.num_dropped
  return fn


class TestGroupValidation:

  def test_experts_not_divisible_by_ranks(self):
    with pytest.raises(ValueError, match=r"num_experts=6 must be divisible .* \(4 ranks\)"):
      _group(ranks=4, num_experts=6)

  def test_unknown_axis(self):
    with pytest.raises(ValueError, match="axis_name 'tp' is not an axis of the mesh"):
      jax_ep.Group(_mesh(2), "tp", num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=4)

  @pytest.mark.parametrize("field", ["num_experts", "num_topk", "hidden", "max_tokens_per_rank"])
  def test_non_positive(self, field):
    with pytest.raises(ValueError, match=f"{field} must be positive, got 0"):
      _group(**{field: 0})

  @pytest.mark.parametrize("kwargs,error,message", [
      (dict(num_sms=0), ValueError, "num_sms must be positive, got 0"),
      (dict(num_sms=1 << 28), ValueError, "num_sms must be <= 1024 .* got 268435456"),
      (dict(num_sms=2.5), TypeError, "num_sms must be an int, got 2.5"),
      (dict(timeout_s=0), ValueError, "timeout_s must be a positive number of seconds, got 0"),
      (dict(timeout_s=float("inf")), ValueError, "timeout_s must be a positive number .* inf"),
      (dict(config_timeout_s="soon"), TypeError,
       "config_timeout_s must be a number of seconds, got 'soon'")])
  def test_transport_options(self, kwargs, error, message):
    # Checked for every backend, not only where the peer transport reads them.
    with pytest.raises(error, match=message):
      _group(**kwargs)

  def test_non_integer(self):
    with pytest.raises(TypeError, match="hidden must be an int, got 1.5"):
      _group(hidden=1.5)

  def test_bad_dtype(self):
    with pytest.raises(TypeError, match="dtype must be one of bfloat16, float16, float32; got int32"):
      _group(dtype=jnp.int32)

  def test_bad_backend(self):
    with pytest.raises(ValueError, match="backend must be 'auto', 'reference' or 'cuda'; got 'tpu'"):
      _group(backend="tpu")

  @pytest.mark.parametrize("capacity", [-1, 0])
  def test_non_positive_capacity(self, capacity):
    # A zero-row buffer would drop every row; None is how to ask for the default.
    with pytest.raises(ValueError, match=rf"capacity must be positive, got {capacity} \(leave "
                                         r"it None for the worst case, .* = 64 rows"):
      _group(capacity=capacity)

  def test_default_capacity_is_exact_worst_case(self):
    assert _group(ranks=4, num_experts=8, num_topk=8).capacity == 4 * 16 * 2  # min(K, L) = 2
    assert _group(ranks=2, num_experts=256, num_topk=8).capacity == 2 * 16 * 8

  def test_memory_bytes(self):
    group = _group(ranks=2, num_experts=8, num_topk=2, hidden=128)
    est = group.memory_bytes()
    assert est.recv_x_bytes == group.capacity * 128 * 4
    assert est.low_latency_recv_bytes == 4 * 2 * 16 * 128 * 4
    assert est.total_bytes >= est.recv_x_bytes + est.low_latency_recv_bytes
    fp8 = group.memory_bytes(row_format=jax_ep.RowFormat.FP8)
    assert fp8.low_latency_recv_bytes == 4 * 2 * 16 * (128 + 4)
    # UE8M0: one exponent byte per 128 channels, four to an int32.
    ue8m0 = jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=512,
                                max_tokens_per_rank=16, row_format=jax_ep.RowFormat.FP8_UE8M0)
    assert ue8m0.low_latency_recv_bytes == 4 * 2 * 16 * (512 + 4)
    standalone = jax_ep.memory_bytes(num_ranks=8, num_experts=256, num_topk=8, hidden=7168,
                                     max_tokens_per_rank=4096)
    assert standalone.recv_x_bytes == 8 * 4096 * 8 * 7168 * 2

  def test_low_latency_buffer_bytes(self):
    """Sizing the cuda group's low-latency buffers before anything is allocated (host
    arithmetic of the extension): two sets of `L * R * T_max` rows plus their meta and the
    `[T_max, K]` combine rows, 256-byte aligned regions, counts, the packed rows' starts and
    flags."""
    from jax_ep._native import ffi as _ffi
    if _ffi.extension() is None:
      pytest.skip("needs the built extension (host arithmetic only)")
    r, e, k, h, t = 8, 256, 8, 7168, 128
    est = jax_ep.memory_bytes(num_ranks=r, num_experts=e, num_topk=k, hidden=h,
                              max_tokens_per_rank=t, backend="cuda", low_latency=True)
    plain = jax_ep.memory_bytes(num_ranks=r, num_experts=e, num_topk=k, hidden=h,
                                max_tokens_per_rank=t, backend="cuda")
    align = lambda n: -(-n // 256) * 256
    num_local, row = e // r, h * 2
    per_set = align(num_local * r * t * row) + align(num_local * r * t * 4) + align(t * k * row)
    starts = align(num_local * (r + 1) * 4)  # where each source's rows start, per expert
    want = 2 * per_set + align(e * 4) + starts + align((2 * num_local * r + 2 * r) * 8)
    assert est.low_latency_buffer_bytes == want
    assert est.comm_buffer_bytes == plain.comm_buffer_bytes + want
    assert plain.low_latency_buffer_bytes == 0
    one = jax_ep.memory_bytes(num_ranks=1, num_experts=e, num_topk=k, hidden=h,
                              max_tokens_per_rank=t, backend="cuda", low_latency=True)
    assert one.low_latency_buffer_bytes == one.comm_buffer_bytes > 0

  def test_combine_partials_are_fp32_off_the_peer_transport(self):
    # The reference backend never rounds a partial; only the cuda peer transport sends bf16
    # partials for bf16 activations (tests/test_cuda_peer.py checks that case on a GPU).
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
      assert _group(dtype=dtype).combine_partial_dtype == np.float32

  def test_no_receiving_while_sending_off_the_peer_transport(self):
    # Only the cuda peer transport can place rows as they land (test_cuda_peer.py checks when).
    assert _group().receives_while_sending is False

  def test_context_manager_closes(self):
    with _group() as group:
      assert not group.closed
    assert group.closed
    with pytest.raises(ValueError, match="the group was closed"):
      _trace(group, _dispatch_only(group), *_inputs())

  def test_cuda_backend_needs_gpus(self):
    if all(d.platform == "gpu" for d in jax.devices()):
      pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match="backend='cuda' cannot run this group: the mesh has cpu "
                                         "devices, the cuda kernels need CUDA GPUs"):
      _group(ranks=1, backend="cuda")

  def test_more_experts_per_token_than_experts(self):
    with pytest.raises(ValueError, match=r"num_topk=9 must be <= num_experts=8"):
      _group(num_topk=9)


class TestOpValidation:

  def test_outside_shard_map(self):
    group = _group()
    x = jnp.zeros((16, 128)); idx = jnp.zeros((16, 2), jnp.int32); w = jnp.zeros((16, 2))
    with pytest.raises(ValueError, match="must be called inside jax.shard_map over the group's mesh axis 'ep'"):
      jax_ep.dispatch(group, x, idx, w)

  def test_wrong_axis_size(self):
    group = _group(ranks=2)
    other = jax_ep.Group(_mesh(4), "ep", num_experts=8, num_topk=2, hidden=128,
                         max_tokens_per_rank=16, dtype=jnp.float32, backend="reference")
    with pytest.raises(ValueError, match="axis 'ep' has size 4 here but the group was created with 2"):
      _trace(other, _dispatch_only(group), *_inputs())

  @pytest.mark.parametrize("kwargs,exc,message", [
      (dict(x_dtype=jnp.bfloat16), TypeError, "x must have dtype float32, got bfloat16"),
      (dict(idx_dtype=jnp.int64), TypeError, "topk_idx must have dtype int32"),
      (dict(idx_dtype=jnp.float32), TypeError, "topk_idx must have dtype int32, got float32"),
      (dict(w_dtype=jnp.int32), TypeError, "topk_weights must have dtype float32 or bfloat16 or float16, got int32"),
      (dict(h=256), ValueError, r"x has hidden size 256 \(shape \(16, 256\)\) but the group has hidden=128"),
      (dict(t=17), ValueError, r"x has 17 tokens .* max_tokens_per_rank=16"),
      (dict(k=3), ValueError, r"topk_idx must have shape \[T, K\] = \(16, 2\)"),
  ])
  def test_dispatch_arguments(self, kwargs, exc, message):
    if kwargs.get("idx_dtype") == jnp.int64 and not jax.config.jax_enable_x64:
      pytest.skip("int64 arrays need jax_enable_x64")
    group = _group()
    with pytest.raises(exc, match=message):
      _trace(group, _dispatch_only(group), *_inputs(**kwargs))

  def test_wrong_rank_of_x(self):
    group = _group()
    args = (jax.ShapeDtypeStruct((16, 128, 1), jnp.float32),) + _inputs()[1:]
    with pytest.raises(ValueError, match=r"x must have 2 dimensions \[T, H\], got shape \(16, 128, 1\)"):
      _trace(group, _dispatch_only(group), *args)

  def test_weights_shape_mismatch(self):
    group = _group()
    args = _inputs()[:2] + (jax.ShapeDtypeStruct((16, 3), jnp.float32),)
    with pytest.raises(ValueError, match=r"topk_weights shape \(16, 3\) must equal topk_idx shape \(16, 2\)"):
      _trace(group, _dispatch_only(group), *args)

  def test_combine_expert_out_shape(self):
    group = _group()

    def fn(x, idx, w):
      _, handle = jax_ep.dispatch(group, x, idx, w)
      return jax_ep.combine(group, jnp.zeros((group.capacity - 1, 128)), handle).sum()
    with pytest.raises(ValueError, match=r"expert_out must have shape \[capacity, H\] = \(64, 128\), got \(63, 128\)"):
      _trace(group, fn, *_inputs())

  def test_combine_expert_out_dtype(self):
    group = _group()

    def fn(x, idx, w):
      _, handle = jax_ep.dispatch(group, x, idx, w)
      return jax_ep.combine(group, jnp.zeros((group.capacity, 128), jnp.bfloat16), handle).sum()
    with pytest.raises(TypeError, match="expert_out must have dtype float32, got bfloat16"):
      _trace(group, fn, *_inputs())

  def test_combine_needs_handle(self):
    group = _group()

    def fn(x, idx, w):
      return jax_ep.combine(group, jnp.zeros((group.capacity, 128)), (idx, w)).sum()
    with pytest.raises(TypeError, match="handle must be the Handle returned by jax_ep.dispatch"):
      _trace(group, fn, *_inputs())

  def test_fp8_needs_hidden_multiple_of_128(self):
    group = _group(hidden=64)

    def fn(x, idx, w):
      return jax_ep.low_latency_dispatch(group, x, idx,
                                         row_format=jax_ep.RowFormat.FP8)[0].count.sum()
    with pytest.raises(ValueError, match="row_format=RowFormat.FP8 needs hidden to be a multiple "
                                         "of 128.*hidden=64"):
      _trace(group, fn, *_inputs(h=64))

  def test_low_latency_combine_shapes(self):
    group = _group()

    def fn(x, idx, w):
      _, handle = jax_ep.low_latency_dispatch(group, x, idx)
      return jax_ep.low_latency_combine(group, jnp.zeros((4, 31, 128)), handle, w).sum()
    with pytest.raises(ValueError, match=r"expert_out must have shape \[L, R\*T_max, H\] = \(4, 32, 128\), got \(4, 31, 128\)"):
      _trace(group, lambda x, idx, w: fn(x, idx, w), *_inputs())

  def test_out_of_range_ids_are_counted_not_read(self):
    # Run time, not trace time: ids past E or below -1 select nothing and are counted.
    group = _group(ranks=2)
    idx = np.array([[[0, 8], [-2, 1000]], [[7, -1], [3, -7]]], np.int32)
    x = np.ones((2, 2, 128), np.float32)
    w = np.ones((2, 2, 2), np.float32)

    def fn(x, idx, w):
      recv, handle = jax_ep.dispatch(group, x[0], idx[0], w[0])
      out = jax_ep.combine(group, recv.x, handle)
      return recv.num_invalid[None], recv.group_sizes[None], out[None]
    sh = jax.NamedSharding(group.mesh, P("ep"))
    mapped = jax.shard_map(fn, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))
    invalid, sizes, out = (host_value(v) for v in jax.jit(mapped)(
        *(jax.device_put(a, sh) for a in (x, idx, w))))
    mine = local_rank_mask(group.mesh)
    np.testing.assert_array_equal(invalid[mine], np.array([3, 1])[mine])
    # Ids 0 and 3 select experts of rank 0 (experts 0..3), id 7 one of rank 1.
    np.testing.assert_array_equal(sizes.sum(axis=1)[mine], np.array([2, 1])[mine])
    np.testing.assert_array_equal(out[:, :, 0][mine], np.array([[1, 0], [1, 1]])[mine])


def test_settling_effect_tokens_waits_on_each_and_forgets_failures(monkeypatch, caplog):
  """After a failed jax_ep check (already raised to the caller), closing the group or exiting
  settles JAX's runtime effect tokens: it waits on every one, logs the failed one and forgets
  them, so interpreter exit does not take JAX's crash path (on a GPU job that aborted every
  process). A GPU failure keeps such a token; the CPU runtime keeps none, so these are fakes."""
  from jax._src import dispatch
  from jax_ep._native import effects as _effects

  class Token:
    def __init__(self, fails):
      self.fails, self.waited = fails, False

    def block_until_ready(self):
      self.waited = True
      if self.fails:
        raise RuntimeError("jax_ep.dispatch: rank 0 timed out waiting for rank 1")

  tokens = dispatch.RuntimeTokenSet()
  monkeypatch.setattr(dispatch, "runtime_tokens", tokens)
  failed, good = Token(True), Token(False)
  tokens.output_runtime_tokens.update({"device 0": failed, "device 1": good})
  with caplog.at_level("WARNING", logger="jax_ep"):
    _effects.settle()
  assert failed.waited and good.waited
  assert tokens.output_runtime_tokens == {}
  assert "rank 0 timed out waiting for rank 1" in caplog.text
  jax.effects_barrier()  # nothing left to re-raise


def test_group_on_a_process_without_its_devices_is_refused(monkeypatch):
  """Groups over some of a job's processes are created by those processes alone; another
  process creating one gets an error naming who holds the devices (CPU: pretend to be process 1
  of a job whose devices are all process 0's)."""
  if jax.process_count() > 1:
    pytest.skip("pretends to be another process of a single-process run")
  mesh = _mesh(2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with pytest.raises(ValueError, match=r"process 1 holds none of the mesh's devices .*"
                                       r"processes \[0\]"):
    jax_ep.Group(mesh, "ep", num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                 backend="reference")


def _merged_slots_oracle(idx, w, num_experts):
  """Token by token: the first slot naming an expert keeps it with the sum of the weights of
  every slot naming it; later ones become -1 with weight 0; ids outside [0, E) stay as given."""
  out_idx, out_w = idx.copy(), np.zeros_like(w)
  for t in range(idx.shape[0]):
    seen = {}
    for k, e in enumerate(idx[t]):
      if not 0 <= e < num_experts:
        out_w[t, k] = w[t, k]
      elif e in seen:
        out_idx[t, k] = -1
        out_w[t, seen[e]] += w[t, k]
      else:
        seen[e] = k
        out_w[t, k] = w[t, k]
  return out_idx, out_w


@pytest.mark.parametrize("num_topk", [1, 4, 8])
def test_merge_duplicate_slots_matches_a_token_by_token_oracle(num_topk):
  from jax_ep.ops import merge_duplicate_slots
  rng = np.random.default_rng(num_topk)
  num_experts = 6  # few experts: most tokens name one several times
  idx = rng.integers(-3, num_experts + 2, size=(64, num_topk)).astype(np.int32)
  w = rng.random((64, num_topk)).astype(np.float32)
  got_idx, got_w = jax.jit(merge_duplicate_slots, static_argnums=2)(idx, w, num_experts)
  want_idx, want_w = _merged_slots_oracle(idx, w, num_experts)
  np.testing.assert_array_equal(got_idx, want_idx)
  np.testing.assert_allclose(got_w, want_w, rtol=1e-6)
  # The gradient of a merged weight reaches every slot it summed.
  cot = rng.random((64, num_topk)).astype(np.float32)
  grad = jax.grad(lambda w: jnp.sum(merge_duplicate_slots(idx, w, num_experts)[1] * cot))(w)
  want = np.zeros_like(w)
  for t in range(64):
    first = {}
    for k, e in enumerate(idx[t]):
      valid = 0 <= e < num_experts
      if valid and e not in first:
        first[e] = k
      want[t, k] = cot[t, first[e]] if valid else cot[t, k]
  np.testing.assert_allclose(grad, want, rtol=1e-6)
