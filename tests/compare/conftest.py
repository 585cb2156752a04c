"""Shared by the compare tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """A MINDSPEED_LIKE_ARGS in the caller's environment must not change what compare runs."""
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)
