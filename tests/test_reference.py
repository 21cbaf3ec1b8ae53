"""The shared suite on the reference backend (CPU: 8 host devices)."""

from ep_test_base import EPTestBase
from low_latency_test_base import LowLatencyTestBase


class TestReference(EPTestBase):
  backend = "reference"


class TestReferenceLowLatency(LowLatencyTestBase):
  backend = "reference"
