"""Shared fixtures."""

from __future__ import annotations

import pytest

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel


@pytest.fixture
def adapter():
    """megatron-core on CPU through the adaptor, with fresh parallel state; undone afterwards."""
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel()
    yield
    destroy_parallel()
    mindspeed_like.reset()
