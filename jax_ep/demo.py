"""`python -m jax_ep.demo`: train a small expert-parallel MoE layer, check it against a dense one.

Uses every device it finds (`jax.devices()`) as one EP rank each; on a CPU it asks XLA for 8 host
devices (`--xla_force_host_platform_device_count=8`) unless `XLA_FLAGS` already sets a count.
Sizes: `R` = device count, `E` = a multiple of `R` that is at least `max(2R, 8)`, `K` = 2,
`H` = 256, `F` = 512, `T` = 64 tokens per rank, bf16 activations and expert weights, float32
router.

Each step computes `loss = mean((moe_mlp(x) - target)^2)` and its gradients w.r.t. every parameter
under `jax.jit` and applies Adam (optax, when installed) or plain SGD. At the first and the last
step the loss and the gradients are checked against `jax_ep.testing.dense.dense_moe_layer` run on
the same parameters with no sharding and no communication; the demo exits 1 if they differ by
more than the tolerance. It ends with a table of the configuration, the median step time and the
errors.

Flags: `--steps N` (default 5), `--backend {auto,reference,cuda}` (default auto), `--lr`.
Exit status: 0 when every check passed, 1 otherwise (the reason is printed on stderr).
"""

from __future__ import annotations

import os

# Before jax creates its backends: 8 host devices stand in for 8 EP ranks on a CPU (the flag only
# affects the host platform, so it is harmless on GPUs). The backends are created lazily, on the
# first `jax.devices()`, so setting it here is early enough even after `import jax`.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.layer import MoEParams  # noqa: E402
from jax_ep.testing.dense import dense_moe_layer  # noqa: E402

NUM_TOPK, HIDDEN, FFN, TOKENS_PER_RANK = 2, 256, 512, 64
DTYPE = jnp.bfloat16
# Max relative error allowed between the expert-parallel and the dense model, for the loss and for
# each gradient (max |g - g_dense| / max |g_dense|). Both sides run the same bf16 math in a
# different order (EP: grouped matmuls over dispatched rows; dense: every expert on every token),
# so they differ by bf16 roundings only. Measured on an 8-device CPU (reference backend):
# loss ~2e-7, router gradient ~1e-4, expert-weight gradients ~3e-3 (about one bf16 ulp of the
# largest entry). The bounds leave >10x margin for other backends' summation orders while still
# catching any routing, weighting or gradient-path error (those are O(1)).
LOSS_TOL = 1e-3
GRAD_TOL = 5e-2


def num_experts_for(num_ranks: int) -> int:
  """Smallest multiple of `num_ranks` that is at least `max(2 * num_ranks, 8)`."""
  want = max(2 * num_ranks, 8)
  return -(-want // num_ranks) * num_ranks


def _make_optimizer(learning_rate: float | None):
  """`(init, update, name, lr)`: optax Adam (default lr 3e-3) when optax is installed, else plain
  SGD (default lr 1.0). Updates are computed in float32 and cast back to each param's dtype."""
  try:
    import optax
  except ImportError:
    lr = 1.0 if learning_rate is None else learning_rate

    def sgd_init(params):
      return ()

    def sgd_update(grads, state, params):
      new = jax.tree.map(
          lambda p, g: (p.astype(jnp.float32) - lr * g.astype(jnp.float32)).astype(p.dtype),
          params, grads)
      return new, state
    return sgd_init, sgd_update, "sgd", lr
  lr = 3e-3 if learning_rate is None else learning_rate
  tx = optax.adam(lr)

  def update(grads, state, params):
    # Adam moments in float32 (bf16 moments lose small updates), params kept in their dtype.
    grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    updates, state = tx.update(grads32, state, params32)
    new = jax.tree.map(lambda p, u: (p.astype(jnp.float32) + u).astype(p.dtype), params, updates)
    return new, state

  def init(params):
    return tx.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
  return init, update, "adam (optax)", lr


def _mse(out, target):
  return jnp.mean(jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)))


def _host(tree):
  """A numpy copy of a pytree (drops the sharding: the dense model sees plain arrays)."""
  return jax.tree.map(np.asarray, tree)


