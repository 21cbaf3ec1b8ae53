"""A small dispatch/combine/grad/vmap round on the cuda backend, for compute-sanitizer: rows in
the activations' dtype, then fp8 rows (the fp8 dispatch's kernel: quantised, and given).

  compute-sanitizer --tool memcheck python scripts/sanitize_local.py
Exits non-zero if the results differ from the reference backend.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.testing import oracle


def run(backend, x, idx, w, eo):
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=40, num_topk=6, hidden=136,
                       max_tokens_per_rank=37, dtype=jnp.bfloat16, capacity=150,
                       backend=backend)

  def per_token_set(x, idx, w, eo):
    recv, handle = jax_ep.dispatch(group, x, idx, w)
    out = jax_ep.combine(group, eo, handle)
    grads = jax.grad(lambda x, w, eo: jnp.sum(
        jax_ep.combine(group, eo + jax_ep.dispatch(group, x, idx, w)[0].x, handle)
        .astype(jnp.float32) ** 2), argnums=(0, 1, 2))(x, w, eo)
    return recv, out, grads

  f = jax.shard_map(jax.vmap(per_token_set), mesh=mesh, in_specs=P(), out_specs=P(),
                    check_vma=False)
  return jax.tree.map(np.asarray, jax.jit(f)(x, idx, w, eo))


def run_fp8(x, idx, w):
  """The fp8 dispatch (UE8M0 scales) under vmap, quantised by the kernel and given as e4m3 rows
  with their scales, and the gradient through dequantize and combine."""
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=40, num_topk=6, hidden=512,
                       max_tokens_per_rank=37, dtype=jnp.bfloat16, capacity=150,
                       backend="cuda", wire_format="fp8_ue8m0")

  def per_token_set(x, idx, w):
    recv, handle = jax_ep.dispatch(group, x, idx, w)
    q, scales = jax_ep.quantize(x, "fp8_ue8m0")
    given, _ = jax_ep.dispatch(group, q, idx, w, x_scales=scales)
    def loss(x):
      rows, handle = jax_ep.dispatch(group, x, idx, w)
      out = jax_ep.combine(group, jax_ep.dequantize(rows.x, rows.scales), handle)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    del handle
    return recv, given, jax.grad(loss)(x)

  f = jax.shard_map(jax.vmap(per_token_set), mesh=mesh, in_specs=P(), out_specs=P(),
                    check_vma=False)
  out = jax.tree.map(np.asarray, jax.jit(f)(x, idx, w))
  group.close()
  return out


def main():
  rng = np.random.default_rng(0)
  b = 2
  x = jnp.asarray(rng.standard_normal((b, 37, 136)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(-2, 42, (b, 37, 6)), jnp.int32)
  w = jnp.asarray(rng.random((b, 37, 6)), jnp.float32)
  eo = jnp.asarray(rng.standard_normal((b, 150, 136)), jnp.bfloat16)
  cuda = run("cuda", x, idx, w, eo)
  ref = run("reference", x, idx, w, eo)
  np.testing.assert_array_equal(cuda[0].x, ref[0].x)
  np.testing.assert_array_equal(cuda[0].group_sizes, ref[0].group_sizes)
  np.testing.assert_array_equal(cuda[0].num_dropped, ref[0].num_dropped)
  for got, want in zip(jax.tree.leaves(cuda[1:]), jax.tree.leaves(ref[1:])):
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=3e-2,
                               atol=3e-2 * max(1.0, float(np.abs(want.astype(np.float32)).max())))
  print("sanitize_local: cuda matches reference (dispatch, combine, grads, vmap)")

  x8 = jnp.asarray(rng.standard_normal((b, 37, 512)), jnp.bfloat16)
  recv, given, grad = run_fp8(x8, idx, w)
  for i in range(b):
    want = oracle.fp8_dispatch(np.asarray(x8[i])[None], np.asarray(idx[i])[None], 40, 150,
                               round_scale=True, ue8m0=True)[0]
    n = int(want["group_sizes"].sum())
    for got in (recv, given):
      np.testing.assert_array_equal(got.group_sizes[i], want["group_sizes"])
      np.testing.assert_array_equal(got.x[i][:n].astype(np.float32),
                                    want["recv_x"][:n].astype(np.float32))
      np.testing.assert_array_equal(got.scales[i][:n], want["scales"][:n])
  assert np.isfinite(grad.astype(np.float32)).all() and np.abs(grad.astype(np.float32)).sum() > 0
  print("sanitize_local: the fp8 dispatch matches the closed form (quantised, given, vmap, grad)")


if __name__ == "__main__":
  main()
