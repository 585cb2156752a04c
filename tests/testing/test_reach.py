"""``python -m mindspeed_like.testing.reach SCRIPT``: the script runs with the features applied, and
at exit one line per rank says which features megatron called into and which were on but never
reached (the check the opt-in Megatron-LM runs of tests/integration/test_deepseek_megatron_lm.py
make on every arm)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mindspeed_like.testing import reach

SCRIPT = """
import torch
from megatron.core.fusions import fused_bias_swiglu
x = torch.randn(4, 8)
fused_bias_swiglu.bias_swiglu_impl(x, None)
print("script ran", flush=True)
"""


@pytest.mark.slow  # a process importing megatron-core: ~10 s idle, minutes under load
def test_reach_line_names_the_features_called_and_the_ones_never_reached(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mindspeed_like.testing.reach",
            str(script),
            "--use-fused-swiglu",
            "--use-fused-rmsnorm",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "script ran" in output
    reports = reach.read(output)
    assert list(reports) == [0], output[-3000:]
    report = reports[0]
    assert {"fused-swiglu", "fused-rmsnorm"} <= set(report["on"])
    assert report["ran"]["fused-swiglu"] == 1  # one call into bias_swiglu_impl
    assert "fused-swiglu" not in report["idle"]
    assert "fused-rmsnorm" in report["idle"]  # on, nothing called it, no fallback said
    assert report["idle_patches"]["fused-rmsnorm"], "the idle feature's patches are listed with their status"


def test_read_takes_one_report_per_rank_from_mixed_output():
    output = (
        "noise\n"
        '[rank1]: > mindspeed_like reach rank 1: {"idle": [], "on": ["a"], "ran": {"a": 2}}\n'
        '> mindspeed_like reach rank 0: {"idle": ["b"], "on": ["b"], "ran": {}}\n'
    )
    assert reach.read(output) == {
        0: {"idle": ["b"], "on": ["b"], "ran": {}},
        1: {"idle": [], "on": ["a"], "ran": {"a": 2}},
    }
