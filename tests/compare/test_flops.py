"""compare's model FLOPs (compare/flops.py) against the model megatron builds, and model FLOP
utilisation (report.flops_result / flops_lines, compare.flops_plan) with a given peak."""

from __future__ import annotations

import argparse

import pytest
import torch

from mindspeed_like.compare import flops_plan, report
from mindspeed_like.compare.flops import model_flops
from mindspeed_like.compare.peak import bf16_matmul_peak
from mindspeed_like.compare.presets import PRESETS

SIZE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)


def _weights_a_token_passes(model: torch.nn.Module, args: dict) -> float:
    """Counted from the built GPT: every weight matrix except the embeddings, a routed expert's
    weights at top-k / experts (a token visits top-k of them), the output layer once more per MTP
    layer (it computes its own logits), and once where it is tied to the embedding."""
    total = 0.0
    experts = args.get("num_moe_experts") or 0
    for name, param in model.named_parameters():
        if param.dim() < 2 or "embedding" in name:
            continue
        routed = experts and ".experts." in name and "shared_experts" not in name
        total += param.numel() * (args["moe_router_topk"] / experts if routed else 1)
    hidden, vocab = args["hidden_size"], args["vocab_size"]
    if getattr(model.output_layer, "weight", None) is None:
        total += hidden * vocab
    return total + (args.get("mtp_num_layers") or 0) * hidden * vocab


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_matmul_flops_are_twice_the_weights_of_the_built_model(adapter, preset):
    from mindspeed_like.testing import tiny_gpt

    args = PRESETS[preset].model_args(**SIZE)
    model = tiny_gpt(wrap_float16=False, **dict(args, moe_grouped_gemm=False))
    counted = model_flops(args)
    assert counted.per_token == pytest.approx(2 * _weights_a_token_passes(model, args), rel=1e-12)


def test_causal_attention_term_and_a_step():
    args = PRESETS["llama"].model_args(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=4096)
    counted = model_flops(args)
    s, h, layers = 4096, 2048, 8
    assert counted.per_sequence == 2 * s * s * h * layers  # q k^T and p v, 2 s^2 h each, halved by the mask
    assert counted.per_step(4) == 3 * 4 * (counted.per_token * s + counted.per_sequence)
    # the arithmetic: about 2.5 GFLOP a token at this size
    assert 2.4e9 < counted.per_step(1) / s < 2.6e9


def test_llama3_preset_is_llama_8b_shaped():
    args = PRESETS["llama3"].model_args(num_layers=4, hidden_size=4096, num_attention_heads=32, seq_length=4096)
    assert (args["ffn_hidden_size"], args["num_query_groups"]) == (14336, 8)
    parts = model_flops(args).parts
    # per layer: q 4096x4096 + k,v 2 x 4096x1024 + out 4096x4096, and SwiGLU 3 x 4096 x 14336
    assert parts["attention projections"] == 2 * 4 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert parts["dense MLPs"] == 2 * 4 * 3 * 4096 * 14336


def _arm(step_s: float) -> dict:
    return {"step_time": {"median_s": step_s}}


def test_mfu_is_achieved_flops_over_devices_times_the_measured_peak():
    plan = {"model_flops_per_step": 8e12, "devices": 2, "sequences_per_step": 2, "formula": "f"}
    plan["peak"] = {"flops_per_s": 800e12, "how": "8192^3 bf16 matmul"}
    result = report.flops_result(plan, _arm(0.05), _arm(0.025))
    assert result["megatron"]["achieved_flops_per_s"] == pytest.approx(160e12)
    assert result["megatron"]["mfu"] == pytest.approx(0.1) and result["features"]["mfu"] == pytest.approx(0.2)
    lines = "\n".join(report.flops_lines(result))
    assert "model FLOP utilisation" in lines and "megatron 10.0%, with features 20.0%" in lines
    assert "800 TFLOP/s" in lines and "over 2 devices" in lines


def test_no_peak_no_mfu_and_the_reason_is_said():
    plan = {"model_flops_per_step": 1e9, "devices": 1, "sequences_per_step": 1, "formula": "f", "peak": None}
    plan["peak_skipped"] = "no peak is claimed on a cpu: achieved FLOP/s only"
    result = report.flops_result(plan, _arm(1.0), _arm(0.5))
    assert result["features"]["mfu"] is None
    lines = "\n".join(report.flops_lines(result))
    assert "achieved model FLOP/s: megatron 1 GFLOP/s, with features 2 GFLOP/s" in lines
    assert "not computed (no peak is claimed on a cpu" in lines


def _args(**overrides) -> argparse.Namespace:
    values = dict(preset="llama", fp32=False, quiet=True, **SIZE)
    values.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1)
    values.update(data_parallel_size=1)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_a_peak_that_fails_is_said_and_the_comparison_goes_on(monkeypatch, capsys):
    def broken(device):
        raise RuntimeError("cuBLAS says no")

    monkeypatch.setattr("mindspeed_like.compare.peak.bf16_matmul_peak", broken)
    plan = flops_plan(_args(), {"size": SIZE}, 2, "cuda")
    assert plan["peak"] is None and "cuBLAS says no" in plan["peak_skipped"]
    assert "no model FLOP utilisation" in capsys.readouterr().out
    assert flops_plan(_args(fp32=True), {"size": SIZE}, 2, "cuda")["peak_skipped"].startswith("--fp32")


def test_peak_is_measured_on_an_accelerator_only():
    with pytest.raises(ValueError, match="on an accelerator"):
        bf16_matmul_peak("cpu")
