"""``--context-parallel-size 2`` on Megatron-LM's own command line (pretrain_gpt.py, opt-in like
test_megatron_lm_integration.py: runs when MEGATRON_LM_PATH points at a core_v0.16.1 checkout).
Megatron's own validation of the CP arguments passes on CPU, and CP=2 (ring and Ulysses) trains
to the losses of CP=1 (DP=2) on the same global batch; so does CP=4 hybrid (``--context-parallel-algo
hybrid_cp_algo --ulysses-degree-in-cp 2``, MindSpeed's flags only: megatron's hierarchical groups are
built from the degree) against DP=4. A degree that does not divide the CP size stops the run at
argument validation, before any model is built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mindspeed_like.testing.megatron_lm import PRETRAIN_GPT, SKIP_REASON, TINY, available
from mindspeed_like.testing.megatron_lm import launcher as _launcher
from mindspeed_like.testing.megatron_lm import losses as _losses
from mindspeed_like.testing.megatron_lm import torchrun as _torchrun
from mindspeed_like.testing.parallel import free_port

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


HYBRID_CP4 = ["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp"]


def test_cp4_hybrid_on_megatrons_command_line_equals_cp1():
    """No --hierarchical-context-parallel-sizes: the validate_args hook sets megatron's sizes [2, 2]
    from the degree (megatron logs them), initialize_megatron builds the groups. Micro-batch 1 in
    both runs (DP=4 holds the global batch of 4 as one sequence per rank)."""
    lines = _torchrun(4, _launcher(), [*HYBRID_CP4, "2", "--micro-batch-size", "1"])
    assert "context-parallel" in lines[0]
    baseline = _torchrun(4, _launcher(), ["--micro-batch-size", "1"])
    hybrid, plain = _losses(lines), _losses(baseline)
    worst = max(abs(a - b) / abs(b) for a, b in zip(hybrid, plain, strict=True))
    print(f"Megatron-LM CP=4 hybrid 2x2 vs DP=4: max relative loss difference {worst:.3g}")
    assert hybrid == pytest.approx(plain, rel=2e-5)


def test_a_degree_that_does_not_divide_cp_stops_at_argument_validation():
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS="1")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "mindspeed_like.run", PRETRAIN_GPT, *TINY, *HYBRID_CP4, "3", "--micro-batch-size", "1",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "--ulysses-degree-in-cp 3 does not divide --context-parallel-size 4" in output, output[-3000:]
    assert "use one of 1, 2, 4" in output
    assert "building GPT model" not in output and "iteration " not in output  # nothing was built
