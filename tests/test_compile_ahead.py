"""`jax_ep.experts.compile_ahead` on the CPU: what it keys a kernel by, and that it compiles
nothing where programs are not compiled for Hopper GPUs. Its work on the H200's programs (one
module a kernel wherever traced, every kernel of the example compiled ahead) is in
tests/test_hopper_aot.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep.experts import compile_ahead


def _epilogue_of(activation: str):
  def epilogue(accs, _):
    return accs, activation
  return epilogue


def test_an_epilogue_made_again_is_the_same_key_and_another_activation_is_not():
  assert compile_ahead.code_key(_epilogue_of("silu")) == compile_ahead.code_key(
      _epilogue_of("silu"))
  assert compile_ahead.code_key(_epilogue_of("silu")) != compile_ahead.code_key(
      _epilogue_of("gelu"))
  assert compile_ahead.code_key(lambda a, _: a) != compile_ahead.code_key(
      _epilogue_of("silu"))


def test_nothing_is_compiled_ahead_off_hopper(monkeypatch):
  """On the CPU the kernels run interpreted (tests) or not at all: a traced kernel submits
  no compile, also where a test has the choice take the Hopper paths, and the grouped GEMM
  traces as before."""
  from jax_ep.experts import choice
  before = len(compile_ahead.pending())
  args = jnp.ones((8, 4)), jnp.ones((2, 4, 6)), jnp.array([3, 5], jnp.int32)
  assert compile_ahead.submit("key", lambda *a: a, args) is None
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  assert compile_ahead.submit("key", lambda *a: a, args) is None
  out = jax.jit(jax_ep.grouped_matmul)(*args)
  np.testing.assert_allclose(np.asarray(out), 4.0)
  assert len(compile_ahead.pending()) == before


def test_the_switch_is_an_override_field():
  with jax_ep.experts.override(compile_ahead=False):
    assert jax_ep.experts.configs.current().compile_ahead is False
  assert jax_ep.experts.configs.current().compile_ahead is None
  with pytest.raises(TypeError, match="compile_ahead"):
    with jax_ep.experts.override(compile_ahed=False):
      pass


def test_a_dump_variable_keeps_mosaic_gpus_own_modules(monkeypatch):
  for name in [k for k in os.environ if k.startswith("MOSAIC_GPU_DUMP")]:
    monkeypatch.delenv(name)
  assert not compile_ahead.dumping()
  monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
  assert compile_ahead.dumping()
  # Mosaic GPU dumps where the variable is set at all (`getenv(...) != nullptr`).
  monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "")
  assert compile_ahead.dumping()


def test_a_kernels_lowering_is_keyed_by_what_it_computes():
  """The lowering key's text of a jaxpr (`_plain`) drops what only the trace's context prints
  (shard_map's varying axes, a nested jit's context mesh, the line breaks they bring, the order
  of an effect set) and keeps every value and type the body computes with."""
  inside = """{ lambda ; a:i32[]{V:(data,expert)} b:Ref<gmem>{bf16[8,128]{V:expert}}. let
    c:i32[] = jit[
      name=_where
      ctx_mesh=Mesh('data': 1, 'expert': 1, axis_types=(Explicit, Explicit))
      jaxpr={ lambda ; d:i32[]. let e:i32[] = add d 1:i32[] in (e,) : { Read<b>, Write<b> } }
    ] a
  in (c,) }"""
  alone = """{ lambda ; a:i32[] b:Ref<gmem>{bf16[8,128]}. let
    c:i32[] = jit[name=_where jaxpr={ lambda ; d:i32[]. let
        e:i32[] = add d 1:i32[]
      in (e,) : { Write<b>, Read<b> } }] a
  in (c,) }"""
  assert compile_ahead._plain(inside) == compile_ahead._plain(alone)
  for other in (alone.replace("1:i32[]", "2:i32[]"), alone.replace("bf16[8,128]", "bf16[8,64]"),
                alone.replace("add", "sub")):
    assert compile_ahead._plain(other) != compile_ahead._plain(alone)


def test_equal_nested_jaxprs_print_alike_whether_or_not_they_are_one_object():
  """jax's printer names a nested jaxpr used twice and prints it once, by the object: a jit's
  cache gives one body one object in one context and two in two (a kernel's body traced in a
  program against alone). The key's text (`_printed`) prints each in place, the same either
  way, and still tells bodies that compute other things apart."""
  def remainder_of(divisor):
    def remainder(x):
      return x % divisor
    return remainder

  once = jax.jit(remainder_of(64))
  def shared(x):
    return once(once(x) + 1)

  def distinct(x):
    return jax.jit(remainder_of(64))(jax.jit(remainder_of(64))(x) + 1)

  def other(x):
    return jax.jit(remainder_of(64))(jax.jit(remainder_of(32))(x) + 1)

  x = jnp.int32(5)
  one, two, three = (jax.make_jaxpr(f)(x).jaxpr for f in (shared, distinct, other))
  assert one.pretty_print() != two.pretty_print()  # one definition named, against two
  assert compile_ahead._printed(one) == compile_ahead._printed(two)
  assert compile_ahead._printed(three) != compile_ahead._printed(two)
  # Printing in place is for the key alone: jax's own printing of the jaxpr is unchanged.
  compile_ahead._print_in_place()
  assert one.pretty_print() == jax.make_jaxpr(shared)(x).jaxpr.pretty_print()
  assert one.pretty_print().startswith("let remainder")


def test_a_nested_jits_constants_are_part_of_the_key():
  """A `jit` inside a kernel that closes over an array prints the array's name, not its
  values: the key takes the values (`_nested_consts`)."""
  def nested(values):
    inner = jax.jit(lambda x: x + values)
    return jax.make_jaxpr(lambda x: inner(x) * 2)(jnp.ones(3)).jaxpr
  first, again, other = nested(np.arange(3.0)), nested(np.arange(3.0)), nested(np.ones(3))
  assert first.pretty_print() == other.pretty_print()
  assert compile_ahead._nested_consts(first) == compile_ahead._nested_consts(again)
  assert compile_ahead._nested_consts(first) != compile_ahead._nested_consts(other)
