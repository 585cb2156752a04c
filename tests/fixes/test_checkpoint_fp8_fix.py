"""The upstream CheckpointWithoutOutput fp8 default bug, with and without our fix."""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.fixes import checkpoint_fp8_default
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt


def _layernorm_recompute_loss():
    init_parallel(seed=3)
    try:
        model = tiny_gpt(recompute_granularity="selective", recompute_modules=["layernorm"])
        tokens = torch.randint(0, 256, (2, 32))
        positions = torch.arange(32).unsqueeze(0).expand(2, 32)
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        return loss
    finally:
        destroy_parallel()


def test_without_the_fix_layernorm_recompute_fails_and_with_it_trains():
    from megatron.core import tensor_parallel

    mindspeed_like.reset()
    try:
        runtime.apply()
        assert tensor_parallel.CheckpointWithoutOutput().fp8 is False
        assert _layernorm_recompute_loss().isfinite()

        runtime.ENGINE.remove(checkpoint_fp8_default.FEATURE.name)  # the upstream behaviour
        assert tensor_parallel.CheckpointWithoutOutput().fp8 is True
        with pytest.raises(NameError, match="FP8GlobalStateManager"):
            _layernorm_recompute_loss()
    finally:
        mindspeed_like.reset()