def _errors(loss, grads, dense_loss, dense_grads):
  """`(loss relative error, {param: gradient relative error})`."""
  loss_err = abs(float(loss) - float(dense_loss)) / max(abs(float(dense_loss)), 1e-30)
  grad_err = {}
  for name, g, d in zip(MoEParams._fields, grads, dense_grads):
    if g is None:  # a field this layer does not have
      continue
    g, d = np.asarray(g, np.float32), np.asarray(d, np.float32)
    grad_err[name] = float(np.abs(g - d).max() / max(np.abs(d).max(), 1e-30))
  return loss_err, grad_err


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_ep.demo", description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
  parser.add_argument("--backend", choices=("auto", "reference", "cuda"), default="auto",
                      help="jax_ep backend (default auto: cuda on GPUs with the extension built)")
  parser.add_argument("--lr", type=float, default=None,
                      help="learning rate (default 3e-3 for Adam, 1.0 for the SGD fallback)")
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error("--steps must be >= 1")

  devices = jax.devices()
  num_ranks = len(devices)
  num_experts = num_experts_for(num_ranks)
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=devices)
  try:
    group = jax_ep.Group(mesh, "ep", num_experts=num_experts, num_topk=NUM_TOPK, hidden=HIDDEN,
                         max_tokens_per_rank=TOKENS_PER_RANK, dtype=DTYPE, backend=args.backend)
  except Exception as e:  # e.g. --backend cuda without GPUs or without the built extension
    print(f"jax_ep.demo: FAILED to create the EP group with backend={args.backend!r}: "
          f"{type(e).__name__}: {e}", file=sys.stderr)
    return 1

  k_params, k_x, k_target = jax.random.split(jax.random.key(0), 3)
  params = jax_ep.init_moe_params(k_params, num_experts=num_experts, hidden=HIDDEN, ffn=FFN,
                                  dtype=DTYPE)
  num_tokens = num_ranks * TOKENS_PER_RANK
  x = jax.random.normal(k_x, (num_tokens, HIDDEN), jnp.float32).astype(DTYPE)
  target = (0.5 * jax.random.normal(k_target, (num_tokens, HIDDEN), jnp.float32)).astype(DTYPE)
  # Lay everything out once: tokens split over the EP axis, experts split, router replicated.
  specs = jax_ep.layer.param_specs("ep", params)
  params = MoEParams(*(None if p is None else group.constrain(p, s)
                       for p, s in zip(params, specs)))
  tokens = jax.sharding.PartitionSpec("ep")
  x_s, target_s = group.constrain(x, tokens), group.constrain(target, tokens)

  def loss_fn(params, x, target):
    result = jax_ep.moe_mlp(group, params, x)
    return _mse(result.out, target), result.num_dropped

  opt_init, opt_update, opt_name, lr = _make_optimizer(args.lr)

  @jax.jit
  def train_step(params, opt_state, x, target):
    (loss, num_dropped), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, target)
    new_params, opt_state = opt_update(grads, opt_state, params)
    return new_params, opt_state, loss, grads, num_dropped

  def dense_loss_fn(params, x, target):
    return _mse(dense_moe_layer(params, x, NUM_TOPK), target)

  dense_step = jax.jit(jax.value_and_grad(dense_loss_fn))
  x_host, target_host = np.asarray(x), np.asarray(target)

  # Leaves the optimizer creates from nothing (Adam's step count) land on one device; put them on
  # the mesh like the outputs of `train_step`, or the second step would compile again.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  opt_state = jax.tree.map(
      lambda a: a if isinstance(a.sharding, jax.sharding.NamedSharding)
      else jax.device_put(a, replicated), opt_init(params))
  losses, times, checks = [], [], []
  for step in range(args.steps):
    checked = step in (0, args.steps - 1)
    before = _host(params) if checked else None
    start = time.perf_counter()
    params, opt_state, loss, grads, num_dropped = train_step(params, opt_state, x_s, target_s)
    jax.block_until_ready((params, opt_state, loss, grads))
    times.append(time.perf_counter() - start)
    losses.append(float(loss))
    if int(np.asarray(num_dropped).sum()):
      print(f"jax_ep.demo: FAILED: step {step} dropped {np.asarray(num_dropped)} rows per rank "
            f"with the default (never-dropping) capacity", file=sys.stderr)
      return 1
    if checked:
      dense_loss, dense_grads = dense_step(MoEParams(*before), x_host, target_host)
      loss_err, grad_err = _errors(loss, grads, dense_loss, dense_grads)
      checks.append((step, loss_err, grad_err))
      print(f"step {step}: loss {float(loss):.6f} (dense {float(dense_loss):.6f}, rel err "
            f"{loss_err:.2e}); grad rel err " +
            ", ".join(f"{k} {v:.2e}" for k, v in grad_err.items()))
      # `not err <= tol` so that NaN errors fail too.
      bad = [f"loss {loss_err:.3e} > {LOSS_TOL}"] if not loss_err <= LOSS_TOL else []
      bad += [f"d{k} {v:.3e} > {GRAD_TOL}" for k, v in grad_err.items() if not v <= GRAD_TOL]
      if bad:
        print(f"jax_ep.demo: FAILED: step {step}: the expert-parallel layer disagrees with the "
              f"dense model: {'; '.join(bad)}", file=sys.stderr)
        return 1
    else:
      print(f"step {step}: loss {float(loss):.6f}")

  compiles = getattr(train_step, "_cache_size", lambda: 1)()
  if compiles > 1:  # then the timings below include a compilation
    print(f"jax_ep.demo: warning: train_step compiled {compiles} times", file=sys.stderr)
  timed = times[1:] if len(times) > 1 else times
  max_grad_err = max(max(g.values()) for _, _, g in checks)
  max_loss_err = max(l for _, l, _ in checks)
  platforms = sorted({d.platform for d in devices})
  rows = [
      ("backend", group.backend_name),
      ("devices", f"{num_ranks} x {'/'.join(platforms)} ({devices[0].device_kind})"),
      ("R / E / K / H / F / T", f"{num_ranks} / {num_experts} / {NUM_TOPK} / {HIDDEN} / {FFN} / "
                                f"{TOKENS_PER_RANK}"),
      ("dtype", f"{np.dtype(DTYPE).name} activations+experts, float32 router"),
      ("optimizer", f"{opt_name}, lr {lr:g}, {args.steps} steps"),
      ("median step time", f"{1e3 * float(np.median(timed)):.1f} ms "
                           f"(compile step {1e3 * times[0]:.0f} ms)"),
      ("loss first -> last", f"{losses[0]:.6f} -> {losses[-1]:.6f}"),
      ("max loss rel err", f"{max_loss_err:.2e} (tol {LOSS_TOL:g}, steps "
                           f"{', '.join(str(s) for s, _, _ in checks)})"),
      ("max grad rel err", f"{max_grad_err:.2e} (tol {GRAD_TOL:g})"),
  ]
  width = max(len(k) for k, _ in rows)
  print("\njax_ep demo: expert-parallel MoE training vs dense reference")
  print("-" * (width + 50))
  for k, v in rows:
    print(f"{k:<{width}}  {v}")
  print("-" * (width + 50))
  print("PASSED")
  return 0


if __name__ == "__main__":
  sys.exit(main())
