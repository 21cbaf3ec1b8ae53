"""A decoder-only mixture-of-experts transformer in Flax NNX on jax_ep, end to end.

Trains on sequences of a random Markov chain (so the best possible loss, the chain's entropy
rate, is known), saves and restores the model and the optimizer with orbax, then decodes
greedily with a KV cache and scores the tokens it picks against the chain's most likely
successors. What it shows:

- a 2-D ('data', 'expert') mesh: attention and the dense layers data-parallel over every device,
  the experts split over 'expert' (`jax_ep.nnx.MoE`), each device's tokens its own;
- mixed precision: float32 parameters, bfloat16 compute (the jax_ep group's dtype), float32
  logits and loss;
- Flax's scan over layers: the blocks built under `nnx.vmap`, run under `nnx.scan`, each
  block rematerialised (`nnx.remat`);
- AdamW (optax), one compiled training step that never compiles again;
- an orbax checkpoint, restored bit-exactly into a model built abstractly;
- greedy decode in one compiled program: a prefill of the prompts through the training path,
  then a `jax.lax.fori_loop` of one token per sequence through the same module with
  `mode="low_latency"` (jax_ep's decode pair; the cuda kernels on GPUs, the reference
  elsewhere) on a KV cache.

Runs on a CPU (8 host devices stand in for 8 GPUs) in about a minute at its default size, and
unchanged on GPUs (one or several: `--mesh` picks the shape, the cuda backend where it is
built)::

  python examples/moe_transformer.py                   # default size
  python examples/moe_transformer.py --config small    # the configuration CI runs
  python examples/moe_transformer.py --compilation-cache /tmp/jax_cache   # compile once
  python examples/moe_transformer.py --fp8             # the experts in FP8
  python examples/moe_transformer.py --micro-batches 2 --comm-stream jax_ep
      # each layer's tokens in two micro-batches, one's dispatch and combine beside the
      # other's experts on jax_ep's own stream (cuda backend)

The first step's time is printed apart from the others: it is mostly compilation, which JAX's
persistent compilation cache saves from the second run on (`--compilation-cache DIR`, or the
environment variable `JAX_COMPILATION_CACHE_DIR=DIR`). Exit status 0 when the loss fell, the
restored model matches and decode ran; 1 otherwise (the reason on stderr).
"""

from __future__ import annotations

import os
import time

STARTED = time.perf_counter()  # imports (jax_ep's loads its CUDA extension) count from here

# Before jax creates its backends: 8 host devices stand in for 8 GPUs on a CPU (the flag only
# touches the host platform, so it changes nothing on GPUs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.experts import compile_ahead  # noqa: E402
from jax_ep.nnx import MoE  # noqa: E402

COMPUTE = jnp.bfloat16  # activations and matmuls; parameters are float32


