"""The shared suite on the multi-rank cuda backend (peer transport), one EP rank per process.

Runs under the launcher, on one GPU shared by N processes (CUDA MPS) or one GPU per process:

  python -m jax_ep.launch -n 4 --share-gpu -- python -m pytest tests/test_cuda_peer.py -q

or in one process driving several GPUs:

  python -m pytest tests/test_cuda_peer.py

Marked `gpu`: skipped where no CUDA GPU or extension is present, and skipped with one device
(nothing to peer).
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import RowFormat
from ep_test_base import (EPTestBase, Target, assert_close, make_routing, random_inputs,
                          used_rows)
from low_latency_test_base import CudaLowLatencyTests, run_graph_worker
from jax_ep.testing import oracle
from test_fp8_dispatch import FP8_FORMATS, FP8DispatchSuite

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

NUM_RANKS = jax.device_count()

# Every rank of the job, each reaching the others' buffers by pointer.
PEER = Target("cuda backend's peer transport", "cuda", rank_counts=(NUM_RANKS,),
              small_ranks=NUM_RANKS, fp8_exact=True,
              vmap_one_round=False)  # one round per batch element under vmap (documented)


@pytest.mark.skipif(NUM_RANKS < 2, reason="the peer transport needs at least 2 ranks")
class TestCudaIntranodeLowLatency(CudaLowLatencyTests):
  target = PEER


@pytest.mark.skipif(NUM_RANKS < 2, reason="the peer transport needs at least 2 ranks")
class TestCudaIntranodeFP8Dispatch(FP8DispatchSuite):
  """The fp8 dispatch over the peer transport (jax_ep_peer_dispatch_fp8): each token quantised
  by its sender into the peers' staging rows, split on arrival; rows and scales bit-exact
  against the closed form, the straight-through gradient through the peer combine."""
  target = PEER

  @pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
  @pytest.mark.parametrize("capacity", [None, 150])
  def test_fp8_dispatch_in_many_send_chunks(self, fmt, capacity):
    """num_sms=1: 200 tokens in 7 chunks; where every rank has its GPU the receivers split
    the packed rows chunk by chunk, else the placement after the arrivals does; with
    capacity=150 rows drop. Four calls on one group: the chunk counters and the staging rows
    are reused."""
    r = NUM_RANKS
    group = self.make_group(r, num_experts=8 * r, num_topk=4, hidden=512, max_tokens=200,
                            capacity=capacity, num_sms=1, wire_format=fmt)
    for pattern in ["uniform", "hot", "duplicates", "invalid"]:
      x, idx, w = self.inputs(r, 200, 512, 4, 8 * r, pattern)
      recv, out = self.run(group, x, idx, w)
      expected = self.check(group, x, idx, w, recv, out)
      if capacity is not None and pattern == "hot":
        assert sum(e["num_dropped"] for e in expected) > 0

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
  def test_activation_dtypes(self, dtype):
    r = NUM_RANKS
    fmt = RowFormat.FP8_POW2_SCALES
    group = self.make_group(r, num_experts=4 * r, num_topk=3, hidden=384, max_tokens=23,
                            dtype=dtype, wire_format=fmt)
    rng = np.random.default_rng(12)
    x = random_inputs(rng, r, 23, 384, dtype)
    idx = make_routing(rng, r, 23, 3, 4 * r, "uniform")
    w = rng.random((r, 23, 3)).astype(np.float32)

    def fn(x, idx, w):
      recv, _ = jax_ep.dispatch(group, x, idx, w)
      return recv
    recv = self.run_per_rank(group, fn, x, idx, w)
    expected = oracle.fp8_dispatch(x, idx, 4 * r, group.capacity, round_scale=True)
    for d in self.local_ranks(group):
      g = expected[d]["group_sizes"]
      np.testing.assert_array_equal(recv.group_sizes[d], g)
      np.testing.assert_array_equal(used_rows(recv.x[d], g).astype(np.float32),
                                    used_rows(expected[d]["recv_x"], g).astype(np.float32))
      np.testing.assert_array_equal(used_rows(recv.scales[d], g),
                                    used_rows(expected[d]["scales"], g))


@pytest.mark.skipif(NUM_RANKS < 2, reason="the peer transport needs at least 2 ranks")
class TestCudaIntranodeOnCommStream(EPTestBase):
  """The shared suite with the ops on XLA's additional stream 1 (`comm_stream=1`): the same
  results, and every rank's kernels still meet their peers'."""
  target = dataclasses.replace(PEER, name="cuda backend's peer transport, comm_stream=1",
                               group_options={**PEER.group_options, "comm_stream": 1})


@pytest.mark.skipif(NUM_RANKS < 2, reason="the peer transport needs at least 2 ranks")
class TestCudaIntranodeOnOwnStream(EPTestBase):
  """The shared suite with the ops on jax_ep's own stream (`comm_stream="jax_ep"`): the same
  results, and every rank's kernels still meet their peers'."""
  target = dataclasses.replace(PEER, name="cuda backend's peer transport, own stream",
                               group_options={**PEER.group_options, "comm_stream": "jax_ep"})


@pytest.mark.skipif(NUM_RANKS < 2, reason="the peer transport needs at least 2 ranks")
class TestCudaIntranode(EPTestBase):
  target = PEER

  def test_combine_partial_dtype(self):
    # bf16 activations: partials travel in bf16 (the combine tests allow for that rounding
    # through `partial_rounding_bound`); other dtypes keep fp32 partials.
    want = {jnp.bfloat16: jnp.bfloat16, jnp.float16: np.float32, jnp.float32: np.float32}
    for dtype, wire in want.items():
      group = self.make_group(NUM_RANKS, num_experts=8 * NUM_RANKS, num_topk=2, hidden=128,
                              max_tokens=4, dtype=dtype)
      assert group.combine_partial_dtype == np.dtype(wire)

  def test_receives_while_sending_where_every_rank_has_its_gpu(self):
    """The dispatch receives while it sends exactly where it may: never on a shared GPU; on
    GPUs of their own whenever the driver reports native P2P atomics between every pair of the
    host's GPUs. The oracle is `nvidia-smi topo -p2p a`, which sees every GPU whatever
    CUDA_VISIBLE_DEVICES hides, so this holds for processes narrowed to one GPU each
    (launch --isolate-gpus) as for the others."""
    group = self.make_group(NUM_RANKS, num_experts=8 * NUM_RANKS, num_topk=2, hidden=128,
                            max_tokens=4, dtype=jnp.bfloat16)
    if os.environ.get("JAX_EP_SHARED_GPU") == "1":
      assert not group.receives_while_sending
      return
    cells = _p2p_atomics_cells()
    if not cells:
      pytest.skip("`nvidia-smi topo -p2p a` gave no matrix to compare with")
    if any(c not in ("OK", "X") for c in cells):
      pytest.skip(f"this host's GPUs do not all have P2P atomics ({sorted(set(cells))})")
    assert group.receives_while_sending

  @pytest.mark.parametrize("capacity,alignment", [(None, 1), (150, 1), (None, 64), (400, 64)])
  def test_dispatch_in_many_send_chunks(self, capacity, alignment):
    """num_sms=1: 8 sending blocks, so 200 tokens go out in 7 chunks of 32 tokens. Where every
    rank has a GPU of its own, the receivers place each chunk's rows as it lands; one group runs
    four calls, so the per-chunk counters are reused (each call resets them). With capacity=150
    rows are dropped, which moves every later source's rows. With expert_alignment=64 each
    expert's rows start at a multiple of 64 (the receivers place rows at the aligned offsets;
    with capacity=400 the padding also pushes rows past the capacity)."""
    r = NUM_RANKS
    group = self.make_group(r, num_experts=8 * r, num_topk=4, hidden=256, max_tokens=200,
                            dtype=jnp.bfloat16, capacity=capacity, num_sms=1,
                            expert_alignment=alignment)
    for pattern in ["uniform", "hot", "duplicates", "invalid"]:
      _, _, expected = self._roundtrip(r, 200, 256, 4, 8 * r, pattern, jnp.bfloat16,
                                       group=group)
      if capacity is not None and pattern == "hot":
        assert sum(e["num_dropped"] for e in expected) > 0

  def test_back_to_back_rounds_reuse_regions(self):
    """Many rounds of dispatch, combine and their backward ops (dispatch_cached, combine_vjp)
    through one compiled step, a new routing each round: every receive region is reused many
    times, so a broken hand-off between calls shows up as wrong rows, wrong gradients or a
    timeout. Rows are the oracle's exactly; gradients the dense model's to bf16 rounding."""
    r, num_tokens, hidden, num_experts, num_topk = NUM_RANKS, 64, 256, 8 * NUM_RANKS, 4
    group = self.make_group(r, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                            max_tokens=num_tokens, dtype=jnp.bfloat16)
    model = self._scaled_experts_model(group)

    def body(x, idx, w, a, cot):
      recv, _ = jax_ep.dispatch(group, x[0], idx[0], w[0])
      loss = lambda x, w, a: jnp.sum(model(x, idx[0], w, a).astype(jnp.float32) * cot[0])
      grads = jax.grad(loss, argnums=(0, 1, 2))(x[0], w[0], a)
      return recv.x[None], recv.group_sizes[None], grads[0][None], grads[1][None], grads[2]

    step = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))
    dense_grads = jax.jit(jax.grad(
        lambda x, w, a, idx, cot: jnp.sum(
            self._dense_scaled_experts(x, idx, w, a, num_experts) * cot), argnums=(0, 1, 2)))
    rng = np.random.default_rng(21)
    mine = self.local_mask(group)
    patterns = ["uniform", "hot", "duplicates", "invalid", "all_masked", "unused_experts"]
    for round_index in range(60):
      pattern = patterns[round_index % len(patterns)]
      x = random_inputs(rng, r, num_tokens, hidden, jnp.bfloat16)
      idx = make_routing(rng, r, num_tokens, num_topk, num_experts, pattern)
      w = rng.random((r, num_tokens, num_topk)).astype(np.float32)
      a = (1 + 0.1 * rng.standard_normal((num_experts, hidden))).astype(np.float32)
      cot = rng.standard_normal((r, num_tokens, hidden)).astype(np.float32)
      outs = [self.to_numpy(o) for o in step(*self.shard(group, x, idx, w, a, cot))]
      expected = oracle.dispatch(x, idx, num_experts, group.capacity)
      where = f"round {round_index} ({pattern})"
      for d in self.local_ranks(group):
        np.testing.assert_array_equal(used_rows(outs[0][d], expected[d]["group_sizes"]),
                                      used_rows(expected[d]["recv_x"], expected[d]["group_sizes"]),
                                      err_msg=f"{where}, rank {d}")
        np.testing.assert_array_equal(outs[1][d], expected[d]["group_sizes"])
      want = [np.asarray(g, np.float64) for g in dense_grads(x.astype(np.float32), w, a, idx, cot)]
      got = [np.asarray(g, np.float64) for g in outs[2:]]
      want[2], got[2] = (g.reshape(r, -1, hidden) for g in (want[2], got[2]))
      for name, g, v in zip(("x", "topk_weights", "expert scales"), got, want):
        # A few bf16 roundings per element (the cotangent, the weighted rows, the products).
        assert_close(g[mine], v[mine], rtol=3e-2, atol=1e-2 * (np.abs(v).max() + 1e-30),
                     what=f"{where}: gradient w.r.t. {name}")
    group.check()


def _p2p_atomics_cells() -> list[str]:
  """Every cell of the host's GPU-to-GPU P2P atomics matrix ("X" on the diagonal, "OK" where
  supported), from `nvidia-smi topo -p2p a`; [] when nvidia-smi is missing or prints none."""
  try:
    out = subprocess.run(["nvidia-smi", "topo", "-p2p", "a"], capture_output=True, text=True,
                         timeout=60)
  except (OSError, subprocess.SubprocessError):
    return []
  rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("GPU")]
  # The header row names the columns ("GPU0 GPU1 ..."); the matrix rows start with one name.
  return [cell for row in rows if len(row) > 1 and not row[1].startswith("GPU")
          for cell in row[1:]]


WORKER = os.path.join(os.path.dirname(__file__), "mp_workers", "peer_fault_worker.py")


@pytest.mark.skipif(jax.process_count() > 1, reason="starts its own processes")
@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_low_latency_decode_step_in_command_buffers(mode):
  """Two ranks sharing GPU 0: a jitted decode step of several low-latency layers inside XLA
  command buffers, 60 steps with changing routings, each checked against the oracle."""
  run_graph_worker(mode, 2)


@pytest.mark.skipif(jax.process_count() > 1, reason="starts its own processes")
@pytest.mark.parametrize("mode", ["skip_call", "skip_call_debug", "mismatch",
                                  "skip_low_latency"])
def test_fault_cases_fail_fast(mode):
  """One rank skips a dispatch: with the defaults the watchdog logs the timeout and check()
  and the next call raise it; in the debug mode the op raises; either way naming op, rank and
  peer, and every process exits (no hang). Mismatched configurations fail at group creation."""
  env = dict(os.environ)
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", "2", "--share-gpu", "--grace", "30",
         "--timeout", "120", "--", sys.executable, WORKER, mode]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
  log = result.stdout + result.stderr
  assert result.returncode == 0, log
  if mode == "skip_call":
    assert "check() raised after" in log and "next call failed" in log, log
    # Logged by the watchdog, raised by check(), and the text of the next call's failure.
    assert log.count("jax_ep.dispatch: rank 0 timed out after 2.0 s waiting for rank 1") >= 3, log
  elif mode == "skip_low_latency":
    assert "check() raised after" in log, log
    assert log.count("jax_ep.low_latency_dispatch: rank 0 timed out after 2.0 s waiting for "
                     "rank 1") >= 2, log
  elif mode == "skip_call_debug":
    assert "raised after" in log and "rank 0 timed out" in log and "rank 1" in log, log
  else:
    assert log.count("field 'hidden'") == 2, log


@pytest.mark.skipif(jax.process_count() > 1, reason="single-process path")
def test_single_process_pointer_table_on_one_gpu():
  """The one-process-all-GPUs path, as far as one GPU allows: two ranks' buffers on device 0,
  connected locally; every rank's table lists the same buffers in rank order."""
  from jax_ep._native import ffi as _ffi
  ext = _ffi.extension()
  args = dict(num_ranks=2, num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
              itemsize=2, capacity=64, num_sms=2, timeout_s=1.0)
  ids = [ext.group_create(0, rank, *args.values()) for rank in range(2)]
  try:
    assert ext.group_pointer_table(ids[0]) == []  # nothing before connect
    ext.group_connect_local(ids)
    tables = [ext.group_pointer_table(i) for i in ids]
    assert tables[0] == tables[1] and len(tables[0]) == 2
    assert tables[0][0] != tables[0][1] and all(p != 0 for p in tables[0])
    assert ext.group_error(ids[0]) is None
  finally:
    for i in ids:
      ext.group_destroy(i)
