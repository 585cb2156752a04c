"""Shared by the compare tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """A MINDSPEED_LIKE_ARGS in the caller's environment must not change what compare runs."""
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)


@pytest.fixture
def no_process(monkeypatch):
    """Fails the test if compare starts a process."""
    import mindspeed_like.workloads as workloads

    def refuse(*args, **kwargs):
        raise AssertionError("compare started processes for a combination it should have refused")

    monkeypatch.setattr(workloads, "run_distributed", refuse)
