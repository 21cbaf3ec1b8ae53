"""`CommOptions`: how a group's communication runs, apart from what it computes.

`EPConfig` (jax_ep/config.py) holds what decides the results and the buffers' shapes; these
settings decide only how the transports move rows: the SMs their send kernels take from XLA's
other kernels, the GPU stream their custom calls run on, and how long a rank waits for its
peers. The group checks them once, the registry gives them to the backend's `supports` and
`create` (`registry.Request.options`), and the backend keeps them.
"""

from __future__ import annotations

import dataclasses
import numbers

from jax_ep._native.limits import MAX_NUM_SMS
from jax_ep.config import positive_int


def _positive_seconds(name: str, value, where: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{where}: {name} must be a number of seconds, got {value!r}")
  value = float(value)
  if not 0.0 < value < 1e9:
    raise ValueError(f"{where}: {name} must be a positive number of seconds, got {value}")
  return value


# XLA:GPU numbers its additional compute streams from 1 (`compute_on("gpu_stream:N")`, the op
# annotation `_xla_stream_annotation`); a few are plenty for the groups of one program.
MAX_COMM_STREAM = 8


# `comm_stream`'s value for jax_ep's own stream: the ops and their joins are jax_ep's custom
# calls (jax_ep/overlap.py), placed where the layer's pipeline puts them.
OWN_STREAM = "jax_ep"


@dataclasses.dataclass(frozen=True)
class OwnStream:
  """Where the cuda backend's ops run for `comm_stream=OWN_STREAM` (`CommOptions.stream`):
  jax_ep's own stream, where an op's grids that are sized by the GPU's SM count are sized to
  `sms` SMs instead (the group's `num_sms`), so that the kernels XLA runs beside it keep the
  rest of the GPU."""
  sms: int


# Where one of the cuda backend's ops runs: XLA's compute stream (None), XLA's additional
# stream N, or jax_ep's own stream.
Stream = int | OwnStream | None


def _comm_stream(value, where: str) -> int | str | None:
  expected = (f"None (XLA's compute stream), {OWN_STREAM!r} (jax_ep's own stream) or an int "
              f"from 1 to {MAX_COMM_STREAM} (an additional XLA stream)")
  if value is None or (isinstance(value, str) and value == OWN_STREAM):
    return value
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{where}: comm_stream must be {expected}, got {value!r}")
  if not 1 <= int(value) <= MAX_COMM_STREAM:
    raise ValueError(f"{where}: comm_stream must be {expected}, got {value}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class CommOptions:
  """The transports' settings of one group (`jax_ep.Group`'s arguments of the same names).

  Attributes:
    num_sms: multiprocessors' worth of blocks each send kernel of the peer transport runs
      (1 to `MAX_NUM_SMS`), so XLA's other kernels keep the rest of the GPU.
    timeout_s: how long a multi-rank kernel waits for a peer before it fails the group.
    config_timeout_s: how long group creation waits for the other processes.
    raise_on_timeout: raise a kernel's timeout at the op that hit it (else at `group.check()`).
    comm_stream: where the cuda backend's high-throughput ops run: None, XLA's compute stream;
      XLA's additional GPU stream N (1 to `MAX_COMM_STREAM`), beside the compute stream's
      kernels; `OWN_STREAM`, jax_ep's own stream, where every grid sized by the GPU's SMs
      takes `num_sms` SMs' worth of blocks instead.
  """
  num_sms: int = 24
  timeout_s: float = 60.0
  config_timeout_s: float = 60.0
  raise_on_timeout: bool = False
  comm_stream: int | str | None = None

  @classmethod
  def checked(cls, where: str = "jax_ep.Group", **settings) -> "CommOptions":
    """The options of `settings`, or the error that names the first bad one and its value."""
    num_sms = positive_int("num_sms", settings.get("num_sms", cls.num_sms), where)
    if num_sms > MAX_NUM_SMS:
      raise ValueError(f"{where}: num_sms must be <= {MAX_NUM_SMS} (multiprocessors' worth of "
                       f"one GPU), got {num_sms}")
    return cls(num_sms=num_sms,
               timeout_s=_positive_seconds("timeout_s", settings.get("timeout_s", cls.timeout_s),
                                           where),
               config_timeout_s=_positive_seconds(
                   "config_timeout_s", settings.get("config_timeout_s", cls.config_timeout_s),
                   where),
               raise_on_timeout=bool(settings.get("raise_on_timeout", cls.raise_on_timeout)),
               comm_stream=_comm_stream(settings.get("comm_stream", cls.comm_stream), where))

  @property
  def stream(self) -> Stream:
    """`comm_stream` as the cuda backend's ops take it (`cuda_ops`' `stream`)."""
    if self.comm_stream == OWN_STREAM:
      return OwnStream(self.num_sms)
    return self.comm_stream
