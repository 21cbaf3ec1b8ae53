"""Shared test base: every suite is a base class (`EPTestBase` here, `LowLatencyTestBase` in
low_latency_test_base.py) given a `Target` (the backend or transport, its group arguments and
its capabilities).

Each test builds a group over `R` devices, runs the ops inside `shard_map` (the same way users
do), and compares with the dense oracle of `jax_ep.testing.oracle` (exact for dispatched rows,
counts and group sizes; fp32-accumulation tolerance for combine; `jax.grad` of a dense model for
gradients).
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep.layer import expert_mlp
from jax_ep.testing import oracle

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, pattern):
  """`[R, T, K]` int32 expert ids for a named routing pattern."""
  shape = (num_ranks, num_tokens, num_topk)
  if pattern in ("uniform", "hot", "unused_experts"):
    pool = num_experts if pattern != "unused_experts" else max(num_experts // 2, 1)
    scores = rng.random((num_ranks, num_tokens, num_experts))
    scores[..., pool:] = -1.0  # experts past `pool` never chosen
    idx = np.argsort(-scores, axis=-1)[..., :num_topk]
    if num_topk > pool:
      idx = np.where(np.arange(num_topk) < pool, idx, -1)
    if pattern == "hot":
      idx = np.where(idx == 0, idx[..., :1], idx)  # keep ids distinct after swapping in expert 0
      idx[..., 0] = 0
    return idx.astype(np.int32)
  if pattern == "all_masked":
    return np.full(shape, -1, np.int32)
  if pattern == "duplicates":  # the same expert in several slots of one token
    idx = rng.integers(0, num_experts, shape)
    idx[..., 1::2] = idx[..., :1]
    return idx.astype(np.int32)
  if pattern == "one_expert":  # every slot of every token on one expert: overflows capacity
    return np.full(shape, num_experts - 1, np.int32)
  if pattern == "fill_rank0":  # every token on experts 0..K-1: K distinct rows each, one rank
    return np.broadcast_to(np.arange(num_topk, dtype=np.int32), shape).copy()
  if pattern == "invalid":  # -1, in-range and out-of-range ids mixed
    return rng.integers(-3, num_experts + 3, shape).astype(np.int32)
  raise ValueError(pattern)


def count_primitive(jaxpr, name):
  """Equations of primitive `name` in `jaxpr` and every jaxpr nested in its parameters."""
  import jax.extend
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += count_primitive(sub, name)
  return count


# The GPU round sets JAX_EP_REQUIRE_GPU=1: there a missing GPU, extension, NVSHMEM module or
# Hopper chip is a broken set-up, and a test that would skip for it fails instead.
REQUIRE_GPU = os.environ.get("JAX_EP_REQUIRE_GPU") == "1"


def skip_unless_present(reason: str):
  """Skips the test for something this machine lacks (`reason` says what); fails it where
  JAX_EP_REQUIRE_GPU=1 says the machine must have it."""
  if REQUIRE_GPU:
    pytest.fail(f"JAX_EP_REQUIRE_GPU=1, but {reason}", pytrace=False)
  pytest.skip(reason)


def require_gpu():
  """A skip (a failure under JAX_EP_REQUIRE_GPU=1) where JAX sees no GPU or the extension
  did not load."""
  from jax_ep._native import ffi
  if not ffi.cuda_available():
    skip_unless_present(f"needs a CUDA GPU and the jax_ep CUDA extension ({ffi.why_unavailable()})")


def require_hopper():
  """As `require_gpu`, for jax_ep's Mosaic GPU kernels, which run on Hopper GPUs."""
  from jax_ep import gmm
  require_gpu()
  if not gmm._on_hopper():
    skip_unless_present("jax_ep's Mosaic GPU kernels run on Hopper GPUs (compute capability "
                        f"9.0), this machine has {[d.device_kind for d in jax.devices()]}")


def require_nvshmem():
  """As `require_gpu`, for the network transport, which needs jax_ep's NVSHMEM module."""
  from jax_ep.backends import nvshmem
  try:
    nvshmem.load()
  except nvshmem.NvshmemUnavailable as e:
    skip_unless_present(f"the network transport needs NVSHMEM: {e}")


