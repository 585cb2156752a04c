"""Fused rotary position embedding: kernel backends, npu emulator contract, megatron patch, parity.

Tolerances (outputs and input grads vs a float64 oracle on the same inputs, per element):
- fp32: the table of mindspeed_like.testing.parity, 1e-6 abs + 1e-5 rel. A rotation is two
  products and a sum per element; fp32 rounding of |x| <= ~5 stays far below that.
- bf16, an override of the table's 2e-2/2e-2: 6e-2 abs + 1.6e-2 rel. cos/sin are rounded to bf16
  before use (as megatron does) and
  each product and sum rounds to 8 mantissa bits. ``x_a cos - x_b sin`` can cancel, so the error
  is absolute at the scale of the products (|x| <= ~5 from randn, times mscale 1.25: bf16
  half-ulp up to 2^-5 = 0.031 per rounding, two or three roundings), not relative to the result.
Model parity: 10 steps of the tiny GPT (RMSNorm + SwiGLU + RoPE); fp32 losses within 1e-5
relative (measured: identical), bf16 within 1e-3 relative (the portable kernel rounds once per
fused multiply-add where megatron rounds after every op; measured about 3e-5).
"""

from __future__ import annotations

import logging
import types
import zlib

import pytest
import torch

import mindspeed_like
from mindspeed_like.kernels import rope as rope_kernel
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.kernels.rope import apply_rope, cos_sin
from mindspeed_like.testing import (
    SavedBytesMeter,
    destroy_parallel,
    init_parallel,
    run_distributed,
    tiny_gpt,
    train_steps,
)
from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu
from mindspeed_like.testing.parity import SEED, assert_elementwise_close, assert_losses_close, run_with_backend

STEPS = 10
# bf16 override (see the docstring): the error of ``x_a cos - x_b sin`` is absolute at the scale
# of the products, not relative to a result that can cancel.
BF16_ROTATION = dict(atol=6e-2, rtol=1.6e-2)


def _close(actual, expected, dtype, what):
    assert_elementwise_close(actual, expected, dtype, what=what, **(BF16_ROTATION if dtype == torch.bfloat16 else {}))


# (s, b, n, d, rot_dim): seq 1, odd head dim 129 with partial rotary, rotary_percent 0.5, full.
SHAPES = [(1, 1, 1, 2, 2), (7, 2, 3, 129, 128), (5, 3, 4, 64, 32), (16, 2, 2, 32, 32)]