class CompileClock:
  """Where a first call's time goes, from jax's monitoring events: tracing to a jaxpr (the
  outermost trace holds the nested ones, so the longest), lowering to StableHLO, and XLA's
  compilation (or, with the persistent compilation cache, loading it: `cache_hits`). Only
  this thread's events count: jax_ep compiles its kernels ahead on threads of its own
  (jax_ep/experts/compile_ahead.py), beside the step's own trace and compile, not in line."""

  EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
            "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
            "/jax/core/compile/backend_compile_duration": "compile"}

  def __init__(self):
    self.thread = threading.get_ident()
    self.spent = dict.fromkeys(("trace", "lower", "compile"), 0.0)
    self.cache_hits = 0
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)

  def _duration(self, event, seconds, **_):
    if threading.get_ident() != self.thread:
      return
    name = self.EVENTS.get(event)
    if name == "trace":
      self.spent[name] = max(self.spent[name], seconds)
    elif name:
      self.spent[name] += seconds

  def _event(self, event, **_):
    if threading.get_ident() != self.thread:
      return
    self.cache_hits += event == "/jax/compilation_cache/cache_hits"

  def reset(self):
    self.spent = dict.fromkeys(self.spent, 0.0)
    self.cache_hits = 0

  def report(self, total: float) -> str:
    rest = total - sum(self.spent.values())
    cached = f", {self.cache_hits} from the persistent cache" if self.cache_hits else ""
    # jax_ep's kernels compiled ahead so far (on Hopper GPUs), and those still compiling: they
    # share the CPU (and the GIL, while they lower) with the steps that follow.
    ahead = compile_ahead.pending()
    busy = sum(not f.done() for f in ahead)
    kernels = (f", {len(ahead)} jax_ep kernels compiled ahead ({busy} still compiling)"
               if ahead else "")
    return (f"trace {self.spent['trace']:.1f} s, lower {self.spent['lower']:.1f} s, "
            f"XLA compile {self.spent['compile']:.1f} s{cached}, run and the rest {rest:.1f} s"
            f"{kernels}")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  seq_len: int = 64            # training sequences, tokens
  batch: int = 32              # training sequences per step, over all devices
  hidden: int = 128
  heads: int = 4
  layers: int = 2
  experts: int = 8
  topk: int = 2
  ffn: int = 256               # each expert's inner size
  successors: int = 3          # tokens each token of the chain may be followed by
  steps: int = 100
  lr: float = 3e-3
  aux_coef: float = 1e-2       # the load-balancing loss's weight
  decode_batch: int = 8        # sequences decoded together (rounded up to the device count)
  prompt_len: int = 8
  decode_len: int = 24
  fp8: bool = False            # the experts in FP8, DeepSeek-V3's recipe (training calls)
  micro_batches: int = 1       # the MoE's micro-batches (training calls)


CONFIGS = {
    "default": Config(),
    "small": Config(vocab=32, seq_len=32, batch=16, hidden=64, heads=2, ffn=128, steps=40,
                    lr=1e-2, prompt_len=4, decode_len=8),
}


# ----------------------------------------------------------------------------- data
def markov_chain(vocab: int, successors: int, seed: int):
  """A first-order chain in which each token is followed by one of a few others, the first of
  them most often: `(transition [V, V], entropy rate in nats)`."""
  rng = np.random.default_rng(seed)
  weights = 0.5 ** np.arange(successors)  # 1, 1/2, 1/4, ...: a clear most likely successor
  transition = np.zeros((vocab, vocab))
  for token in range(vocab):
    transition[token, rng.choice(vocab, successors, replace=False)] = weights / weights.sum()
  stationary = np.full(vocab, 1.0 / vocab)
  for _ in range(1000):
    stationary = stationary @ transition
  row_entropy = -np.sum(transition * np.log(np.where(transition > 0, transition, 1.0)), axis=1)
  return transition, float(stationary @ row_entropy)


def sample(rng, transition, num_sequences: int, length: int):
  """`[num_sequences, length]` int32 walks of the chain from uniformly drawn first tokens."""
  vocab = transition.shape[0]
  cumulative = np.cumsum(transition, axis=1)
  tokens = np.empty((num_sequences, length), np.int32)
  tokens[:, 0] = rng.integers(vocab, size=num_sequences)
  for t in range(1, length):
    u = rng.random((num_sequences, 1))
    tokens[:, t] = np.minimum((u > cumulative[tokens[:, t - 1]]).sum(1), vocab - 1)
  return tokens