def grouped_matmul_kernels(fn, *args):
  """`(mosaic, ragged)`: the calls of jax_ep's Mosaic GPU grouped GEMM kernels (on Hopper;
  `plgpu.kernel` traces to an `mpmd_map`) and the `lax.ragged_dot` products (its fallback) in
  the program `fn(*args)` traces, its backward included where `fn` takes a gradient. A test
  that claims to run the kernels asserts `ragged == 0` and the number of kernel calls: a
  fallback would otherwise be compared with `lax.ragged_dot` itself and pass."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return count_primitive(jaxpr, "mpmd_map"), count_primitive(jaxpr, "ragged_dot_general")


def rank_count_runs(num_ranks):
  """Whether this process can take part in a `num_ranks`-rank group: the job has that many
  devices and this process holds one of `rank_devices(num_ranks)` (groups over some of a job's
  processes are created by those processes only). The `ranks` marker (tests/conftest.py)
  generates only the rank counts for which this holds."""
  if num_ranks > len(jax.devices()):
    return False
  if jax.process_count() == 1 or num_ranks <= jax.local_device_count():
    return True
  me = jax.process_index()
  return any(d.process_index == me for d in jax.devices()[:num_ranks])


def rank_devices(num_ranks):
  """The devices of a `num_ranks`-rank mesh, or a pytest skip when there are too few.

  One process: the first `num_ranks` devices. A multi-process job (`jax_ep.launch`): each
  process's own devices when it holds enough (so at R=1 every process runs its own one-rank
  group instead of all but process 0 idling), else the first `num_ranks` devices of the job.
  """
  if num_ranks > len(jax.devices()):
    pytest.skip(f"needs {num_ranks} devices, have {len(jax.devices())}")
  if jax.process_count() > 1 and num_ranks <= jax.local_device_count():
    return jax.local_devices()[:num_ranks]
  return jax.devices()[:num_ranks]


def rank_mesh(num_ranks, axis_name="ep"):
  """A 1-D mesh over `rank_devices(num_ranks)`; a pytest skip in a process that holds none of
  them (groups over some of a job's processes are created by those processes only)."""
  mesh = jax.make_mesh((num_ranks,), (axis_name,), devices=rank_devices(num_ranks))
  if not local_rank_mask(mesh).any():
    pytest.skip(f"this process holds none of the {num_ranks} ranks' devices")
  return mesh


def local_rank_mask(mesh):
  """`[R]` bool: which ranks' devices this process holds (all of them in one process)."""
  me = jax.process_index()
  return np.array([d.process_index == me for d in mesh.devices.flat])


def host_value(value):
  """A global array as numpy; shards held by other processes read as zeros (compare only the
  ranks of `local_rank_mask`)."""
  if value is None or value.is_fully_addressable:
    return None if value is None else np.asarray(value)
  out = np.zeros(value.shape, value.dtype)
  for shard in value.addressable_shards:
    out[shard.index] = np.asarray(shard.data)
  return out


def used_rows(recv_x, group_sizes, group_offsets=None):
  """The rows of a dispatch result that hold tokens, expert after expert: rows outside the
  groups (past them, and `expert_alignment`'s padding between them, for `group_offsets`) are
  unspecified on the cuda backend (dispatch does not write them)."""
  recv_x, group_sizes = np.asarray(recv_x), np.asarray(group_sizes)
  if group_offsets is None:
    return recv_x[:int(group_sizes.sum())]
  return np.concatenate([recv_x[int(o):int(o) + int(n)]
                         for o, n in zip(np.asarray(group_offsets), group_sizes)]
                        + [recv_x[:0]])


def random_inputs(rng, num_ranks, num_tokens, hidden, dtype):
  x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
  return np.asarray(jnp.asarray(x, dtype))


def tolerance(dtype):
  return {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2}[dtype]


def assert_close(actual, desired, *, rtol, atol, what=""):
  """`|actual - desired| <= atol + rtol * |desired|` elementwise, where `atol` may be an array
  (np.testing.assert_allclose takes only a scalar atol); names the worst element (and `what`)."""
  actual = np.asarray(actual, np.float64)
  desired = np.asarray(desired, np.float64)
  assert actual.shape == desired.shape, (actual.shape, desired.shape)
  allowed = np.broadcast_to(atol + rtol * np.abs(desired), desired.shape)
  excess = np.abs(actual - desired) - allowed
  if actual.size and not (excess <= 0).all():  # also catches NaN
    worst = np.unravel_index(np.nanargmax(np.where(np.isnan(excess), np.inf, excess)),
                             excess.shape)
    raise AssertionError(
        f"{what + ': ' if what else ''}{int((~(excess <= 0)).sum())} of {actual.size} "
        f"elements differ by more than allowed; "
        f"worst at {tuple(int(i) for i in worst)}: got {float(actual[worst])!r}, want "
        f"{float(desired[worst])!r}, allowed difference {float(allowed[worst])!r}")


def partial_rounding_bound(group, expert_out, dispatched, topk_weights, *, weighted=True):
  """Per-element error a combine wire narrower than fp32 may add to the fp32-partial result.

  Each per-(token, rank) partial `p_r` is rounded once to `group.combine_partial_dtype`
  (relative error at most the unit roundoff `u`), so the sum moves by at most
  `u * sum_r |p_r| <= u * sum_k |w_k * expert_out[row_k]|`; a group over several hosts rounds
  each host's sum once more (`group.combine_partial_roundings`). Zero for fp32 partials.
  """
  wire = group.combine_partial_dtype
  if wire == np.dtype(np.float32):
    return 0.0
  unit = 2.0 ** -(jnp.finfo(wire).nmant + 1) * getattr(group, "combine_partial_roundings", 1)
  magnitudes = [np.abs(np.asarray(e, np.float64)) for e in expert_out]
  return unit * oracle.combine(magnitudes, dispatched, np.abs(np.asarray(topk_weights)),
                               np.float64, weighted=weighted)


class ClosesGroups:
  """Every group a test registers with `closing` (make_group does) is closed when the test
  ends, passed or failed, in reverse order of creation. `Group.close()` is idempotent, so tests
  that close a group themselves are unaffected; a run-time failure that no op or `check()` has
  raised yet is raised by its close and fails the test's teardown."""

  @pytest.fixture(autouse=True)
  def _close_groups_at_teardown(self):
    self._open_groups = []
    yield
    groups, self._open_groups = self._open_groups, []
    first_error = None
    for group in reversed(groups):
      try:
        group.close()
      except Exception as error:  # noqa: BLE001 - close the others, then raise the first
        first_error = first_error or error
    if first_error is not None:
      raise first_error

  def closing(self, group):
    """Registers `group` to be closed at the end of the test; returns it."""
    self._open_groups.append(group)
    return group


@dataclasses.dataclass(frozen=True)
class Target:
  """One backend or transport as the suites see it: the group arguments that select it and what
  it refuses or does differently, by design and documented. A suite is a base class (the
  high-throughput `EPTestBase`, the low-latency `LowLatencyTestBase`), a `Target` and the tests
  only that target has; every suite of one transport takes the same `Target`."""

  # Its name in skip messages ("cuda backend's peer transport").
  name: str
  backend: str
  # The rank counts its groups are made at (a test at another count skips).
  rank_counts: tuple[int, ...] = (1, 2, 4, 8)
  # Rank count of the tests that are about one feature rather than about R.
  small_ranks: int = 2
  # Extra `jax_ep.Group` arguments (e.g. the network transport's `virtual_hosts`).
  group_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Run before each group is made: raises (or skips) where the transport's engine is missing.
  require: Callable[[], None] | None = None
  # ---- capabilities
  # Whether vmap keeps one communication round (a backend that documents a per-element loop
  # under vmap has False; its per-element results are still checked).
  vmap_one_round: bool = True
  # Where `expert_alignment > 1` is refused by design: words of the error `Group` must raise
  # (checked), after which the test is skipped. None: supported.
  expert_alignment_refused: str | None = None
  # Whether the low-latency dispatch quantises to fp8 bit-exactly as the oracle (IEEE division,
  # round-to-nearest-even); XLA's own f32 -> e4m3 conversion may differ by one step on ties.
  fp8_exact: bool = False
  # Whether the rows of a low-latency slab past `count` are zeros (else unspecified).
  slab_padding_zeroed: bool = False


REFERENCE = Target("reference backend", "reference", slab_padding_zeroed=True)
# The cuda backend's one-rank group: its local kernels, no peer. (The peer and network
# transports' targets depend on the job's devices: tests/test_cuda_peer.py and
# tests/test_cuda_network.py.)
CUDA_LOCAL = Target("cuda backend at one rank", "cuda", rank_counts=(1,), small_ranks=1,
                    fp8_exact=True)


def make_target_group(target, num_ranks, *, num_experts, num_topk, hidden, max_tokens,
                      dtype=jnp.bfloat16, **options):
  """A `jax_ep.Group` of `target` over `rank_mesh(num_ranks)`, `options` over the target's
  group arguments: a skip where the target does not run at `num_ranks` or lacks its engine;
  where the target refuses an option by design, the error it must raise is checked, then the
  test skips."""
  if num_ranks not in target.rank_counts:
    pytest.skip(f"the {target.name} does not run at R={num_ranks} here")
  if target.require is not None:
    target.require()
  mesh = rank_mesh(num_ranks)
  options = {**target.group_options, **options}
  if options.get("num_sms", 0) is None:  # the group's default
    del options["num_sms"]
  make = lambda: jax_ep.Group(
      mesh, "ep", num_experts=num_experts, num_topk=num_topk, hidden=hidden,
      max_tokens_per_rank=max_tokens, dtype=dtype, backend=target.backend, **options)
  alignment = options.get("expert_alignment", 1)
  if alignment != 1 and target.expert_alignment_refused is not None:
    with pytest.raises(ValueError, match=target.expert_alignment_refused):
      make()
    pytest.skip(f"expert_alignment={alignment} is refused by the {target.name}, as documented")
  return make()


class BackendSuite(ClosesGroups):
  """What every suite shares: its `target` (set by a subclass), the groups it makes and the
  helpers that run per-rank code on them. The base classes add the tests."""

  target: Target = REFERENCE
  # Arguments of every group the suite makes (the low-latency suite's are low-latency groups).
  suite_options: Mapping[str, Any] = {}

  @property
  def backend(self):
    return self.target.backend

  @property
  def small_ranks(self):
    return self.target.small_ranks

  def make_group(self, num_ranks, *, num_experts, num_topk, hidden, max_tokens,
                 dtype=jnp.bfloat16, **options):
    """`make_target_group` of the suite's target and options, closed when the test ends."""
    return self.closing(make_target_group(
        self.target, num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
        max_tokens=max_tokens, dtype=dtype, **{**self.suite_options, **options}))

  @staticmethod
  def shard(group, *arrays, spec=P("ep")):
    """Global arrays split over the EP axis (each process feeds the shards it holds)."""
    sharding = NamedSharding(group.mesh, spec)
    return [jax.make_array_from_callback(np.shape(a), sharding, lambda i, a=a: np.asarray(a)[i])
            for a in arrays]

  @staticmethod
  def local_ranks(group):
    """Ranks whose device this process holds (all of them in a single-process run)."""
    return [int(r) for r in np.flatnonzero(local_rank_mask(group.mesh))]

  @staticmethod
  def local_mask(group):
    return local_rank_mask(group.mesh)

  to_numpy = staticmethod(host_value)

  def run_per_rank(self, group, fn, *arrays, jit=True):
    """Runs `fn` on each rank's slice (leading axis R removed) and stacks its outputs over R."""
    def body(*blocks):
      outs = fn(*(b[0] for b in blocks))
      return jax.tree.map(lambda o: o[None], outs)
    mapped = jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))
    outs = (jax.jit(mapped) if jit else mapped)(*self.shard(group, *arrays))
    return jax.tree.map(self.to_numpy, outs)


