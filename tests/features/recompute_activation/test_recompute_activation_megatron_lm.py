"""recompute-activation-function switched on from Megatron-LM's own command line (opt-in, like
test_megatron_lm_integration.py: runs only when MEGATRON_LM_PATH points at a checkout)."""

from __future__ import annotations

import pytest

from mindspeed_like.testing.megatron_lm import SKIP_REASON, available
from mindspeed_like.testing.megatron_lm import launcher as _launcher
from mindspeed_like.testing.megatron_lm import losses as _losses
from mindspeed_like.testing.megatron_lm import torchrun as _torchrun

pytestmark = pytest.mark.skipif(not available(), reason=SKIP_REASON)


def test_flag_on_megatrons_command_line_gives_megatrons_losses():
    """Megatron-LM's parser does not define the flags; the adaptor adds them to it. The
    feature is announced as on and the fp32 losses equal megatron's path as printed."""
    flags = ["--recompute-activation-function", "--recompute-activation-function-num-layers", "1"]
    lines = _torchrun(1, _launcher(), flags)
    assert "recompute-activation-function" in lines[0]
    baseline = _torchrun(1, _launcher(), [])
    assert "recompute-activation-function" not in baseline[0]
    assert _losses(lines) == _losses(baseline)
