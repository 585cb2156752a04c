"""Skips for tests of a Megatron-FSDP path that the installed megatron-core does not have."""

from __future__ import annotations

import importlib.util

import pytest

NEEDS_MEGATRON_FSDP = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core.distributed.fsdp") is None,
    reason="this megatron-core has no Megatron-FSDP (megatron.core.distributed.fsdp; 0.13 has custom_fsdp)",
)