class EPTestBase(BackendSuite):
  """The high-throughput pair (dispatch, combine) and what is built on it, on any target."""

  def dispatch_combine(self, group, x, idx, w, expert_out, weighted=True):
    def fn(x, idx, w, eo):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      out = jax_ep.combine(group, eo, handle, weighted=weighted)
      return recv, out
    return self.run_per_rank(group, fn, x, idx, w, expert_out)

  def check_dispatch(self, group, x, idx, recv):
    expected = oracle.dispatch(x, idx, group.num_experts, group.capacity,
                               expert_alignment=group.expert_alignment)
    invalid = oracle.num_invalid(idx, group.num_experts)
    for d, want in enumerate(expected):
      if d not in self.local_ranks(group):
        continue
      np.testing.assert_array_equal(recv.group_sizes[d], want["group_sizes"],
                                    err_msg=f"group_sizes on rank {d}")
      np.testing.assert_array_equal(recv.group_offsets[d], want["group_offsets"],
                                    err_msg=f"group_offsets on rank {d}")
      np.testing.assert_array_equal(
          used_rows(recv.x[d], want["group_sizes"], want["group_offsets"]),
          used_rows(want["recv_x"], want["group_sizes"], want["group_offsets"]),
          err_msg=f"recv_x on rank {d}")
      assert recv.num_dropped[d] == want["num_dropped"], f"num_dropped on rank {d}"
      assert recv.num_invalid[d] == invalid[d], f"num_invalid on rank {d}"
    return expected

  # ------------------------------------------------------------------ semantics
  @pytest.mark.ranks("num_ranks", [1, 2, 4, 8])
  @pytest.mark.parametrize("num_tokens,hidden,num_topk,num_experts", [
      (1, 128, 1, 8), (19, 128, 8, 256), (19, 128, 3, 8), (7, 7168, 8, 256)])
  def test_dispatch_combine_uniform(self, num_ranks, num_tokens, hidden, num_topk, num_experts):
    if num_experts % num_ranks:
      pytest.skip("E not divisible by R")
    self._roundtrip(num_ranks, num_tokens, hidden, num_topk, num_experts, "uniform",
                    jnp.bfloat16)

  @pytest.mark.parametrize("pattern", ["hot", "unused_experts", "all_masked", "duplicates",
                                       "invalid"])
  @pytest.mark.ranks("num_ranks", [1, 2, 4, 8])
  def test_routing_patterns(self, num_ranks, pattern):
    self._roundtrip(num_ranks, 19, 128, 4, 16, pattern, jnp.float32)

  @pytest.mark.parametrize("pattern,capacity", [("hot", 300), ("invalid", 500),
                                                ("all_masked", None), ("duplicates", None)])
  def test_routing_patterns_past_one_layout_chunk(self, pattern, capacity):
    # T*K = 1280 > 1024 slots: the layout's multi-chunk path (three launches on the cuda
    # backends; the small cases above fit one chunk and take the one-launch path).
    _, _, expected = self._roundtrip(self.small_ranks, 160, 128, 8, 16, pattern, jnp.float32,
                                     capacity=capacity)
    if capacity is not None:
      assert sum(e["num_dropped"] for e in expected) > 0  # the case overflows somewhere

  @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
  def test_dtypes(self, dtype):
    self._roundtrip(self.small_ranks, 19, 256, 4, 8, "uniform", DTYPES[dtype])

  def test_experts_equal_ranks(self):
    # E == R: one expert per rank, K > L, so a token reaches each rank at most once (K <= E: a
    # token selects each expert once at most, so K = 2 needs two ranks).
    r = self.small_ranks
    self._roundtrip(r, 19, 128, 1, r, "uniform", jnp.float32)
    if r >= 2:
      self._roundtrip(r, 19, 128, 2, r, "duplicates", jnp.float32)

  def test_tokens_fewer_than_max(self):
    self._roundtrip(self.small_ranks, 5, 128, 2, 8, "uniform", jnp.float32, max_tokens=19)

  @pytest.mark.ranks("num_ranks", [1, 2, 4, 8])
  @pytest.mark.parametrize("capacity", [1, 7, 50])
  def test_capacity_overflow_is_counted(self, num_ranks, capacity):
    _, _, expected = self._roundtrip(num_ranks, 19, 128, 4, 8, "hot", jnp.float32,
                                     capacity=capacity)
    assert sum(e["num_dropped"] for e in expected) > 0  # the case overflows somewhere

  @pytest.mark.ranks("num_ranks", [1, 2, 4, 8])
  def test_default_capacity_filled_exactly(self, num_ranks):
    """Every token of every rank picks K distinct experts of rank 0 (L = K = 4): rank 0
    receives R * T_max * K rows, exactly the default capacity R * T_max * min(K, L), and
    keeps every one of them."""
    r, num_tokens, num_topk = num_ranks, 19, 4
    recv, _, expected = self._roundtrip(r, num_tokens, 128, num_topk, num_topk * r,
                                        "fill_rank0", jnp.float32)
    group = self._last_group
    assert group.capacity == r * num_tokens * num_topk
    assert expected[0]["group_sizes"].sum() == group.capacity
    assert all(e["num_dropped"] == 0 for e in expected)
    if 0 in self.local_ranks(group):
      assert recv.group_sizes[0].sum() == group.capacity and recv.num_dropped[0] == 0

  @pytest.mark.parametrize("pattern", ["duplicates", "one_expert"])
  def test_default_capacity_never_drops_with_duplicate_slots(self, pattern):
    # L = 2 < K = 4: slots naming one expert share a row, so a token brings at most
    # min(K, L) = 2 rows to a rank and the default capacity R * T_max * min(K, L) holds them.
    # (L < K <= E needs two ranks at least.)
    r = max(self.small_ranks, 2)
    recv, _, expected = self._roundtrip(r, 19, 128, 4, 2 * r, pattern, jnp.float32)
    assert all(e["num_dropped"] == 0 for e in expected)
    for d in self.local_ranks(self._last_group):
      assert recv.num_dropped[d] == 0

  def test_zero_tokens(self):
    """T = 0 on every rank: dispatch gives an empty layout, combine `[0, H]`, gradients work."""
    r = self.small_ranks
    group = self.make_group(r, num_experts=8, num_topk=2, hidden=128, max_tokens=5,
                            dtype=jnp.float32)
    x = np.zeros((r, 0, 128), np.float32)
    idx = np.zeros((r, 0, 2), np.int32)
    w = np.zeros((r, 0, 2), np.float32)
    eo = np.ones((r, group.capacity, 128), np.float32)
    recv, out = self.dispatch_combine(group, x, idx, w, eo)
    assert out.shape == (r, 0, 128)
    for d in self.local_ranks(group):
      assert recv.x[d].shape == (group.capacity, 128)  # every row past the (empty) groups
      np.testing.assert_array_equal(recv.group_sizes[d],
                                    np.zeros(group.num_local_experts, np.int32))
      assert recv.num_dropped[d] == 0 and recv.num_invalid[d] == 0

    def body(x, idx, w, eo):
      def loss(x, w, eo):
        recv, handle = jax_ep.dispatch(group, x, idx[0], w)
        return jnp.sum(jax_ep.combine(group, eo + recv.x, handle))
      return jax.tree.map(lambda g: g[None], jax.grad(loss, argnums=(0, 1, 2))(x[0], w[0], eo[0]))
    grads = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))(
        *self.shard(group, x, idx, w, eo))
    assert [g.shape for g in grads] == [(r, 0, 128), (r, 0, 2), (r, group.capacity, 128)]
    np.testing.assert_array_equal(self.to_numpy(grads[2])[self.local_mask(group)], 0.0)

  def _roundtrip(self, num_ranks, num_tokens, hidden, num_topk, num_experts, pattern, dtype,
                 capacity=None, max_tokens=None, weighted=True, num_sms=None, group=None,
                 expert_alignment=1):
    if group is None:
      group = self.make_group(num_ranks, num_experts=num_experts, num_topk=num_topk,
                              hidden=hidden, max_tokens=max_tokens or num_tokens, dtype=dtype,
                              capacity=capacity, num_sms=num_sms,
                              expert_alignment=expert_alignment)
    # NOTES: a seed every process derives alike (str hashes are salted per process, so `hash`
    # would give each rank of a multi-process run different inputs).
    seed = zlib.crc32(repr((num_ranks, num_tokens, hidden, num_topk, pattern)).encode())
    rng = np.random.default_rng(seed)
    x = random_inputs(rng, num_ranks, num_tokens, hidden, dtype)
    idx = make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, pattern)
    w = rng.random((num_ranks, num_tokens, num_topk)).astype(np.float32)
    eo = random_inputs(rng, num_ranks, group.capacity, hidden, dtype)
    self._last_group = group
    recv, out = self.dispatch_combine(group, x, idx, w, eo, weighted=weighted)
    expected = self.check_dispatch(group, x, idx, recv)
    want = oracle.combine(list(eo), expected, w, np.float64, weighted=weighted)
    tol = tolerance(dtype)
    wire = partial_rounding_bound(group, list(eo), expected, w, weighted=weighted)
    mine = self.local_mask(group)
    assert_close(out[mine], want[mine], rtol=tol,
                 atol=tol + (wire[mine] if np.ndim(wire) else wire))
    return recv, out, expected

  def test_unweighted_combine(self):
    self._roundtrip(self.small_ranks, 19, 128, 4, 8, "duplicates", jnp.float32, weighted=False)

  def test_deterministic(self):
    r = self.small_ranks
    group = self.make_group(r, num_experts=16, num_topk=4, hidden=256, max_tokens=64,
                            dtype=jnp.bfloat16)
    rng = np.random.default_rng(3)
    x = random_inputs(rng, r, 64, 256, jnp.bfloat16)
    idx = make_routing(rng, r, 64, 4, 16, "uniform")
    w = rng.random((r, 64, 4)).astype(np.float32)
    eo = random_inputs(rng, r, group.capacity, 256, jnp.bfloat16)
    # The rows outside the groups are unspecified (the cuda dispatch does not write them):
    # compared as zeros.
    first, second = (self.run_per_rank(group, self._dispatch_combine_fn(group), x, idx, w, eo)
                     for _ in range(2))
    mine = self.local_mask(group)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[mine], b[mine]), first, second)

  def test_consecutive_calls_with_different_routings(self):
    r = self.small_ranks
    group = self.make_group(r, num_experts=16, num_topk=4, hidden=128, max_tokens=19,
                            dtype=jnp.float32)
    rng = np.random.default_rng(5)
    for pattern in ("uniform", "hot", "all_masked", "uniform"):
      x = random_inputs(rng, r, 19, 128, jnp.float32)
      idx = make_routing(rng, r, 19, 4, 16, pattern)
      w = rng.random((r, 19, 4)).astype(np.float32)
      eo = random_inputs(rng, r, group.capacity, 128, jnp.float32)
      recv, out = self.dispatch_combine(group, x, idx, w, eo)
      expected = self.check_dispatch(group, x, idx, recv)
      mine = self.local_mask(group)
      want = oracle.combine(list(eo), expected, w, np.float64)
      np.testing.assert_allclose(out[mine], want[mine], rtol=1e-5, atol=1e-5)

  def test_strict_reports_drops_without_failing_the_call(self):
    """A strict group's drop is counted in the call that dropped (its results stay defined);
    then `check()` and the next op traced on the group raise one message that names the
    shards, the rows and the capacity that would fit them."""
    r = self.small_ranks
    group = self.make_group(r, num_experts=8, num_topk=2, hidden=128, max_tokens=19,
                            dtype=jnp.float32, capacity=3, strict=True)
    rng = np.random.default_rng(0)
    x = random_inputs(rng, r, 19, 128, jnp.float32)
    idx = make_routing(rng, r, 19, 2, 8, "uniform")
    w = np.ones((r, 19, 2), np.float32)
    eo = np.zeros((r, 3, 128), np.float32)

    def body(x, idx, w, eo):
      recv, handle = jax_ep.dispatch(group, x[0], idx[0], w[0])
      return recv.num_dropped[None], jax_ep.combine(group, eo[0], handle)[None]
    step = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = self.shard(group, x, idx, w, eo)
    for _ in range(2):  # the compiled step keeps running; every drop is recorded
      dropped, _ = (self.to_numpy(v) for v in step(*args))
    expected = oracle.dispatch(x, idx, 8, 3)
    mine = self.local_ranks(group)
    for d in mine:
      assert dropped[d] == expected[d]["num_dropped"] > 0
    need = max(3 + int(expected[d]["num_dropped"]) for d in mine)
    pattern = (rf"dropped rows that did not fit in capacity=3 \(rank {mine[0]}: "
               rf"{int(expected[mine[0]]['num_dropped'])} rows.*a capacity of at least {need} "
               rf"would fit them")
    with pytest.raises(jax_ep.CapacityOverflowError, match=pattern):
      group.check()
    with pytest.raises(jax_ep.CapacityOverflowError):  # a new trace is refused
      self.dispatch_combine(group, x, idx, w, eo)
    group.close()  # already raised to the caller: close() just frees

  def test_strict_passes_without_drop(self):
    r = self.small_ranks
    group = self.make_group(r, num_experts=8, num_topk=2, hidden=128, max_tokens=19,
                            dtype=jnp.float32, strict=True)
    rng = np.random.default_rng(0)
    x = random_inputs(rng, r, 19, 128, jnp.float32)
    idx = make_routing(rng, r, 19, 2, 8, "uniform")
    w = np.ones((r, 19, 2), np.float32)
    eo = random_inputs(rng, r, group.capacity, 128, jnp.float32)
    recv, _ = self.dispatch_combine(group, x, idx, w, eo)
    assert recv.num_dropped.sum() == 0

  # ------------------------------------------------------------------ expert_alignment
  @pytest.mark.parametrize("alignment,pattern,capacity", [
      (8, "uniform", None), (16, "hot", None), (8, "unused_experts", None),
      (4, "invalid", None), (8, "hot", 60), (128, "duplicates", None)])
  def test_expert_alignment(self, alignment, pattern, capacity):
    """Each local expert's rows start at a multiple of `expert_alignment` (`group_offsets`
    says where): rows, sizes, offsets, drops and combine are the oracle's; `valid_rows()` is
    the rows inside the groups and `zero_padding` zeros the others, the padding between the
    groups included."""
    recv, _, expected = self._roundtrip(self.small_ranks, 19, 128, 4, 16, pattern, jnp.float32,
                                        capacity=capacity, expert_alignment=alignment)
    group = self._last_group
    if capacity is None:
      assert group.capacity == oracle.default_capacity(
          self.small_ranks, 19, 4, 16 // self.small_ranks, alignment)
      assert all(e["num_dropped"] == 0 for e in expected)
    else:
      assert sum(e["num_dropped"] for e in expected) > 0
    valid = np.asarray(recv.valid_rows())
    zeroed = np.asarray(jax_ep.zero_padding(recv).x)
    for d in self.local_ranks(group):
      sizes, offsets = recv.group_sizes[d], recv.group_offsets[d]
      assert (offsets[sizes > 0] % alignment == 0).all(), offsets
      want = np.zeros(group.capacity, bool)
      want[expected[d]["row_index"]] = True
      np.testing.assert_array_equal(valid[d], want, err_msg=f"valid_rows on rank {d}")
      np.testing.assert_array_equal(zeroed[d][~want], 0.0)
      np.testing.assert_array_equal(zeroed[d][want], recv.x[d][want])

  @pytest.mark.parametrize("pattern,capacity", [("hot", 300), ("invalid", None)])
  def test_expert_alignment_past_one_layout_chunk(self, pattern, capacity):
    # T*K = 1280 > 1024 slots: the layout's multi-chunk path (see
    # test_routing_patterns_past_one_layout_chunk).
    _, _, expected = self._roundtrip(self.small_ranks, 160, 128, 8, 16, pattern, jnp.float32,
                                     capacity=capacity, expert_alignment=32)
    if capacity is not None:
      assert sum(e["num_dropped"] for e in expected) > 0

  @pytest.mark.ranks("num_ranks", [1, 4])
  def test_expert_alignment_ranks(self, num_ranks):
    self._roundtrip(num_ranks, 19, 128, 8, 64, "uniform", jnp.bfloat16, expert_alignment=64)

  def test_expert_alignment_padding_drops_rows(self):
    """A capacity that holds every row but not the padding before the last expert: the rows
    that do not fit with the padding drop, counted in num_dropped, and combine leaves them
    out."""
    r, alignment, num_tokens = self.small_ranks, 16, 5
    # Every rank's tokens 0-2 go to rank 0's expert 0 and tokens 3-4 to its expert 1, so rank 0
    # receives 3R rows of expert 0, then (from row roundup(3R, 16)) 2R of expert 1, of which
    # R fit. Without the alignment all 5R rows would fit.
    first = -(-3 * r // alignment) * alignment
    capacity = first + r
    assert capacity >= 5 * r
    group = self.make_group(r, num_experts=2 * r, num_topk=1, hidden=128,
                            max_tokens=num_tokens, dtype=jnp.float32, capacity=capacity,
                            expert_alignment=alignment)
    rng = np.random.default_rng(4)
    x = random_inputs(rng, r, num_tokens, 128, jnp.float32)
    idx = np.broadcast_to(np.array([0, 0, 0, 1, 1], np.int32)[None, :, None],
                          (r, num_tokens, 1)).copy()
    w = rng.random((r, num_tokens, 1)).astype(np.float32)
    eo = random_inputs(rng, r, capacity, 128, jnp.float32)
    recv, out = self.dispatch_combine(group, x, idx, w, eo)
    expected = self.check_dispatch(group, x, idx, recv)
    assert expected[0]["num_dropped"] == r
    if 0 in self.local_ranks(group):
      assert recv.num_dropped[0] == r
      np.testing.assert_array_equal(recv.group_sizes[0], [3 * r, r])
      np.testing.assert_array_equal(recv.group_offsets[0], [0, first])
    want = oracle.combine(list(eo), expected, w, np.float64)
    mine = self.local_mask(group)
    assert_close(out[mine], want[mine], rtol=1e-5, atol=1e-5)

  def test_expert_alignment_gradients(self):
    self._check_gradients(self.small_ranks, "duplicates", expert_alignment=8)

  def test_expert_alignment_vmap(self):
    num_ranks = self.small_ranks
    group = self.make_group(num_ranks, num_experts=8, num_topk=2, hidden=128, max_tokens=19,
                            dtype=jnp.float32, expert_alignment=8)
    xs, idxs, ws, eos = self._batched_inputs(group, np.random.default_rng(8), 19,
                                             ("uniform", "hot", "unused_experts"))
    one = self._dispatch_combine_fn(group)
    batched = self.run_per_rank(group, jax.vmap(one), xs, idxs, ws, eos)
    mine = self.local_mask(group)
    for b in range(xs.shape[1]):
      recv = jax.tree.map(lambda a: a[:, b], batched[0])
      expected = self.check_dispatch(group, xs[:, b], idxs[:, b], recv)
      for d in self.local_ranks(group):  # zero_padding under vmap: zeros outside the groups
        np.testing.assert_array_equal(recv.x[d], expected[d]["recv_x"])
      want = oracle.combine(list(eos[:, b]), expected, ws[:, b], np.float64)
      assert_close(batched[1][:, b][mine], want[mine], rtol=1e-5, atol=1e-5)
    if self.target.vmap_one_round:
      self.assert_one_round_under_vmap(group, one, xs, idxs, ws, eos)

  # ------------------------------------------------------------------ gradients
  def _scaled_experts_model(self, group):
    """Per-shard model: each expert scales its rows by its own vector `a[e]` (a `[L, H]` shard)."""
    def model(x, idx, w, a_local):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      # Expert of each row: the number of experts after the first that start at or before it.
      rows = jnp.arange(recv.x.shape[0], dtype=jnp.int32)
      row_expert = jnp.sum(rows[:, None] >= recv.group_offsets[None, 1:], axis=1)
      scale = a_local[row_expert]
      # Rows outside the groups are unspecified (the cuda dispatch leaves them, and the
      # backward of combine leaves their cotangent): a model that reduces over rows (this one's
      # gradient of `a`) selects them away in both directions: a select, not a multiply.
      valid = recv.valid_rows()[:, None]
      rows = jnp.where(valid, recv.x, jnp.zeros((), recv.x.dtype))
      y = jnp.where(valid, rows.astype(jnp.float32) * scale, 0.0).astype(recv.x.dtype)
      return jax_ep.combine(group, y, handle)
    return model

  @staticmethod
  def _dense_scaled_experts(x, idx, w, a, num_experts):
    """All ranks' tokens in one place: out[t] = sum_k w[t,k] * x[t] * a[idx[t,k]]."""
    valid = (idx >= 0) & (idx < num_experts)
    scales = a[jnp.clip(idx, 0, num_experts - 1)]  # [..., K, H]
    terms = jnp.where(valid[..., None], w[..., None] * scales, 0.0)
    return x.astype(jnp.float32) * jnp.sum(terms, axis=-2)

  @pytest.mark.ranks("num_ranks,pattern", [(1, "uniform"), (2, "duplicates"),
                                                 (4, "invalid"), (8, "uniform")])
  def test_gradients_match_dense_model(self, num_ranks, pattern):
    self._check_gradients(num_ranks, pattern)

  def _check_gradients(self, num_ranks, pattern, expert_alignment=1):
    num_experts, num_topk, hidden, num_tokens = 16, 4, 128, 19
    padding = num_experts // num_ranks * (expert_alignment - 1)
    group = self.make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                            max_tokens=num_tokens, dtype=jnp.float32,
                            capacity=num_ranks * num_tokens * num_topk + padding,
                            expert_alignment=expert_alignment)
    rng = np.random.default_rng(11)
    x = random_inputs(rng, num_ranks, num_tokens, hidden, jnp.float32)
    idx = make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, pattern)
    w = rng.random((num_ranks, num_tokens, num_topk)).astype(np.float32)
    a = rng.standard_normal((num_experts, hidden)).astype(np.float32)
    cot = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    model = self._scaled_experts_model(group)
    mine = self.local_mask(group)

    # The gradient is taken per shard inside shard_map: each rank seeds its own loss term and
    # the backward rules' communication adds every rank's contribution, which gives the gradient
    # of the total loss without an XLA collective (processes sharing one GPU cannot run those).
    def body(x, idx, w, a, cot):
      def shard_loss(x, w, a):
        return jnp.sum(model(x, idx[0], w, a) * cot[0])
      gx, gw, ga = jax.grad(shard_loss, argnums=(0, 1, 2))(x[0], w[0], a)
      return gx[None], gw[None], ga

    mapped = jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))
    got = jax.jit(mapped)(*self.shard(group, x, idx, w, a, cot))
    got = [self.to_numpy(g) for g in got]

    def dense_loss(x, w, a):
      return jnp.sum(self._dense_scaled_experts(x, idx, w, a, num_experts) * cot)

    want = [np.asarray(g) for g in jax.grad(dense_loss, argnums=(0, 1, 2))(x, w, a)]
    want[2] = want[2].reshape(num_ranks, -1, hidden)  # expert scales: rank r holds its L experts
    got[2] = got[2].reshape(num_ranks, -1, hidden)
    for name, g, r in zip(("x", "topk_weights", "expert scales"), got, want):
      np.testing.assert_allclose(g[mine], r[mine], rtol=1e-4, atol=1e-4,
                                 err_msg=f"gradient w.r.t. {name}")

  def test_numerical_gradients(self):
    if jax.process_count() > 1:
      pytest.skip("check_grads perturbs whole global arrays; single-process only")
    r = self.small_ranks
    group = self.make_group(r, num_experts=8, num_topk=2, hidden=128, max_tokens=5,
                            dtype=jnp.float32)
    rng = np.random.default_rng(2)
    x = random_inputs(rng, r, 5, 128, jnp.float32)
    idx = make_routing(rng, r, 5, 2, 8, "uniform")
    w = rng.random((r, 5, 2)).astype(np.float32)
    a = rng.standard_normal((8, 128)).astype(np.float32)
    model = self._scaled_experts_model(group)
    x_s, idx_s, w_s, a_s = self.shard(group, x, idx, w, a)

    @jax.jit
    def f(x, w, a):
      x, w, a = (group.constrain(v, P("ep")) for v in (x, w, a))  # perturbations are unsharded
      body = lambda x, idx, w, a: model(x[0], idx[0], w[0], a)[None]
      return jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))(
          x, idx_s, w, a)
    jax.test_util.check_grads(f, (x_s, w_s, a_s), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)

  # ------------------------------------------------------------------ rows past the groups
  @pytest.mark.ranks("num_ranks", [1, 2, 4, 8])
  def test_rows_past_the_groups_never_reach_a_result(self, num_ranks):
    """NaN in every row of recv.x past sum(group_sizes) (and in the cotangent of the experts'
    output there) leaves the layer's output and every gradient unchanged and finite: combine,
    grouped_matmul, expert_mlp and the backward rules never read those rows."""
    self._check_rows_outside_the_groups(num_ranks)

  def test_alignment_padding_never_reaches_a_result(self):
    """As above with expert_alignment: NaN also in the padding between the experts' rows."""
    self._check_rows_outside_the_groups(self.small_ranks, expert_alignment=16)

  def _check_rows_outside_the_groups(self, num_ranks, expert_alignment=1):
    num_experts, num_topk, hidden, ffn, num_tokens = 8, 2, 128, 128, 64
    group = self.make_group(num_ranks, num_experts=num_experts, num_topk=num_topk,
                            hidden=hidden, max_tokens=num_tokens, dtype=jnp.bfloat16,
                            expert_alignment=expert_alignment)
    rng = np.random.default_rng(17)
    x = random_inputs(rng, num_ranks, num_tokens, hidden, jnp.bfloat16)
    idx = make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, "hot")
    w = rng.random((num_ranks, num_tokens, num_topk)).astype(np.float32)
    cot = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    scale = hidden ** -0.5
    weights = [np.asarray(jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16))
               for shape in ((num_experts, hidden, ffn), (num_experts, hidden, ffn),
                             (num_experts, ffn, hidden))]

    # The poison is a flag of one program, not two programs: the clean run and the poisoned
    # one compile once (the layer's forward and backward with the expert kernels: most of this
    # test's time), and differ only in what they read.
    @jax.custom_vjp
    def poison_cotangent(y, keep):
      return y

    def poison_fwd(y, keep):
      return y, keep

    def poison_bwd(keep, dy):
      return jnp.where(keep[:, None], dy, jnp.full((), jnp.nan, dy.dtype)), None
    poison_cotangent.defvjp(poison_fwd, poison_bwd)

    def body(poison, x, idx, w, cot, w_gate, w_up, w_down):
      def loss(x, w, w_gate, w_up, w_down):
        recv, handle = jax_ep.dispatch(group, x, idx[0], w)
        # Poisoned: every row past the groups NaN, in the rows and in their cotangent.
        keep = recv.valid_rows() | ~poison[0]
        rows = jnp.where(keep[:, None], recv.x, jnp.full((), jnp.nan, recv.x.dtype))
        y = expert_mlp(rows, w_gate, w_up, w_down, recv.group_sizes,
                       group_offsets=recv.group_offsets)
        out = jax_ep.combine(group, poison_cotangent(y, keep), handle)
        return jnp.sum(out.astype(jnp.float32) * cot[0]), out
      grads, out = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
          x[0], w[0], w_gate, w_up, w_down)
      return (out[None], grads[0][None], grads[1][None]) + tuple(grads[2:])
    step = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))

    def run(poison):
      flags = np.full((num_ranks,), poison)
      outs = step(*self.shard(group, flags, x, idx, w, cot, *weights))
      return [np.asarray(self.to_numpy(o), np.float32) for o in outs]

    clean, poisoned = run(False), run(True)
    mine = self.local_mask(group)
    for name, a, b in zip(("out", "d x", "d topk_weights", "d w_gate", "d w_up", "d w_down"),
                          clean, poisoned):
      if a.shape[0] == num_ranks:
        a, b = a[mine], b[mine]
      assert np.isfinite(b).all(), f"{name}: NaN from the rows past the groups"
      np.testing.assert_array_equal(b, a, err_msg=name)

  # ------------------------------------------------------------------ transformations
  def test_vmap_matches_per_element_with_one_round(self):
    batch, num_ranks = 3, self.small_ranks
    group = self.make_group(num_ranks, num_experts=8, num_topk=2, hidden=128, max_tokens=19,
                            dtype=jnp.float32)
    xs, idxs, ws, eos = self._batched_inputs(group, np.random.default_rng(7), 19,
                                             ("uniform", "hot", "duplicates"))
    one = self._dispatch_combine_fn(group)
    batched = self.run_per_rank(group, jax.vmap(one), xs, idxs, ws, eos)
    for b in range(batch):
      single = self.run_per_rank(group, one, xs[:, b], idxs[:, b], ws[:, b], eos[:, b])
      jax.tree.map(lambda got, want: np.testing.assert_array_equal(got[:, b], want),
                   batched, single)
    if self.target.vmap_one_round:
      self.assert_one_round_under_vmap(group, one, xs, idxs, ws, eos)

  @staticmethod
  def _batched_inputs(group, rng, num_tokens, patterns):
    """f32 inputs `[R, B, ...]` for vmap tests, one routing pattern per batch element."""
    r, b, h, k = group.num_ranks, len(patterns), group.hidden, group.num_topk
    xs = np.stack([random_inputs(rng, r, num_tokens, h, jnp.float32) for _ in range(b)], 1)
    idxs = np.stack([make_routing(rng, r, num_tokens, k, group.num_experts, p)
                     for p in patterns], 1)
    ws = rng.random((r, b, num_tokens, k)).astype(np.float32)
    eos = rng.standard_normal((r, b, group.capacity, h)).astype(np.float32)
    return xs, idxs, ws, eos

  @staticmethod
  def _dispatch_combine_fn(group):
    def one(x, idx, w, eo):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      # The rows past the groups are unspecified: compared as zeros.
      return jax_ep.zero_padding(recv), jax_ep.combine(group, eo, handle)
    return one

  def test_vmap_past_one_layout_chunk(self):
    # As above with T*K = 1280 slots per element (the multi-chunk layout, batched) and a
    # capacity that drops rows.
    batch, num_ranks, num_tokens = 2, self.small_ranks, 160
    group = self.make_group(num_ranks, num_experts=16, num_topk=8, hidden=128,
                            max_tokens=num_tokens, dtype=jnp.float32, capacity=400)
    xs, idxs, ws, eos = self._batched_inputs(group, np.random.default_rng(11), num_tokens,
                                             ("hot", "invalid"))
    batched = self.run_per_rank(group, jax.vmap(self._dispatch_combine_fn(group)), xs, idxs, ws,
                                eos)
    for b in range(batch):
      expected = self.check_dispatch(group, xs[:, b], idxs[:, b],
                                     jax.tree.map(lambda a: a[:, b], batched[0]))
      assert sum(e["num_dropped"] for e in expected) > 0
      want = oracle.combine(list(eos[:, b]), expected, ws[:, b], np.float64)
      mine = self.local_mask(group)
      assert_close(batched[1][:, b][mine], want[mine], rtol=1e-5, atol=1e-5)

  def assert_one_round_under_vmap(self, group, one, *arrays):
    """vmap must not multiply communication rounds (reference: same all-to-all count)."""
    def count(fn, arrays):
      def body(*blocks):
        return jax.tree.map(lambda o: o[None], fn(*(b[0] for b in blocks)))
      mapped = jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))
      text = jax.jit(mapped).lower(*self.shard(group, *arrays)).as_text()
      # The joins of ops on jax_ep's own stream communicate nothing (streams.on_own_stream:
      # under vmap each op joins in its batching rule, then once more where it was traced).
      joins = text.count("custom_call @jax_ep_join")
      return text.count("all_to_all") + text.count("custom_call") - joins
    single = count(one, [a[:, 0] for a in arrays])
    batched = count(jax.vmap(one), arrays)
    assert batched == single, f"vmap changed the number of communication ops: {single} -> {batched}"

  def test_scan_checkpoint_layer_stack(self):
    num_layers, num_ranks = 3, self.small_ranks
    group = self.make_group(num_ranks, num_experts=8, num_topk=2, hidden=128, max_tokens=19,
                            dtype=jnp.float32)
    rng = np.random.default_rng(9)
    x = random_inputs(rng, num_ranks, 19, 128, jnp.float32)
    routers = rng.standard_normal((num_layers, 128, 8)).astype(np.float32)
    scales = 1 + 0.1 * rng.standard_normal((num_layers, 8, 128)).astype(np.float32)
    model = self._scaled_experts_model(group)

    def layer(h, params):
      router, a = params
      idx, w = jax_ep.layer.route(h, router, 2)
      return h + model(h, idx, w, a), None

    def stack(x, routers, a, use_scan):
      if use_scan:
        return jax.lax.scan(jax.checkpoint(layer), x, (routers, a))[0]
      for i in range(num_layers):
        x = layer(x, (routers[i], a[i]))[0]
      return x

    def run(use_scan):
      # Per-shard value and gradient (see test_gradients_match_dense_model for why).
      def body(x, routers, a):
        loss = lambda x, a: jnp.sum(stack(x, routers, a, use_scan) ** 2)
        value, (gx, ga) = jax.value_and_grad(loss, argnums=(0, 1))(x[0], a)
        return value[None], gx[None], ga
      specs = (P("ep"), P(), P(None, "ep"))
      mapped = jax.shard_map(body, mesh=group.mesh, in_specs=specs,
                             out_specs=(P("ep"), P("ep"), P(None, "ep")))
      (x_s,) = self.shard(group, x)
      (r_s,) = self.shard(group, routers, spec=P())
      (a_s,) = self.shard(group, scales, spec=P(None, "ep"))
      return [self.to_numpy(v) for v in jax.jit(mapped)(x_s, r_s, a_s)]
    scanned, unrolled = run(True), run(False)
    # Same math, different fusion: compare to fp32 rounding relative to each array's scale.
    def close(s, u):
      np.testing.assert_allclose(s, u, rtol=0, atol=1e-5 * np.abs(u).max())
    jax.tree.map(close, scanned, unrolled)

