"""`CommOptions`, the transports' settings: checked once where a group is made, carried by the
registry's request to the backend, bounded by the kernels' own constant; and the registry as the
one place the public API learns a backend's memory."""

import dataclasses
import pathlib
import re

import jax.numpy as jnp
import pytest

import jax_ep
from ep_test_base import rank_mesh
from jax_ep._native import ffi, limits
from jax_ep.backends import registry
from jax_ep.backends.options import CommOptions, OwnStream
from jax_ep.sizing import check_configuration

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_max_num_sms_is_the_kernels_constant():
  header = (REPO / "ffi" / "kernels" / "ep_common.h").read_text()
  native = int(re.search(r"kMaxNumSms\s*=\s*(\d+)", header).group(1))
  assert limits.MAX_NUM_SMS == native
  table = limits.kernel_limits()
  if table is not None:  # where the extension is built, its table says the same
    assert table.max_num_sms == native


@pytest.mark.parametrize("settings,error,message", [
    (dict(num_sms=0), ValueError, "num_sms must be positive, got 0"),
    (dict(num_sms=limits.MAX_NUM_SMS + 1), ValueError,
     f"num_sms must be <= {limits.MAX_NUM_SMS} .*got {limits.MAX_NUM_SMS + 1}"),
    (dict(num_sms=True), TypeError, "num_sms must be an int"),
    (dict(timeout_s=0), ValueError, "timeout_s must be a positive number of seconds, got 0.0"),
    (dict(timeout_s="soon"), TypeError, "timeout_s must be a number of seconds, got 'soon'"),
    (dict(config_timeout_s=-1.0), ValueError, "config_timeout_s must be a positive number"),
])
def test_bad_options_are_named(settings, error, message):
  with pytest.raises(error, match=f"jax_ep.Group: {message}"):
    CommOptions.checked(**settings)
  with pytest.raises(error, match=f"jax_ep.Group: {message}"):
    jax_ep.Group(rank_mesh(2), "ep", num_experts=8, num_topk=2, hidden=64,
                 max_tokens_per_rank=4, backend="reference", **settings)


def test_the_group_carries_its_options_to_the_backend(monkeypatch):
  seen = []
  entry = registry.BACKENDS["reference"]

  def create(request):
    seen.append(request)
    return entry.create(request)

  monkeypatch.setitem(registry.BACKENDS, "reference", dataclasses.replace(entry, create=create))
  group = jax_ep.Group(rank_mesh(2), "ep", num_experts=8, num_topk=2, hidden=64,
                       max_tokens_per_rank=4, backend="reference", num_sms=7, timeout_s=5,
                       config_timeout_s=9, raise_on_timeout=True)
  want = CommOptions(num_sms=7, timeout_s=5.0, config_timeout_s=9.0, raise_on_timeout=True)
  assert group.options == want
  assert [r.options for r in seen] == [want]


@pytest.mark.parametrize("comm_stream,num_sms,stream", [
    (None, 24, None), (2, 24, 2), ("jax_ep", 24, OwnStream(24)), ("jax_ep", 132, OwnStream(132)),
])
def test_the_ops_stream_carries_the_sm_budget_on_jax_eps_own(comm_stream, num_sms, stream):
  # What the cuda backend's ops are given (`cuda_ops`' `stream`): on jax_ep's own stream the
  # SMs its handlers size every grid to; XLA's streams keep the compute stream's grids.
  options = CommOptions.checked(comm_stream=comm_stream, num_sms=num_sms)
  assert options.stream == stream


@pytest.mark.parametrize("backend", sorted(registry.BACKENDS))
@pytest.mark.parametrize("low_latency,network,num_hosts", [(False, False, 0), (True, False, 0),
                                                           (True, True, 2)])
def test_memory_bytes_asks_the_registry(backend, low_latency, network, num_hosts):
  kwargs = dict(num_ranks=4, num_experts=16, num_topk=2, hidden=128, max_tokens_per_rank=32,
                dtype=jnp.bfloat16)
  est = jax_ep.memory_bytes(**kwargs, backend=backend, low_latency=low_latency,
                            network=network, num_hosts=num_hosts)
  config = check_configuration("test", "ep", **kwargs, capacity=None, buffer_factor=None,
                               expert_alignment=1)
  buffers = registry.BACKENDS[backend].memory(config, low_latency=low_latency, network=network,
                                              num_hosts=num_hosts)
  assert (est.workspace_bytes, est.comm_buffer_bytes, est.low_latency_buffer_bytes) == (
      buffers.workspace_bytes, buffers.comm_buffer_bytes, buffers.low_latency_buffer_bytes)
  if backend == "reference" or ffi.extension() is None:  # sized by the extension's own rule
    assert est.comm_buffer_bytes == est.low_latency_buffer_bytes == 0
  else:
    assert est.comm_buffer_bytes > 0 and (est.low_latency_buffer_bytes > 0) == low_latency


def test_memory_bytes_names_the_registrys_backends():
  with pytest.raises(ValueError, match=r"backend must be 'reference' or 'cuda' .* got 'cdua'"):
    jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=64,
                        max_tokens_per_rank=4, backend="cdua")
