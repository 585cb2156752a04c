"""``--use-precision-aware-optimizer`` on Megatron-LM's own command line without TransformerEngine
(pretrain_gpt.py; opt-in like test_megatron_lm_integration.py: runs when MEGATRON_LM_PATH points
at a core_v0.16.1 checkout).

bf16 + DistributedOptimizer over DP=2 with megatron's flags only (the import line does the rest):
bf16 moments, bf16 main grads and remainders; fp8 moments. Their losses stay within the bounds of
the core-level test of the fp32-state run's (which is megatron's own path bit for bit there).
"""

from __future__ import annotations

import pytest

from mindspeed_like.testing.megatron_lm import SKIP_REASON, available
from mindspeed_like.testing.megatron_lm import launcher as _launcher
from mindspeed_like.testing.megatron_lm import losses as _losses
from mindspeed_like.testing.megatron_lm import torchrun as _torchrun
from mindspeed_like.testing.parity import assert_losses_close

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not available(), reason=SKIP_REASON),
]

BASE = ["--bf16", "--use-distributed-optimizer"]
PRECISION_AWARE = ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"]


@pytest.mark.parametrize(("moments", "rtol"), [("bf16", 2e-2), ("fp8", 6e-2)])
def test_precision_aware_optimizer_trains_without_te(moments, rtol):
    dtypes = ["--exp-avg-dtype", moments, "--exp-avg-sq-dtype", moments]
    lines = _torchrun(2, _launcher(), [*BASE, *PRECISION_AWARE, *dtypes], {"MINDSPEED_LIKE_ARGS": "--strict"})
    baseline = _torchrun(2, _launcher(), BASE)
    assert_losses_close(_losses(lines), _losses(baseline), rtol, what=f"{moments} moments vs megatron")
