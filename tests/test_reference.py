"""The shared suite on the reference backend (CPU: 8 host devices)."""

from ep_test_base import EPTestBase


class TestReference(EPTestBase):
  backend = "reference"
