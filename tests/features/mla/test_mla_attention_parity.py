"""megatron's multi-latent self-attention with our flash attention (and RoPE fusion) equals the same
module with the features off: fp32 forward and gradients within 1e-5, with YaRN rope.

What is covered here and nowhere else: the MLA module end to end (``MLASelfAttention`` on megatron's
local spec, and on the TransformerEngine spec through our te-backend), with megatron's YaRN rotary
embedding (``rope_type="yarn"``: correction range from ``beta_fast``/``beta_slow`` and
``original_max_position_embeddings``, the rope ``mscale`` on cos/sin, and ``mscale_all_dim``, which
changes the softmax scale to ``mscale^2 / sqrt(d_qk)``), a V head dim (12) different from q/k's
(16 + 8 rope), V not padded. The kernels alone are tested against float64 in
``tests/features/flash_attention`` and ``tests/features/fused_rope``.

Measured on megatron-core 0.16.1 (largest difference relative to the reference's largest entry), both
specs alike: flash attention output 1.7e-7, gradients 3.5e-7; with RoPE fusion too 1.7e-7 / 3.1e-7;
RoPE fusion alone 2.1e-8 / 2.3e-7; softmax scale 0.2519 (1/sqrt(24) = 0.2041 without mscale_all_dim).

Every run is ``--strict``: a call our features hand back to megatron would raise, so a pass means
our kernels ran (and the engine's call counter shows they were reached).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.features.flash_attention import NAME as FLASH
from mindspeed_like.features.fused_rope import NAME as FUSED_ROPE
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
from mindspeed_like.testing.parity import SEED

FP32_RTOL = 1e-5  # the bound: same math, another summation order (blocked softmax, fused rope)
SEQ, BATCH = 32, 2


def yarn_args() -> dict:
    """YaRN with every knob away from the identity: scaling 4 over an original length of 16 (so the
    sequence of 32 is extrapolated), a correction range inside the 4 rope frequencies, rope mscale
    1.0 against mscale_all_dim 0.8 (cos/sin scaled by mscale(1.0)/mscale(0.8) != 1, and the softmax
    scale by mscale(0.8)^2)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    original = (
        "original_max_position_embeddings"
        if "original_max_position_embeddings" in names
        else (
            "max_position_embeddings"  # megatron-core 0.13's name
        )
    )
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": 4.0,
        original: 16,
        "beta_fast": 4.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    }


def run_attention(transformer_impl: str, rope_type: str, **flags) -> dict:
    """Output and gradients (input and every parameter) of layer 0's MLA self-attention on fixed
    inputs, with ``flags`` switched on (strict)."""
    mindspeed_like.reset()
    runtime.ENGINE.calls = collections.Counter()
    try:
        mindspeed_like.configure(device="cpu", strict=True, **flags)
        init_parallel(tp=1, seed=SEED)
        rope = yarn_args() if rope_type == "yarn" else {"rope_type": "rope"}
        model = tiny_gpt(multi_latent_attention=True, transformer_impl=transformer_impl, seq_length=SEQ, **rope)
        attention = model.decoder.layers[0].self_attention
        gen = torch.Generator().manual_seed(SEED)
        hidden = torch.randn(SEQ, BATCH, model.config.hidden_size, generator=gen).requires_grad_(True)
        output, _ = attention(hidden, attention_mask=None)
        output.backward(torch.randn(output.shape, generator=gen))
        grads = {"d_hidden": hidden.grad.clone()}
        grads.update({name: p.grad.clone() for name, p in attention.named_parameters()})
        return {
            "output": output.detach().clone(),
            "grads": grads,
            "calls": dict(runtime.ENGINE.calls),
            "softmax_scale": attention.softmax_scale,
        }
    finally:
        runtime.ENGINE.calls = None
        destroy_parallel()
        mindspeed_like.reset()


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (gradients near 0 elsewhere)."""
    return ((actual - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def assert_same_attention(actual: dict, reference: dict) -> None:
    assert relative_error(actual["output"], reference["output"]) < FP32_RTOL
    assert actual["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        error = relative_error(actual["grads"][name], grad)
        assert error < FP32_RTOL, f"{name}: {error:.2e}"


FEATURES = {
    "flash": dict(use_flash_attn=True),
    "flash+fused-rope": dict(use_flash_attn=True, use_fused_rotary_pos_emb=True),
    "fused-rope": dict(use_fused_rotary_pos_emb=True),
}
EXPECTED_CALLS = {"use_flash_attn": FLASH, "use_fused_rotary_pos_emb": FUSED_ROPE}


# both features together on both specs in the default lane; each feature alone in the slow lane
CASES = [
    pytest.param(
        impl, features, id=f"{features}-{tag}", marks=() if features == "flash+fused-rope" else pytest.mark.slow
    )
    for features in sorted(FEATURES)
    for impl, tag in (("local", "local"), ("transformer_engine", "te"))
]


@pytest.mark.parametrize("transformer_impl, features", CASES)
def test_mla_yarn_attention_equals_megatron(transformer_impl, features):
    reference = run_attention(transformer_impl, "yarn")
    actual = run_attention(transformer_impl, "yarn", **FEATURES[features])
    for flag, feature in EXPECTED_CALLS.items():
        if flag in FEATURES[features]:
            assert actual["calls"].get(feature, 0) > 0, (feature, actual["calls"])
        assert reference["calls"].get(feature, 0) == 0
    # mscale_all_dim reached the softmax scale: not 1/sqrt(d_qk), so the kernel got megatron's scale
    assert abs(actual["softmax_scale"] - (16 + 8) ** -0.5) > 1e-3
    assert_same_attention(actual, reference)


@pytest.mark.parametrize(
    "transformer_impl", ["local", pytest.param("transformer_engine", marks=pytest.mark.slow)], ids=["local", "te"]
)
def test_mla_plain_rope_attention_equals_megatron(transformer_impl):
    """``rope_type="rope"`` (megatron's RotaryEmbedding, no mscale) through both features."""
    reference = run_attention(transformer_impl, "rope")
    actual = run_attention(transformer_impl, "rope", **FEATURES["flash+fused-rope"])
    assert actual["calls"].get(FLASH, 0) > 0 and actual["calls"].get(FUSED_ROPE, 0) > 0
    assert_same_attention(actual, reference)


@pytest.mark.parametrize("without_pad", [False, True], ids=["padded", "mla-fa-without-pad"])
def test_mla_value_head_padding_choice_reaches_the_kernel(monkeypatch, without_pad):
    """CPU: the V head dim (12) differs from q/k's (24). By default V is zero-padded for torch's
    fused flash kernel; ``--mla-fa-without-pad`` (MindSpeed's flag) runs the unpadded blocked
    kernel instead. Either way megatron's attention within fp32 rounding."""
    from mindspeed_like.kernels import flash_attention as kernel

    blocked_calls = []
    original = kernel.blocked_attention
    monkeypatch.setattr(kernel, "blocked_attention", lambda *a, **k: blocked_calls.append(1) or original(*a, **k))
    reference = run_attention("local", "yarn")
    actual = run_attention("local", "yarn", use_flash_attn=True, mla_fa_without_pad=without_pad)
    assert actual["calls"].get(FLASH, 0) > 0
    assert bool(blocked_calls) is without_pad
    assert_same_attention(actual, reference)
