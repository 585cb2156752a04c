"""megatron's ``masked_softmax_fusion`` without its compiled softmax extension: ModuleNotFoundError at
the first bf16 forward (Megatron-LM's default, on every device); with the fix, megatron's unfused
softmax, bitwise the run with the flag off (on a GPU: tests/integration/test_cuda_placement.py)."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like import runtime
from mindspeed_like.fixes import masked_softmax_without_extension as fix
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt


def _bf16_loss(masked_softmax_fusion: bool) -> torch.Tensor:
    init_parallel(seed=5)
    try:
        # bf16, causal, seq 32, 2 x 4 heads: the shapes megatron's fused kernel takes
        model = tiny_gpt(bf16=True, masked_softmax_fusion=masked_softmax_fusion)
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(32).unsqueeze(0).expand(2, 32)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        return loss.detach()
    finally:
        destroy_parallel()


@pytest.mark.skipif(fix.installed("scaled_masked_softmax_cuda"), reason="the compiled extension is installed here")
def test_fused_softmax_flag_runs_megatrons_unfused_softmax_without_the_extension(adaptor):
    assert torch.equal(_bf16_loss(True), _bf16_loss(False))
    runtime.ENGINE.remove(fix.FEATURE.name)  # megatron's own behaviour
    with pytest.raises(ModuleNotFoundError, match="scaled_masked_softmax_cuda"):
        _bf16_loss(True)


def test_the_extension_each_branch_imports():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    causal, padding = SimpleNamespace(attn_mask_type=AttnMaskType.causal), SimpleNamespace(attn_mask_type=None)
    assert fix.needed_extensions(causal, None) == (
        "scaled_masked_softmax_cuda",
        "scaled_upper_triang_masked_softmax_cuda",
    )
    assert fix.needed_extensions(padding, torch.ones(1)) == ("scaled_masked_softmax_cuda",)
    assert fix.needed_extensions(padding, None) == ("scaled_masked_softmax_cuda", "scaled_softmax_cuda")
