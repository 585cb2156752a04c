"""The `mindspeed-like` command, run as a user runs it (a fresh interpreter each time)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mindspeed_like import registry


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    return subprocess.run(
        [sys.executable, "-m", "mindspeed_like.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_features_lists_every_feature_with_state_backend_and_support():
    result = _cli("features")
    assert result.returncode == 0, result.stderr
    for feature in registry.all_features():
        assert feature.name in result.stdout
    assert "0.16.1: supported" in result.stdout or "supported" in result.stdout
    assert "--device" in result.stdout


def test_features_rejects_a_bad_flag_value():
    result = _cli("features", "--device", "gpu")
    assert result.returncode == 2
    assert "invalid choice: 'gpu'" in result.stderr


@pytest.mark.slow
def test_report_lists_applied_patches():
    result = _cli("report", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "fix-checkpoint-without-output-fp8" in result.stdout
    assert "CheckpointWithoutOutput.__init__" in result.stdout and "applied" in result.stdout
    assert "FxGraphHashDetails.__init__ [GLOBAL]" in result.stdout  # cpu-compile-cache, and its line:
    assert "torch.compile cache: " in result.stdout and "keys its graphs by the CPU vector ISA" in result.stdout


@pytest.mark.slow
def test_demo_trains_and_the_loss_falls():
    result = _cli("demo", "--steps", "12", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 12
    first, last = float(lines[0].split()[3]), float(lines[-1].split()[3])
    assert last < first
    assert "tokens/s" in result.stdout and "peak memory" in result.stdout and "features on" in result.stdout


def test_demo_smoke():
    result = _cli("demo", "--steps", "3", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("\nstep ") == 3 and "summary:" in result.stdout


def test_features_shows_levels_their_members_and_the_level_in_effect():
    result = _cli("features", "--optimization-level", "1", "--reuse-fp32-param")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "level 1 = results bitwise or within fp32 rounding" in out
    members_2 = (
        "fused-linear-cross-entropy, megatron-fsdp-lean-state, moe-zero-memory, recompute-activation-function, "
        "reuse-fp32-param"
    )
    assert f"2: + the features that trade numerics or time for memory: {members_2}" in out
    assert "optimization level 1 in effect; set explicitly (overriding it): reuse_fp32_param" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert rows["flash-attention"][2:4] == ["on", "1"]
    assert rows["recompute-activation-function"][2:4] == ["off", "2"]
    assert rows["reuse-fp32-param"][2:4] == ["on", "2"]
