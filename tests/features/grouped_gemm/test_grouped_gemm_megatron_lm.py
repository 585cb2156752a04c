"""Megatron-LM's own ``--moe-grouped-gemm`` on CPU through pretrain_gpt.py (opt-in, like
test_megatron_lm_integration.py: runs only when MEGATRON_LM_PATH points at a checkout).

Megatron-LM parses ``--moe-grouped-gemm`` into ``TransformerConfig.moe_grouped_gemm``; without
the CUDA grouped_gemm package the grouped-gemm feature is on by default, so the local spec's
GroupedMLP builds and trains in fp32 (megatron-core 0.16 alone asserts bf16) with no flag of
ours; MindSpeed's ``--gemm-gradient-accumulation-fusion`` on the same command line reaches our
config (Megatron's parser ignores it) and routes the expert weight gradients into main_grad.
"""

from __future__ import annotations

import pytest

from mindspeed_like.testing.megatron_lm import SKIP_REASON, available
from mindspeed_like.testing.megatron_lm import launcher as _launcher
from mindspeed_like.testing.megatron_lm import losses as _losses
from mindspeed_like.testing.megatron_lm import torchrun as _torchrun

pytestmark = pytest.mark.skipif(not available(), reason=SKIP_REASON)
MOE = ["--num-experts", "4", "--moe-grouped-gemm", "--disable-bias-linear", "--moe-router-topk", "2"]


@pytest.mark.parametrize("extra", [[], ["--gemm-gradient-accumulation-fusion"]], ids=["default", "fusion"])
def test_moe_grouped_gemm_on_megatrons_command_line_trains(extra):
    lines = _torchrun(1, _launcher(), [*MOE, *extra])
    assert "grouped-gemm" in lines[0]
    losses = _losses(lines)
    assert losses[-1] < losses[0]