# ----------------------------------------------------------------------------- model
class Attention(nnx.Module):
  """Causal multi-head self-attention; with a KV cache for decode."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=COMPUTE,
                               param_dtype=jnp.float32, rngs=rngs)
    self.qkv = linear(cfg.hidden, 3 * cfg.hidden)
    self.out = linear(cfg.hidden, cfg.hidden)

  def __call__(self, x, cache, pos):
    """x `[B, S, H]` at positions `pos .. pos + S - 1`; cache None (attend within x) or
    `(keys, values)` `[B, max_len, heads, head_dim]`, written at those positions."""
    batch, length, hidden = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.heads, self.head_dim), 3,
                        axis=2)
    if cache is not None:
      k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, pos, 0, 0))
      v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, pos, 0, 0))
      cache = (k, v)
    visible = jnp.arange(k.shape[1])[None, :] <= (pos + jnp.arange(length))[:, None]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible, scores * self.head_dim ** -0.5, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(COMPUTE)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, hidden)
    return self.out(out), cache


class Block(nnx.Module):
  def __init__(self, cfg: Config, group, decode_group, rngs: nnx.Rngs):
    norm = functools.partial(nnx.RMSNorm, cfg.hidden, dtype=COMPUTE, param_dtype=jnp.float32,
                             rngs=rngs)
    self.attn_norm, self.moe_norm = norm(), norm()
    self.attn = Attention(cfg, rngs)
    self.moe = MoE(group, ffn=cfg.ffn, rngs=rngs, decode_group=decode_group, fp8=cfg.fp8,
                   micro_batches=cfg.micro_batches)

  def __call__(self, x, cache, pos, mode):
    h, cache = self.attn(self.attn_norm(x), cache, pos)
    x = x + h
    moe = self.moe(self.moe_norm(x), mode=mode, return_output=True)
    return x + moe.out, cache, jnp.mean(moe.aux_loss)


class Transformer(nnx.Module):
  def __init__(self, cfg: Config, group, decode_group, rngs: nnx.Rngs):
    embed = functools.partial(nnx.Embed, features=cfg.hidden, dtype=COMPUTE,
                              param_dtype=jnp.float32, rngs=rngs)
    self.embed = embed(cfg.vocab)
    self.position = embed(max(cfg.seq_len, cfg.prompt_len + cfg.decode_len))
    self.num_layers = cfg.layers

    # Flax's scan over layers: one Block's graph, its parameters stacked along a leading axis
    # of `layers` (each MoE's expert weights `[layers, E, H, F]`, split over 'expert').
    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def blocks(rngs):
      return Block(cfg, group, decode_group, rngs)

    self.blocks = blocks(rngs)
    self.norm = nnx.RMSNorm(cfg.hidden, dtype=COMPUTE, param_dtype=jnp.float32, rngs=rngs)
    self.head = nnx.Linear(cfg.hidden, cfg.vocab, use_bias=False, dtype=COMPUTE,
                           param_dtype=jnp.float32, rngs=rngs)

  def __call__(self, tokens, cache=None, pos=0, mode="high_throughput"):
    """tokens `[B, S]` at positions `pos ..`; cache None or `(keys, values)` stacked over the
    layers. Returns float32 logits `[B, S, V]`, the updated cache and the layers' mean
    load-balancing loss."""
    # The lookup's output is split as the tokens are: on Explicit mesh axes a gather from a
    # replicated table leaves that to the caller.
    table = self.embed.embedding[...].astype(COMPUTE)
    x = table.at[tokens].get(out_sharding=P(*jax.typeof(tokens).sharding.spec, None))
    x = x + self.position(pos + jnp.arange(tokens.shape[1]))

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    @nnx.remat
    def layers(carry, block, cache):
      x, aux = carry
      x, cache, layer_aux = block(x, cache, pos, mode)
      return (x, aux + layer_aux), cache

    (x, aux), cache = layers((x, jnp.zeros((), jnp.float32)), self.blocks, cache)
    logits = self.head(self.norm(x)).astype(jnp.float32)
    return logits, cache, aux / self.num_layers


# ----------------------------------------------------------------------------- steps
def loss_fn(model, tokens, aux_coef):
  logits, _, aux = model(tokens[:, :-1])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return nll + aux_coef * aux, nll


@functools.partial(nnx.jit, static_argnames=("aux_coef",))
def train_step(model, optimizer, tokens, aux_coef):
  (_, nll), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens, aux_coef)
  optimizer.update(model, grads)
  return nll


@nnx.jit
def eval_loss(model, tokens):
  return loss_fn(model, tokens, 0.0)[1]


@functools.partial(nnx.jit, static_argnames=("decode_len", "max_len"))
def generate(model, prompts, decode_len: int, max_len: int):
  """Greedy decode: `[B, P]` prompts -> `[B, decode_len]` tokens. The prompts go through the
  training path in one call (filling the cache), each next token through the decode path."""
  batch, prompt_len = prompts.shape
  cfg_layers, heads, head_dim = (model.num_layers, model.blocks.attn.heads,
                                 model.blocks.attn.head_dim)
  shape = (cfg_layers, batch, max_len, heads, head_dim)
  # Split over the devices as the sequences are (the layers' axis whole).
  sequences = jax.typeof(prompts).sharding.spec[0]
  cache = (jnp.zeros(shape, COMPUTE, out_sharding=P(None, sequences)),
           jnp.zeros(shape, COMPUTE, out_sharding=P(None, sequences)))
  logits, cache, _ = model(prompts, cache)
  first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
  out = jnp.zeros((batch, decode_len), jnp.int32, out_sharding=P(sequences)).at[:, 0].set(first)

  # nnx.fori_loop hands the module to each step (its nnx.scan over layers must see it at the
  # loop's trace level, which a jax.lax loop closing over it would not give).
  def step(i, carry):
    model, token, cache, out = carry
    logits, cache, _ = model(token[:, None], cache, prompt_len + i - 1, mode="low_latency")
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    return model, token, cache, out.at[:, i].set(token)

  return nnx.fori_loop(1, decode_len, step, (model, first, cache, out))[3]


# ----------------------------------------------------------------------------- main
def make_mesh(spec: str | None, num_experts: int):
  count = jax.device_count()
  if spec:
    data, expert = (int(n) for n in spec.lower().split("x"))
  else:  # two data replicas where there are enough devices, the rest splits the experts
    data = 2 if count >= 4 and count % 2 == 0 and num_experts % (count // 2) == 0 else 1
    expert = count // data
  if data * expert != count or num_experts % expert:
    raise SystemExit(f"--mesh {data}x{expert}: needs data * expert = {count} devices and "
                     f"expert dividing the {num_experts} experts")
  return jax.make_mesh((data, expert), ("data", "expert"))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", choices=sorted(CONFIGS), default="default")
  parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
  parser.add_argument("--mesh", help="DATAxEXPERT, e.g. 2x4 (default: 2 x devices/2, or 1x1)")
  parser.add_argument("--checkpoint-dir", help="where orbax writes (default: a temporary "
                      "directory, removed at the end)")
  parser.add_argument("--compilation-cache", metavar="DIR",
                      help="JAX's persistent compilation cache: a second run loads the "
                           "compiled programs instead of compiling them")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--fp8", action="store_true",
                      help="train the experts in FP8 (jax_ep.nnx.MoE(fp8=True); hidden and ffn "
                           "multiples of 128: the default config)")
  parser.add_argument("--fp8-weight-grads", choices=("fp8", "bf16"),
                      help="with --fp8: the experts' weight gradients in FP8 or bf16 "
                           "(jax_ep.experts.override(fp8_weight_grad=...); default: jax_ep's)")
  parser.add_argument("--experts-impl", choices=("auto", "mosaic", "xla"), default="auto",
                      help="the expert products: jax_ep's Mosaic GPU kernels where they run "
                           "(auto), or lax.ragged_dot (xla) (jax_ep.experts.override(impl=...))")
  parser.add_argument("--micro-batches", type=int, default=1,
                      help="split each MoE layer's tokens into this many micro-batches "
                           "(jax_ep.nnx.MoE(micro_batches=...))")
  parser.add_argument("--comm-stream", type=lambda v: v if v == "jax_ep" else int(v),
                      help="the training group's comm_stream: jax_ep (jax_ep's own stream, "
                           "the micro-batches in its pipeline) or N (XLA's stream N); "
                           "default: XLA's compute stream")
  args = parser.parse_args(argv)
  if args.fp8_weight_grads and not args.fp8:
    parser.error("--fp8-weight-grads needs --fp8")
  overrides = {"impl": args.experts_impl}
  if args.fp8_weight_grads:
    overrides["fp8_weight_grad"] = args.fp8_weight_grads == "fp8"
  with jax_ep.experts.override(**overrides):  # read where the steps are traced
    return run(args)


def run(args) -> int:
  cfg = dataclasses.replace(CONFIGS[args.config], micro_batches=args.micro_batches)
  if args.steps is not None:
    cfg = dataclasses.replace(cfg, steps=args.steps)
  if args.fp8:
    cfg = dataclasses.replace(cfg, fp8=True)
  if args.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

  clock = CompileClock()
  mesh = make_mesh(args.mesh, cfg.experts)
  num_devices = mesh.devices.size
  decode_batch = -(-cfg.decode_batch // num_devices) * num_devices
  if cfg.batch % num_devices:
    raise SystemExit(f"batch={cfg.batch} must split over the {num_devices} devices")
  group = jax_ep.Group(mesh, "expert", num_experts=cfg.experts, num_topk=cfg.topk,
                       hidden=cfg.hidden, dtype=COMPUTE, comm_stream=args.comm_stream,
                       max_tokens_per_rank=cfg.batch * cfg.seq_len // num_devices)
  # Decode passes one token per sequence: a group sized for that, with the low-latency buffers
  # the cuda kernels need (the reference backend allocates none).
  decode_group = jax_ep.Group(mesh, "expert", num_experts=cfg.experts, num_topk=cfg.topk,
                              hidden=cfg.hidden, max_tokens_per_rank=decode_batch // num_devices,
                              dtype=COMPUTE, low_latency=True)
  print(f"mesh {dict(mesh.shape)} of {num_devices} x {jax.devices()[0].platform}, jax_ep "
        f"backend {group.backend_name!r} ({group.backend_reason}); imports, devices and groups "
        f"{time.perf_counter() - STARTED:.1f} s")
  print(f"config {args.config}: {cfg}")
  if cfg.fp8:
    print("the experts' weight gradients in "
          f"{'fp8' if jax_ep.experts.configs.fp8_weight_grads() else 'bf16'}")

  def build():
    return Transformer(cfg, group, decode_group, nnx.Rngs(args.seed))

  # Everything created under the mesh: parameters without a sharding of their own (norms,
  # attention, embeddings) and the optimizer's counters are then replicated over it, as the
  # training step returns them, so the step compiles once.
  with jax.set_mesh(mesh):
    model = build()
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.lr, weight_decay=1e-2), wrt=nnx.Param)
  num_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"{num_params / 1e6:.2f} M parameters, {cfg.layers} layers of {cfg.experts} experts "
        f"(top-{cfg.topk}), float32 parameters, {jnp.dtype(COMPUTE).name} compute")

  transition, entropy = markov_chain(cfg.vocab, cfg.successors, args.seed)
  rng = np.random.default_rng(args.seed + 1)
  batch_sharding = NamedSharding(mesh, P(("data", "expert")))

  def batch(num_sequences, length):
    return jax.device_put(sample(rng, transition, num_sequences, length), batch_sharding)

  eval_tokens = batch(cfg.batch, cfg.seq_len + 1)  # held out: a fresh walk of the chain
  with jax.set_mesh(mesh):
    first_loss = float(eval_loss(model, eval_tokens))
  clock.reset()
  log_every = max(1, cfg.steps // 10)
  losses, times = [], []
  with jax.set_mesh(mesh):
    for step in range(cfg.steps):
      tokens = batch(cfg.batch, cfg.seq_len + 1)
      start = time.perf_counter()
      losses.append(float(train_step(model, optimizer, tokens, cfg.aux_coef)))
      times.append(time.perf_counter() - start)
      if step == 0:
        print(f"step    0  loss {losses[0]:.3f}  compile + first step {times[0]:.1f} s "
              f"({clock.report(times[0])})")
      elif (step + 1) % log_every == 0 or step + 1 == cfg.steps:
        recent = np.median(times[max(1, step + 1 - log_every):])
        dropped = int(np.asarray(model.blocks.moe.num_dropped[...]).sum())
        print(f"step {step + 1:4d}  loss {losses[-1]:.3f}  (floor {entropy:.3f})  "
              f"{recent * 1e3:.1f} ms/step  {cfg.batch * cfg.seq_len / recent:,.0f} tokens/s  "
              f"dropped rows {dropped}")
    final_loss = float(eval_loss(model, eval_tokens))

  failures = []
  if not final_loss < first_loss:
    failures.append(f"the loss did not fall: {first_loss:.3f} -> {final_loss:.3f}")
  print(f"loss {first_loss:.3f} -> {final_loss:.3f} (held-out batch; the chain's entropy rate "
        f"is {entropy:.3f})")

  # Checkpoint: model and optimizer state, restored into a model built without computing its
  # weights (nnx.eval_shape), laid out as the metadata says.
  with tempfile.TemporaryDirectory() as scratch:
    directory = pathlib.Path(args.checkpoint_dir or scratch).absolute() / "state"
    checkpointer = ocp.StandardCheckpointer()
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    checkpointer.save(directory, state, force=True)
    checkpointer.wait_until_finished()
    with jax.set_mesh(mesh):
      abstract_model = nnx.eval_shape(build)
      abstract_optimizer = nnx.eval_shape(
          lambda: nnx.Optimizer(abstract_model, optax.adamw(cfg.lr, weight_decay=1e-2),
                                wrt=nnx.Param))
      graphdef, abstract_state = nnx.split(abstract_model)
      abstract = {"model": abstract_state, "optimizer": nnx.state(abstract_optimizer)}
      abstract = jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.sharding), abstract,
          state)
      restored = checkpointer.restore(directory, abstract)
      checkpointer.close()
      restored_model = nnx.merge(graphdef, restored["model"])
      same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state),
                                                       jax.tree.leaves(restored)))
      same = same and float(eval_loss(restored_model, eval_tokens)) == final_loss
  print(f"checkpoint restored {'bit-exactly' if same else 'WITH DIFFERENCES'} "
        f"({len(jax.tree.leaves(state))} arrays)")
  if not same:
    failures.append("the restored model differs from the saved one")

  # Greedy decode from prompts drawn from the chain: each token picked should be the chain's
  # most likely successor of the one before it.
  prompts = batch(decode_batch, cfg.prompt_len)
  max_len = cfg.prompt_len + cfg.decode_len
  with jax.set_mesh(mesh):
    start = time.perf_counter()
    decoded = np.asarray(generate(restored_model, prompts, cfg.decode_len, max_len))
    first_decode = time.perf_counter() - start
    start = time.perf_counter()
    np.asarray(generate(restored_model, prompts, cfg.decode_len, max_len))
    decode_time = time.perf_counter() - start
  previous = np.concatenate([np.asarray(prompts)[:, -1:], decoded[:, :-1]], axis=1)
  accuracy = float(np.mean(decoded == np.argmax(transition, axis=1)[previous]))
  print(f"decode: {decode_batch} sequences x {cfg.decode_len} tokens, compile + first run "
        f"{first_decode:.1f} s, then {decode_time * 1e3:.1f} ms; "
        f"{accuracy:.1%} of the tokens are the chain's most likely successor")
  print(f"  prompt {np.asarray(prompts)[0].tolist()} -> {decoded[0].tolist()}")
  if not 0 <= decoded.min() and decoded.max() < cfg.vocab:
    failures.append("decode produced tokens outside the vocabulary")

  group.close()
  decode_group.close()
  for failure in failures:
    print(f"FAILED: {failure}", file=sys.stderr)
  print("PASSED" if not failures else "FAILED")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
