"""The shared suites on the reference backend (CPU: 8 host devices)."""

from ep_test_base import REFERENCE, EPTestBase
from low_latency_test_base import LowLatencyTestBase


class TestReference(EPTestBase):
  target = REFERENCE


class TestReferenceLowLatency(LowLatencyTestBase):
  target = REFERENCE
