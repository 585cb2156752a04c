"""``--reuse-fp32-param`` on Megatron-LM's own command line (pretrain_gpt.py; opt-in like
test_megatron_lm_integration.py: runs when MEGATRON_LM_PATH points at a core_v0.16.1 checkout).

Megatron-LM does not define the flag; the adaptor adds it to its parser. bf16 training with the
flag must print exactly megatron's losses (the scheme is exact), with the Float16 optimizer in one
process and with the DistributedOptimizer over DP=2.
"""

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


@pytest.mark.parametrize(
    ("nproc", "extra"), [(1, ["--bf16"]), (2, ["--bf16", "--use-distributed-optimizer"])], ids=["float16", "distopt"]
)
def test_reuse_fp32_param_prints_megatrons_losses(nproc, extra):
    lines = _torchrun(nproc, _launcher(), [*extra, "--reuse-fp32-param"], {"MINDSPEED_LIKE_ARGS": "--strict"})
    assert "reuse-fp32-param" in lines[0]
    baseline = _torchrun(nproc, _launcher(), extra)
    assert "reuse-fp32-param" not in baseline[0]
    assert _losses(lines) == _losses(baseline)
