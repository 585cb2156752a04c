"""``--context-parallel-size 2`` on Megatron-LM's own command line (pretrain_gpt.py, opt-in like
test_megatron_lm_integration.py: runs when MEGATRON_LM_PATH points at a core_v0.16.1 checkout).
Megatron's own validation of the CP arguments passes on CPU, and CP=2 (ring and Ulysses) trains
to the losses of CP=1 (DP=2) on the same global batch."""

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


@pytest.mark.parametrize("algo", ["megatron_cp_algo", "ulysses_cp_algo"])
def test_cp2_on_megatrons_command_line_equals_cp1(algo):
    lines = _torchrun(2, _launcher(), ["--context-parallel-size", "2", "--context-parallel-algo", algo])
    assert "context-parallel" in lines[0]
    baseline = _torchrun(2, _launcher(), [])
    assert _losses(lines) == pytest.approx(_losses(baseline), rel=1e-5)
