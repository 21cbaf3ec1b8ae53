"""The layers of jax_ep/ (by imports) and ffi/ (by includes): every arrow points down, and the
drawings in docs/layout.md and ffi/README.md are the code's (scripts/layers.py)."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


@pytest.mark.parametrize("tree", ["jax_ep", "ffi"])
def test_every_arrow_points_down(tree):
  assert layers.edges(tree), f"no imports read in {tree}/"
  assert layers.violations(tree) == []


@pytest.mark.parametrize("tree,page", [("jax_ep", "docs/layout.md"), ("ffi", "ffi/README.md")])
def test_the_drawing_on_the_page_is_the_codes(tree, page):
  text = (ROOT / page).read_text()
  blocks = re.findall(r"```\n(.*?)\n```", text, re.S)
  first = layers.drawing(tree).splitlines()[0]
  drawn = [b for b in blocks if b.splitlines()[0] == first]
  assert drawn == [layers.drawing(tree)], f"{page}: run python scripts/layers.py and copy it"


def test_an_upward_import_is_found(monkeypatch):
  """The check itself: an import from a lower layer into a higher one is reported."""
  real = layers._python_imports

  def with_one_more(path):
    found = real(path)
    return found + ["jax_ep.group"] if path.name == "registry.py" else found
  monkeypatch.setattr(layers, "_python_imports", with_one_more)
  assert layers.violations("jax_ep") == ["jax_ep: backends/ -> public API (1)"]
