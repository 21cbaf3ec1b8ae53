"""The low-latency pair on the network transport: NVSHMEM puts between virtual hosts.

A group created with `virtual_hosts=k` splits its ranks into k hosts; a rank reaches the ranks
of its own host by pointer (the peer transport) and every other rank only by NVSHMEM puts, so
the shared low-latency suite checks the network path against the oracle. Runs under the
launcher, one process per rank (sharing one GPU under CUDA MPS, or one GPU each):

  JAX_EP_VIRTUAL_HOSTS=2 python -m jax_ep.launch -n 8 --share-gpu -- \
      python -m pytest tests/test_cuda_network.py -q          # 2 hosts x 4 ranks
  JAX_EP_VIRTUAL_HOSTS=4 python -m jax_ep.launch -n 8 --share-gpu -- \
      python -m pytest tests/test_cuda_network.py -q          # 4 hosts x 2 ranks

and, in one process, the tests that start their own processes (command buffers, a peer that
skips the call). Marked `gpu`: skipped where no CUDA GPU, extension or NVSHMEM module is present.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_test_base import EPTestBase, Target, random_inputs, rank_mesh, require_nvshmem
from low_latency_test_base import GRAPH_WORKER, CudaLowLatencyTests
from test_fp8_dispatch import FP8DispatchSuite

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

NUM_RANKS = jax.device_count()
VIRTUAL_HOSTS = int(os.environ.get("JAX_EP_VIRTUAL_HOSTS", "2"))
FAULT_WORKER = os.path.join(os.path.dirname(__file__), "mp_workers", "peer_fault_worker.py")

_on_network = (NUM_RANKS >= 2 and NUM_RANKS % VIRTUAL_HOSTS == 0 and VIRTUAL_HOSTS > 1
               and jax.process_count() == NUM_RANKS)
_why_not = (f"needs one process per rank under the launcher with R divisible by "
            f"JAX_EP_VIRTUAL_HOSTS={VIRTUAL_HOSTS} (R={NUM_RANKS}, "
            f"{jax.process_count()} processes)")

# Every rank of the job as VIRTUAL_HOSTS hosts: the ranks of another host only through NVSHMEM.
NETWORK = Target(
    "cuda backend's network transport", "cuda", rank_counts=(NUM_RANKS,), small_ranks=NUM_RANKS,
    group_options={"virtual_hosts": VIRTUAL_HOSTS}, require=require_nvshmem, fp8_exact=True,
    vmap_one_round=False,  # one round per batch element under vmap (documented)
    # The host group lays out each expert's rows as one group per source host
    # (docs/multihost.md).
    expert_alignment_refused="not implemented on the cuda backend's network transport")


@pytest.mark.skipif(not _on_network, reason=_why_not)
class TestNetworkLowLatency(CudaLowLatencyTests):
  target = NETWORK

  def test_ranks_of_other_hosts_take_the_network(self):
    """The ranks of the other virtual hosts have no pointer in this rank's table (so every row
    for them is a put), the ranks of its own host have one."""
    r = NUM_RANKS
    group = self.make_group(r, num_experts=4 * r, num_topk=2, hidden=256, max_tokens=4)
    me = jax.process_index()
    size = r // VIRTUAL_HOSTS
    host = me // size
    assert group.topology.num_hosts == VIRTUAL_HOSTS
    assert group.topology.gpus_per_host == (size,) * VIRTUAL_HOSTS
    others = tuple(q for q in range(r) if q // size != host)
    assert group.network_ranks == others
    table = jax_ep._native.ffi.extension().group_pointer_table(
        group._transport.primary_id)
    assert [q for q in range(r) if table[q] == 0] == list(others)
    group.close()

  def test_moe_layer_low_latency_matches_high_throughput(self):
    """The low-latency layer across virtual hosts against the high-throughput layer of a
    one-host group."""
    r, e, k, h, f, t = NUM_RANKS, 4 * NUM_RANKS, 4, 128, 64, 12
    network = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    one_host = self.closing(jax_ep.Group(rank_mesh(r), "ep", num_experts=e, num_topk=k,
                                         hidden=h, max_tokens_per_rank=t, dtype=jnp.bfloat16,
                                         backend="cuda", timeout_s=20.0))
    params = jax_ep.init_moe_params(jax.random.key(0), num_experts=e, hidden=h, ffn=f,
                                    dtype=jnp.bfloat16)
    per_rank = lambda w: np.asarray(w).reshape(r, e // r, *w.shape[1:])
    router = np.broadcast_to(np.asarray(params.router), (r, *params.router.shape))
    x = random_inputs(np.random.default_rng(4), r, t, h, jnp.bfloat16)
    weights = (x, router, per_rank(params.w_gate), per_rank(params.w_up), per_rank(params.w_down))

    def layer(group, mode):
      def fn(x, router, w_gate, w_up, w_down):
        p = params._replace(router=router, w_gate=w_gate, w_up=w_up, w_down=w_down)
        return jax_ep.moe_mlp_per_shard(group, p, x, mode=mode).out
      return self.run_per_rank(group, fn, *weights)
    ll = layer(network, "low_latency")
    ht = layer(one_host, "high_throughput")
    for d in self.local_ranks(network):
      scale = np.abs(ht[d].astype(np.float32)).max()
      assert scale > 0
      np.testing.assert_allclose(ll[d].astype(np.float32), ht[d].astype(np.float32),
                                 rtol=0, atol=3e-2 * scale)
    network.close()
    one_host.close()


@pytest.mark.skipif(not _on_network, reason=_why_not)
class TestNetworkOnCommStream(EPTestBase):
  """The shared high-throughput suite with the rail exchange and the host group's ops on XLA's
  additional stream 1 (`comm_stream=1`), the forwarding between them on the compute stream."""
  target = dataclasses.replace(NETWORK, name="cuda backend's network transport, comm_stream=1",
                               group_options={**NETWORK.group_options, "comm_stream": 1})


@pytest.mark.skipif(not _on_network, reason=_why_not)
class TestNetworkOnOwnStream(EPTestBase):
  """The shared high-throughput suite with the rail exchange and the host group's ops on
  jax_ep's own stream (`comm_stream="jax_ep"`), the forwarding between them on XLA's."""
  target = dataclasses.replace(NETWORK, name="cuda backend's network transport, own stream",
                               group_options={**NETWORK.group_options, "comm_stream": "jax_ep"})


@pytest.mark.skipif(not _on_network, reason=_why_not)
class TestNetworkHighThroughput(EPTestBase):
  """The shared high-throughput suite on virtual hosts: the rail exchange (NVSHMEM puts) to
  the same local index on every host, the host's own group forwarding
  (jax_ep/backends/hierarchical.py), against the oracle, gradients and fault-free reuse
  included."""
  target = NETWORK

  def test_group_spans_the_virtual_hosts(self):
    group = self.make_group(NUM_RANKS, num_experts=4 * NUM_RANKS, num_topk=2, hidden=128,
                            max_tokens=4, dtype=jnp.bfloat16)
    assert group.topology.num_hosts == VIRTUAL_HOSTS
    assert group.combine_partial_roundings == 2
    group.close()


@pytest.mark.skipif(not _on_network, reason=_why_not)
class TestNetworkFP8Dispatch(FP8DispatchSuite):
  """The fp8 dispatch across virtual hosts: each token quantised once on its rank by the
  kernels, its e4m3 row and scales over the rail exchange (NVSHMEM puts), then the host
  group's fp8 dispatch of them as given; rows and scales bit-exact against the closed form,
  the straight-through gradient through the combine across hosts."""
  target = NETWORK


def _launch(worker_args, num_ranks, virtual_hosts, timeout=250):
  env = dict(os.environ, JAX_EP_VIRTUAL_HOSTS=str(virtual_hosts))
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", str(num_ranks), "--share-gpu",
         "--grace", "30", "--timeout", str(timeout), "--", sys.executable, *worker_args]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 60)
  return result.returncode, result.stdout + result.stderr


@pytest.mark.skipif(jax.process_count() > 1, reason="starts its own processes")
@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_decode_step_in_command_buffers_across_hosts(mode):
  """Four ranks as two virtual hosts of two, sharing GPU 0: the jitted decode step of several
  low-latency layers inside XLA command buffers, 60 steps with changing routings, each checked
  against the oracle."""
  require_nvshmem()
  code, log = _launch([GRAPH_WORKER, mode], 4, 2)
  assert code == 0 and "60 steps ok" in log, log


@pytest.mark.skipif(jax.process_count() > 1, reason="starts its own processes")
def test_peer_that_skips_a_dispatch_is_a_timeout_in_the_rail_exchange():
  """Two ranks on two virtual hosts: rank 1 never calls dispatch; rank 0's rail exchange
  gives up after the group's timeout naming the op, rank and peer (no hang), and both exit."""
  require_nvshmem()
  code, log = _launch([FAULT_WORKER, "skip_call"], 2, 2, timeout=120)
  assert code == 0, log
  assert "check() raised after" in log and "next call failed" in log, log
  assert log.count("jax_ep.rail_exchange: rank 0 timed out after 2.0 s waiting for "
                   "rank 1") >= 2, log


@pytest.mark.skipif(jax.process_count() > 1, reason="starts its own processes")
def test_peer_that_skips_the_call_is_a_timeout_across_hosts():
  """Two ranks on two virtual hosts: rank 1 never calls low_latency_dispatch; rank 0's wait
  gives up after the group's timeout with the op, rank and peer (no hang), and both exit."""
  require_nvshmem()
  code, log = _launch([FAULT_WORKER, "skip_low_latency"], 2, 2, timeout=120)
  assert code == 0, log
  assert "check() raised after" in log, log
  assert log.count("jax_ep.low_latency_dispatch: rank 0 timed out after 2.0 s waiting for "
                   "rank 1") >= 2, log
