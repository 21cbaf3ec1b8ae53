"""The README's Python code runs exactly as written (CPU, in a fresh process)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

pytestmark = pytest.mark.skipif("JAX_EP_PROCESS_ID" in os.environ,
                                reason="runs its own process; once per launched job is enough")


def _python_blocks():
  return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path):
  blocks = _python_blocks()
  assert len(blocks) >= 2, "the README's quick start went missing"
  script = tmp_path / "readme.py"
  script.write_text("\n".join(blocks))  # later blocks continue the earlier ones
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "backend='reference'" in result.stdout  # the CPU has no cuda backend
  assert "(256, 128) [(128, 16), (16, 128, 256), (16, 256, 128)]" in result.stdout
  assert "(256, 128) [0 0 0 0 0 0 0 0]" in result.stdout  # nothing dropped at the default capacity


def test_readme_has_no_placeholders():
  assert "PERFORMANCE_TABLE" not in README.read_text()
