"""Fixtures of the fixes' tests."""

from __future__ import annotations

import pytest

import mindspeed_like
from mindspeed_like import runtime


@pytest.fixture
def adaptor():
    """The import line's state (every always-on fix applied from the environment's config); undone afterwards."""
    mindspeed_like.reset()
    runtime.apply()
    yield
    mindspeed_like.reset()
