"""``--use-fused-linear-cross-entropy`` on Megatron-LM's own command line (pretrain_gpt.py, opt-in
like test_megatron_lm_integration.py: runs when MEGATRON_LM_PATH points at a core_v0.16.1
checkout). Megatron's parser learns the flag from us; the fp32 losses must match megatron's path."""

from __future__ import annotations

import pytest

from mindspeed_like.testing.megatron_lm import SKIP_REASON, available
from mindspeed_like.testing.megatron_lm import launcher as _launcher
from mindspeed_like.testing.megatron_lm import losses as _losses
from mindspeed_like.testing.megatron_lm import torchrun as _torchrun

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not available(), reason=SKIP_REASON),
]


def test_flag_on_megatrons_command_line_trains_with_megatrons_losses():
    lines = _torchrun(1, _launcher(), ["--use-fused-linear-cross-entropy", "--linear-cross-entropy-chunk-tokens", "48"])
    assert "fused-linear-cross-entropy" in lines[0]
    baseline = _torchrun(1, _launcher(), [])
    assert "fused-linear-cross-entropy" not in baseline[0]
    assert _losses(lines) == pytest.approx(_losses(baseline), rel=1e-5)