def oracle(t: torch.Tensor, freqs: torch.Tensor, mode: str, mscale: float = 1.0) -> torch.Tensor:
    """megatron's formula in float64 (independent of the kernel module)."""
    t = t.double()
    rot_dim = freqs.shape[-1]
    x, rest = t[..., :rot_dim], t[..., rot_dim:]
    if mode == "mla":
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    if mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-x[..., rot_dim // 2 :], x[..., : rot_dim // 2]), dim=-1)
    f = freqs.double()
    return torch.cat((x * torch.cos(f) * mscale + rotated * torch.sin(f) * mscale, rest), dim=-1)


@pytest.mark.parametrize("mode", ["half", "interleave", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64(kernel_backend, mode, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kernel_backend.name}-{mode}-{dtype}".encode()))
    for s, b, n, d, rot_dim in SHAPES:
        t = torch.randn(s, b, n, d, generator=gen).to(dtype).requires_grad_()
        freqs = torch.rand(s, 1, 1, rot_dim, generator=gen) * 6
        grad = torch.randn(s, b, n, d, generator=gen).to(dtype)
        calls = kernel_backend.calls["npu_rotary_mul"]
        out = apply_rope(t, freqs, mode=mode, mscale=1.25)
        assert kernel_backend.calls["npu_rotary_mul"] - calls == kernel_backend.expected_npu_calls(1)
        (dt,) = torch.autograd.grad(out, t, grad)
        t64 = t.detach().double().requires_grad_()
        ref = oracle(t64, freqs, mode, 1.25)
        (dt64,) = torch.autograd.grad(ref, t64, grad.double())
        assert out.dtype == dtype and out.shape == t.shape
        _close(out, ref, dtype, f"out {(s, b, n, d, rot_dim)}")
        _close(dt, dt64, dtype, f"dt {(s, b, n, d, rot_dim)}")


@pytest.mark.parametrize("per_token_freqs", [False, True])
def test_thd_packed_matches_per_sequence(kernel_backend, per_token_freqs):
    lengths = [3, 1, 5]
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    total, n, d, rot_dim = 9, 3, 20, 16
    t = torch.randn(total, n, d, dtype=torch.float32, requires_grad=True)
    freqs = torch.rand(total if per_token_freqs else 6, 1, 1, rot_dim) * 6
    out = apply_rope(t, freqs, mode="half", cu_seqlens=cu)
    pieces, start = [], 0
    for length in lengths:
        rows = freqs[start : start + length] if per_token_freqs else freqs[:length]
        pieces.append(oracle(t[start : start + length].unsqueeze(1), rows, "half").squeeze(1))
        start += length
    _close(out, torch.cat(pieces), torch.float32, "packed out")


def test_portable_saves_only_shared_cos_sin():
    rope_kernel.clear_cache()
    freqs = torch.rand(16, 1, 1, 32)
    q = torch.randn(16, 2, 4, 64, requires_grad=True)
    k = torch.randn(16, 2, 4, 64, requires_grad=True)
    with force_backend("portable"), SavedBytesMeter() as meter:
        (apply_rope(q, freqs) + apply_rope(k, freqs)).sum()
    cos, sin = cos_sin(freqs, torch.float32)
    assert meter.count == 2  # q's and k's rotations share one cos and one sin
    assert meter.bytes == cos.numel() * 4 + sin.numel() * 4 == 2 * 16 * 32 * 4


def test_cos_sin_cache_shared_and_invalidated():
    rope_kernel.clear_cache()
    freqs = torch.rand(8, 1, 1, 16)
    first = cos_sin(freqs, torch.float32)
    assert all(a is b for a, b in zip(first, cos_sin(freqs, torch.float32), strict=True))
    assert cos_sin(freqs, torch.bfloat16)[0].dtype == torch.bfloat16
    assert cos_sin(freqs, torch.float32, mscale=2.0)[0] is not first[0]
    freqs.mul_(2)  # in-place change: a new version, recomputed
    torch.testing.assert_close(cos_sin(freqs, torch.float32)[0], torch.cos(freqs))


def test_cos_sin_of_inference_tensors():
    """Frequencies made under ``torch.inference_mode`` (ms-swift's export check runs the megatron
    model so) have no version counter; ``cos_sin`` keyed its cache on it and raised
    ``Inference tensors do not track version counter``. Now computed, uncached, equal."""
    with torch.inference_mode():
        freqs = torch.randn(8, 1, 1, 16)
        cos, sin = cos_sin(freqs, torch.float32)
        x = torch.randn(8, 2, 4, 16)
        out = apply_rope(x, freqs, mode="half")
    torch.testing.assert_close(cos, torch.cos(freqs), rtol=0, atol=0)
    torch.testing.assert_close(sin, torch.sin(freqs), rtol=0, atol=0)
    torch.testing.assert_close(out, apply_rope(x.clone(), freqs.clone(), mode="half"), rtol=0, atol=0)


def test_npu_backend_falls_back_outside_op_limits():
    t = torch.randn(1, 40, 30, 8, requires_grad=True)  # interleave needs B*N < 1000
    freqs = torch.rand(1, 1, 1, 8)
    with run_with_backend("npu") as npu:
        out = apply_rope(t, freqs, mode="interleave")
    assert npu.calls["npu_rotary_mul"] == 0
    _close(out, oracle(t, freqs, "interleave"), torch.float32, "fallback out")


def test_emulator_rejects_wrong_calls():
    x = torch.randn(4, 2, 3, 8)
    r = torch.rand(4, 1, 1, 8)
    with emulated_torch_npu() as npu:
        npu.npu_rotary_mul(x, r, r, rotary_mode="half")
        bad_calls = [
            lambda: npu.npu_rotary_mul(x, r, r, rotary_mode="rotate_half"),
            lambda: npu.npu_rotary_mul(x[0], r[0], r[0]),  # 3-D
            lambda: npu.npu_rotary_mul(x, r.bfloat16(), r),  # dtype mismatch
            lambda: npu.npu_rotary_mul(x, torch.rand(4, 2, 1, 8), torch.rand(4, 2, 1, 8)),  # not 11SD/1S1D/S11D
            lambda: npu.npu_rotary_mul(x, r[..., :4], r[..., :4]),  # partial rotary not split first
            lambda: npu.npu_rotary_mul(x[..., :7], r[..., :7], r[..., :7]),  # odd D
            lambda: npu.npu_rotary_mul(torch.randn(1, 2, 1, 896), torch.rand(1, 1, 1, 896), torch.rand(1, 1, 1, 896)),
            lambda: npu.npu_rotary_mul(torch.randn(1, 1000, 1, 2), torch.rand(1, 1, 1, 2), torch.rand(1, 1, 1, 2)),
            lambda: npu.npu_rotary_mul(
                torch.randn(1, 40, 30, 2), torch.rand(1, 1, 1, 2), torch.rand(1, 1, 1, 2), rotary_mode="interleave"
            ),
        ]
        for call in bad_calls:
            with pytest.raises(ContractError):
                call()


# ---- megatron patch ---------------------------------------------------------------------------


@pytest.fixture
def fresh():
    mindspeed_like.reset()
    rope_kernel.clear_cache()
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _losses(flag: bool, steps: int = STEPS, **overrides) -> list[float]:
    mindspeed_like.configure(device="cpu", use_fused_rotary_pos_emb=flag)
    init_parallel(seed=SEED)
    return train_steps(tiny_gpt(**overrides), steps, seed=SEED)


@pytest.fixture(scope="module")
def baseline_fp32():
    mindspeed_like.reset()
    try:
        return _losses(False)
    finally:
        destroy_parallel()
        mindspeed_like.reset()


def test_gpt_parity_fp32(fresh, baseline_fp32, monkeypatch):
    calls = []
    real = rope_kernel.apply_rope
    monkeypatch.setattr(rope_kernel, "apply_rope", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = _losses(True)
    assert len(calls) == STEPS * 2 * 2  # the patch ran our kernel: steps x layers x (q, k)
    assert_losses_close(fused, baseline_fp32, 1e-5, "fused-rope fp32 GPT")


def test_gpt_parity_npu_backend_through_emulator(fresh, baseline_fp32):
    with emulated_torch_npu() as npu, force_backend("npu"):
        npu_losses = _losses(True)
    assert npu.calls["npu_rotary_mul"] == STEPS * 2 * 2  # steps x layers x (q, k)
    assert_losses_close(npu_losses, baseline_fp32, 1e-5, "npu backend")


def test_gpt_parity_bf16(fresh):
    fused, base = _losses(True, bf16=True), _losses(False, bf16=True)
    assert_losses_close(fused, base, 1e-3, "fused-rope bf16 GPT")


def test_flag_off_restores_megatron_objects(fresh):
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.transformer.attention as attention

    original = rope_utils.apply_rotary_pos_emb
    assert attention.apply_rotary_pos_emb is original
    mindspeed_like.configure(device="cpu", use_fused_rotary_pos_emb=True)
    assert attention.apply_rotary_pos_emb is not original
    assert attention.apply_rotary_pos_emb.__wrapped__ is original
    mindspeed_like.configure(use_fused_rotary_pos_emb=False)
    assert attention.apply_rotary_pos_emb is original and rope_utils.apply_rotary_pos_emb is original


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _config(**values):
    base = dict(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False, mrope_section=None)
    base.update(values)
    return types.SimpleNamespace(**base)


def _mla_argument() -> dict:
    """megatron-core 0.19+ asks for MLA's de-interleaving with the call's
    ``mla_rotary_interleaved`` (default False, whatever the config says); before, the config's
    ``multi_latent_attention`` decided. The keyword that makes an MLA call on this version."""
    import inspect

    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    params = inspect.signature(inspect.unwrap(rope_utils.apply_rotary_pos_emb)).parameters
    return {"mla_rotary_interleaved": True} if "mla_rotary_interleaved" in params else {}


@pytest.mark.parametrize(
    "config_values, mla_call",
    [
        ({}, False),
        ({"rotary_interleaved": True}, False),
        ({"multi_latent_attention": True}, False),
        ({"multi_latent_attention": True}, True),
    ],
    ids=["half", "interleaved", "mla-config", "mla-call"],
)
def test_patched_dispatcher_matches_megatron_sbhd_and_thd(fresh, config_values, mla_call):
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    extra = _mla_argument() if mla_call else {}
    if mla_call and not extra:
        pytest.skip("megatron-core < 0.19: no mla_rotary_interleaved argument (the config decides: mla-config)")
    original = rope_utils.apply_rotary_pos_emb
    mindspeed_like.configure(device="cpu", use_fused_rotary_pos_emb=True)
    patched = rope_utils.apply_rotary_pos_emb
    config, group = _config(**config_values), _Group(1)
    t = torch.randn(6, 2, 3, 24)
    freqs = torch.rand(6, 1, 1, 16) * 6
    for kwargs in (dict(mscale=1.0, **extra), dict(mscale=1.3, **extra)):
        ours = patched(t, freqs, config, cp_group=group, **kwargs)
        torch.testing.assert_close(ours, original(t, freqs, config, cp_group=group, **kwargs))
    cu = torch.tensor([0, 2, 6, 9], dtype=torch.int32)
    packed = torch.randn(9, 3, 24)
    per_token = torch.rand(9, 1, 1, 16) * 6  # one freqs row per packed token (megatron >= 0.15 maps row i)
    for rows in (freqs, per_token):
        ours = patched(packed, rows, config, cu_seqlens=cu, cp_group=group, **extra)
        torch.testing.assert_close(ours, original(packed, rows, config, cu_seqlens=cu, cp_group=group, **extra))


def test_unsupported_calls_fall_back_once_or_raise_under_strict(fresh, caplog):
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    from mindspeed_like.features import fused_rope
    from mindspeed_like.toolkit.fallback import forget_logged

    forget_logged()
    mindspeed_like.configure(device="cpu", use_fused_rotary_pos_emb=True)
    patched = rope_utils.apply_rotary_pos_emb
    t, freqs, config = torch.randn(4, 1, 2, 8), torch.rand(4, 1, 1, 8), _config()
    packed, cu = torch.randn(2, 2, 8), torch.tensor([0, 4])  # CP=2: this rank holds 2 of 4 tokens
    torch.testing.assert_close(
        patched(packed, freqs, config, cu_seqlens=cu, cp_group=_Group(2)),
        rope_utils.apply_rotary_pos_emb.__wrapped__(packed, freqs, config, cu_seqlens=cu, cp_group=_Group(2)),
    )
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        for _ in range(3):
            mla = _config(multi_latent_attention=True, rotary_interleaved=True)
            out = patched(t, freqs, mla, cp_group=_Group(1), **_mla_argument())
    assert out.shape == t.shape
    assert sum("rotary_interleaved" in r.getMessage() for r in caplog.records) == 1
    mindspeed_like.configure(strict=True)  # rebuilds the patch: megatron's name now holds the strict one
    with pytest.raises(fused_rope.FusedRopeUnsupported, match="context parallel > 1 with packed sequences"):
        rope_utils.apply_rotary_pos_emb(packed, freqs, config, cu_seqlens=cu, cp_group=_Group(2))
    # sbhd under CP: RotaryEmbedding already gave this rank its chunks' freqs; the fused kernel takes it
    fused = rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=_Group(2))
    torch.testing.assert_close(fused, rope_utils.apply_rotary_pos_emb.__wrapped__(t, freqs, config, cp_group=_Group(2)))


def _tp2_sp_worker(seed: int) -> dict:
    mindspeed_like.configure(device="cpu", use_fused_rotary_pos_emb=False)
    out = {}
    for flag in (False, True):
        mindspeed_like.configure(use_fused_rotary_pos_emb=flag)
        init_parallel(tp=2, seed=seed)
        out[flag] = train_steps(tiny_gpt(sequence_parallel=True), 5, seed=seed)
        destroy_parallel()
    return out


@pytest.mark.slow
def test_tp2_sequence_parallel_parity():
    for rank in run_distributed(_tp2_sp_worker, 2, SEED, timeout=300):
        assert_losses_close(rank[True], rank[False], 1e-5, "TP=2+SP")


def test_flag_parses_from_the_command_line_with_mindspeed_spelling():
    from mindspeed_like import registry
    from mindspeed_like.config import all_flags, parse_argv

    flags = all_flags(registry.all_features())
    parsed = parse_argv(flags, ["--use-fused-rotary-pos-emb", "--apply-rope-fusion"])
    assert parsed["use_fused_rotary_pos_emb"] is True
    assert "apply_rope_fusion" not in parsed  # megatron's own (TE) flag is not ours
    feature = registry.feature_by_name("fused-rotary-pos-emb")
    assert not feature.flags[0].megatron_defines
