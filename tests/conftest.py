"""Shared fixtures (and mindspeed_like.testing's pytest plugin: ``kernel_backend``)."""

from __future__ import annotations

import pytest

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel

pytest_plugins = ["mindspeed_like.testing.pytest_plugin"]


@pytest.fixture
def adapter():
    """megatron-core on CPU through the adaptor, with fresh parallel state; undone afterwards."""
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel()
    yield
    destroy_parallel()
    mindspeed_like.reset()


@pytest.fixture
def cpu_config():
    """``cpu_config(**flags)``: reset, then configure the CPU device with ``flags``; the test
    builds its own parallel state. Parallel state and config are undone afterwards."""

    def setup(**flags):
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu", **flags)

    yield setup
    destroy_parallel()
    mindspeed_like.reset()
