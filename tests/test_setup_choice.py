"""scripts/setup.sh builds CUDA code only where a GPU is or where it is asked to, and says which.

Runs the script's `--dry-run` (the choice alone) with a PATH holding stand-ins for `nvcc` and
`nvidia-smi`, or neither. A machine whose /dev has NVIDIA devices always counts as having a GPU,
so the expected choice takes that into account.
"""

import glob
import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
REAL_GPU = bool(glob.glob("/dev/nvidia[0-9]*"))


def _choice(tmp_path, *, nvcc: bool, smi: bool, **env):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("dirname", "tr", "grep"):  # all the choice needs from outside bash
    (bin_dir / tool).symlink_to(shutil.which(tool))
  if nvcc:
    (bin_dir / "nvcc").write_text("#!/bin/sh\nexit 0\n")
  if smi:
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: x)'\n")
  for tool in bin_dir.iterdir():
    tool.chmod(0o755)
  (tmp_path / "scripts").mkdir()
  shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
  proc = subprocess.run(["/bin/bash", str(tmp_path / "scripts" / "setup.sh"), "--dry-run"],
                        env={"PATH": str(bin_dir), **env}, capture_output=True, text=True,
                        timeout=60)
  assert not (tmp_path / ".venv").exists(), "--dry-run created a virtual environment"
  return proc


@pytest.mark.parametrize("nvcc, smi, env, builds, why", [
    (True, False, {}, False, "nvcc but no NVIDIA GPU; JAX_EP_ENABLE_CUDA=ON builds it anyway"),
    (True, True, {}, True, "an NVIDIA GPU and nvcc found; NVSHMEM module: yes"),
    (False, True, {}, False, "an NVIDIA GPU but no nvcc on PATH"),
    (False, False, {}, False, "no NVIDIA GPU, no nvcc"),
    (True, False, {"JAX_EP_ENABLE_CUDA": "ON"}, True,
     "JAX_EP_ENABLE_CUDA=ON; NVSHMEM module: yes"),
    (True, False, {"JAX_EP_ENABLE_CUDA": "on", "JAX_EP_ENABLE_NVSHMEM": "OFF"}, True,
     "JAX_EP_ENABLE_CUDA=ON; NVSHMEM module: no"),
    (True, True, {"JAX_EP_ENABLE_CUDA": "OFF"}, False, "JAX_EP_ENABLE_CUDA=OFF"),
], ids=["nvcc-no-gpu", "gpu-and-nvcc", "gpu-no-nvcc", "neither", "on", "on-no-nvshmem", "off"])
def test_cuda_build_choice(tmp_path, nvcc, smi, env, builds, why):
  if REAL_GPU and not smi and not env:
    # This machine has a GPU whatever PATH says: AUTO's choice is the one with a GPU.
    smi_case = {(True, False): (True, "an NVIDIA GPU and nvcc found"),
                (False, False): (False, "an NVIDIA GPU but no nvcc on PATH")}
    builds, why = smi_case[(nvcc, smi)]
  proc = _choice(tmp_path, nvcc=nvcc, smi=smi, **env)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  if builds:
    assert proc.stdout.startswith("setup: building the CUDA extension ("), proc.stdout
  else:
    assert proc.stdout.startswith("setup: reference backend only, no CUDA build ("), proc.stdout
  assert why in proc.stdout, proc.stdout


def test_unknown_cuda_switch_is_refused(tmp_path):
  proc = _choice(tmp_path, nvcc=True, smi=False, JAX_EP_ENABLE_CUDA="maybe")
  assert proc.returncode == 1
  assert "JAX_EP_ENABLE_CUDA must be AUTO, ON or OFF, got 'maybe'" in proc.stderr


def test_ci_asks_for_the_cuda_build_wherever_nvcc_is():
  # CI's explicit request keeps every CUDA source compiling on machines without a GPU.
  ci = (REPO / ".ci" / "run").read_text()
  assert 'if command -v nvcc >/dev/null 2>&1; then export JAX_EP_ENABLE_CUDA=ON; fi' in ci
  assert "bash scripts/test.sh" in ci and "bash scripts/setup.sh" in (
      REPO / "scripts" / "test.sh").read_text()
