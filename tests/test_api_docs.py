"""docs/api.md lists every public argument of the layer functions and of `jax_ep.nnx.MoE`, with
the code's defaults: its signature blocks are parsed and compared with `inspect.signature`."""

import ast
import inspect
import pathlib
import re

import jax.numpy as jnp
import pytest

import jax_ep

nnx = pytest.importorskip("jax_ep.nnx")

API = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"

# What the page must document, by the name its signature blocks use.
DOCUMENTED = {
    "jax_ep.moe_mlp": jax_ep.moe_mlp,
    "jax_ep.moe_mlp_per_shard": jax_ep.moe_mlp_per_shard,
    "jax_ep.init_moe_params": jax_ep.init_moe_params,
    "jax_ep.expert_mlp": jax_ep.expert_mlp,
    "jax_ep.expert_mlp_slabs": jax_ep.expert_mlp_slabs,
    "jax_ep.nnx.MoE": nnx.MoE.__init__,
    "MoE.__call__": nnx.MoE.__call__,
    "MoE.update_bias": nnx.MoE.update_bias,
}
# How the page spells the defaults that are not literals.
NAMES = {"Routing": jax_ep.Routing, "bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _documented_signatures():
  """`{name: parameter list text}` of every `name(...)` that opens a line of a ``` block."""
  blocks, block, language = [], None, None
  for line in API.read_text().splitlines():
    if line.startswith("```"):
      if block is None:
        block, language = [], line[3:].strip()
      else:
        if not language:  # plain blocks hold signatures; python and bash ones, examples
          blocks.append("\n".join(block) + "\n")
        block = None
    elif block is not None:
      block.append(line)
  found = {}
  for block in blocks:
    for match in re.finditer(r"^([\w.]+)\(", block, re.MULTILINE):
      depth, end = 1, match.end()
      while depth:
        depth += {"(": 1, ")": -1}.get(block[end], 0)
        end += 1
      assert match.group(1) not in found, f"{match.group(1)} is documented twice"
      found[match.group(1)] = block[match.end():end - 1]
  return found


def _parameters(text):
  """`[(name, kind, default or inspect.Parameter.empty)]` of a documented parameter list."""
  args = ast.parse(f"def f({text}): pass").body[0].args
  defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
  value = lambda node: (inspect.Parameter.empty if node is None  # noqa: E731
                        else eval(compile(ast.Expression(node), "api.md", "eval"), NAMES))
  params = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, value(d))
            for a, d in zip(args.args, defaults)]
  params += [(a.arg, inspect.Parameter.KEYWORD_ONLY, value(d))
             for a, d in zip(args.kwonlyargs, args.kw_defaults)]
  return params


def _code_parameters(fn):
  return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
          if p.name != "self"]


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_documented_signature_is_the_code_signature(name):
  documented = _documented_signatures()
  assert name in documented, f"docs/api.md has no signature block for {name}(...)"
  got, want = _parameters(documented[name]), _code_parameters(DOCUMENTED[name])
  assert [p[:2] for p in got] == [p[:2] for p in want], (
      f"{name}: docs/api.md lists {[p[0] for p in got]}, the code takes "
      f"{[p[0] for p in want]} (or a `*` differs)")
  for (arg, _, doc_default), (_, _, code_default) in zip(got, want):
    assert doc_default == code_default, (
        f"{name}: docs/api.md gives {arg} the default {doc_default!r}, the code "
        f"{code_default!r}")


def test_every_argument_has_a_row_in_the_tables():
  text = API.read_text()
  rows = set()
  for line in text.splitlines():
    if line.startswith("| `"):
      rows.update(re.findall(r"`(\w+)`", line.split(" | ")[0]))
  for name, fn in DOCUMENTED.items():
    missing = [p[0] for p in _code_parameters(fn) if p[0] not in rows]
    assert not missing, f"{name}: no row of docs/api.md's argument tables explains {missing}"
