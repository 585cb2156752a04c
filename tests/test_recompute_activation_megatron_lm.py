"""recompute-activation-function switched on from Megatron-LM's own command line (opt-in, like
test_megatron_lm_integration.py: runs only when MEGATRON_LM_PATH points at a checkout)."""

from __future__ import annotations

import pytest
from test_megatron_lm_integration import PRETRAIN_GPT, _launcher, _losses, _torchrun

pytestmark = pytest.mark.skipif(
    not __import__("os").path.isfile(PRETRAIN_GPT),
    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v0.16.1) to run; see docs/megatron-lm.md",
)


def test_flag_on_megatrons_command_line_gives_megatrons_losses():
    """Megatron-LM's parser does not define the flags; the adaptor adds them to it. The
    feature is announced as on and the fp32 losses equal megatron's path as printed."""
    flags = ["--recompute-activation-function", "--recompute-activation-function-num-layers", "1"]
    lines = _torchrun(1, _launcher(), flags)
    assert "recompute-activation-function" in lines[0]
    baseline = _torchrun(1, _launcher(), [])
    assert "recompute-activation-function" not in baseline[0]
    assert _losses(lines) == _losses(baseline)
