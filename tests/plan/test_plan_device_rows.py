"""Rows of the plan that depend on the device or on a Megatron-LM default, found on a GPU
(2026-11-27, an H200; the measured side is tests/plan/test_plan_on_a_gpu.py): megatron's own RMSNorm
is torch's fused kernel on CUDA, Megatron-LM's attention softmax stays in the model dtype unless
asked, and a rank holds buffers beside its model state."""

from __future__ import annotations

import pytest

from mindspeed_like.plan import cli, peak
from mindspeed_like.plan.activations import torch_fuses_rmsnorm

ARGS = (
    "--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 1 --global-batch-size 1 --vocab-size 32000 --normalization RMSNorm --swiglu "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --bf16 "
    "--transformer-impl local --parser builtin --world-size 1"
).split()


def _megatron_arm(*extra: str, device: str = "cuda"):
    prediction = cli.predict_argv([*ARGS, *extra, "--target-device", device])
    return prediction.run, prediction.megatron.stages[0]


def _rows(stage, component: str) -> list:
    return [r for rows in stage.chunk_rows[0].values() for r in rows if r.component == component]


def test_megatron_lms_softmax_is_in_the_model_dtype_unless_asked() -> None:
    run, stage = _megatron_arm()
    assert not run.model.attention_softmax_in_fp32
    whats = [r.what for r in _rows(stage, "core_attn")]
    assert not any("fp32 softmax" in w for w in whats)
    for flag in ("--attention-softmax-in-fp32", "--apply-query-key-layer-scaling"):
        run, stage = _megatron_arm(flag)
        assert run.model.attention_softmax_in_fp32, flag
        assert any("fp32 softmax" in r.what for r in _rows(stage, "core_attn")), flag


def test_attention_dropout_keeps_a_dropped_copy_beside_the_softmax_output() -> None:
    _, with_dropout = _megatron_arm()  # Megatron-LM's default: 0.1
    _, without = _megatron_arm("--attention-dropout", "0")
    s2 = 8 * 2048 * 2048  # heads x s x s, one microbatch
    extra = sum(r.total for r in _rows(with_dropout, "core_attn")) - sum(r.total for r in _rows(without, "core_attn"))
    per_layer = extra // 2
    assert per_layer == 2 * s2 + 1 * s2  # the dropped probabilities (bf16) and the device's bool mask


def test_megatrons_rmsnorm_on_cuda_keeps_the_input_and_rstd() -> None:
    assert torch_fuses_rmsnorm("cuda") and not torch_fuses_rmsnorm("cpu")
    _, cuda = _megatron_arm()
    _, cpu = _megatron_arm(device="cpu")
    assert all("fp32 copies" not in r.what for r in _rows(cuda, "norm"))
    assert any("fp32 copies" in r.what for r in _rows(cpu, "norm"))
    tokens, hidden = 2048, 1024
    cuda_norms = sum(r.total for r in _rows(cuda, "norm"))
    assert cuda_norms == 5 * (2 * tokens * hidden + 4 * tokens)  # 2 a layer and the final norm


@pytest.mark.parametrize(("device", "flash", "expected"), [
    ("cuda", False, 8 * 2048 * 2048 * 2 + 2 * peak.CUBLAS_WORKSPACE),
    ("cuda", True, 2 * peak.CUBLAS_WORKSPACE),
    ("cpu", False, 8 * 2048 * 2048 * 2),
    ("cpu", True, 0),
])  # fmt: skip
def test_buffers_beside_the_model_state(device: str, flash: bool, expected: int) -> None:
    level = ["--optimization-level", "1"] if flash else []
    arm = cli.predict_argv([*ARGS, *level, "--target-device", device])
    stage = (arm.features if flash else arm.megatron).stages[0]
    assert stage.peak.buffers == expected
    assert stage.peak.training >= stage.peak.buffers + stage.peak.model_state


def test_the_cublas_workspace_follows_cublas_workspace_config(monkeypatch) -> None:
    assert peak.cublas_workspace_bytes(":4096:8") == 32 * 2**20
    assert peak.cublas_workspace_bytes(":4096:2:16:8") == 4096 * 2 * 1024 + 16 * 8 * 1024
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert peak.cublas_workspace_bytes() == peak.CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    _, stage = _megatron_arm()
    assert stage.peak.buffers == 8 * 2048 * 2048 * 2 + 2 * 16 * 8 * 1024
    with pytest.raises(ValueError, match="SIZE_KiB:COUNT"):
        peak.cublas_workspace_bytes(":4096")
