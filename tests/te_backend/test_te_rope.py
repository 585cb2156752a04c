"""TransformerEngine's fused RoPE (issue 56 item 2): TE 2.1's ``apply_rotary_pos_emb`` contract on our
kernel (``te_backend/rope.py``), and megatron's ``apply_rope_fusion`` through it.

* against a float64 reference written from TE 2.1's kernel (``fused_rope.cu``: ``x cos + rotate(x)
  sin`` per channel, rotate-half, the channels past ``d2`` copied), sbhd / bshd / thd, full and
  partial rotation, forward and backward. Bounds: fp32 ``rtol = atol = 1e-5`` per element (a few
  fp32 roundings of values below 10; worst seen over 20 seeds: 0.02 of it); bf16 fused ``rtol = 2^-8,
  atol = 1e-5`` (TE's kernel: float32 arithmetic, one rounding to bf16: half a bf16 ulp, at most 2^-8
  of the value, plus the float32 error; worst seen: 0.995 of the rtol alone, so it is tight), bf16
  unfused ``atol = 2^-6 max|t|`` (TE's torch path: cos/sin, two products and the sum each rounded to
  bf16, at most 2^-8 of ``max|t|`` each; worst seen: 0.37 of it);
* thd with context parallelism: each CP rank's rows equal the same rows of the whole packed
  sequence rotated on one rank (the zigzag chunks ``r`` and ``2 cp - 1 - r`` of every sequence);
* megatron's ``rope_utils.apply_rotary_pos_emb`` with ``apply_rope_fusion=True`` equals its unfused
  path (sbhd, partial rotary, thd); without the te-backend megatron refuses the config;
* what TE's kernel would read out of bounds or assert is a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like.te_backend import rope
from mindspeed_like.testing import destroy_parallel, init_parallel
from mindspeed_like.testing.parity import SEED


def _rotate_half64(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _reference(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """TE's formula in float64: ``angles`` broadcast against ``t``'s rotated channels."""
    x = t.double()
    d2 = angles.shape[-1]
    a = angles.double()
    rotated = x[..., :d2] * torch.cos(a) + _rotate_half64(x[..., :d2]) * torch.sin(a)
    return torch.cat((rotated, x[..., d2:]), dim=-1)


def _freqs(positions: int, d2: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d2, 2, dtype=torch.float32) / d2))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1).view(positions, 1, 1, d2)  # megatron's / TE's layout


def _assert_within_bound(out: torch.Tensor, ref: torch.Tensor, t: torch.Tensor, fused: bool) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    elif fused:
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-5)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2**-6 * float(t.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("d2", [16, 8])  # full and partial rotation (head dim 16)
def test_matches_float64_reference_forward_and_backward(dtype, fused, tensor_format, d2):
    torch.manual_seed(SEED)
    s, b, h, d = 11, 3, 4, 16
    shape = (s, b, h, d) if tensor_format == "sbhd" else (b, s, h, d)
    t = torch.randn(shape).to(dtype).requires_grad_()
    freqs = _freqs(s + 5, d2)  # more positions than the input: the first s are used
    out = rope.apply_rotary_pos_emb(t, freqs, tensor_format=tensor_format, fused=fused)
    assert out.shape == t.shape and out.dtype == dtype and out.is_contiguous()
    angles = freqs[:s] if tensor_format == "sbhd" else freqs[:s].transpose(0, 1)
    ref = _reference(t.detach(), angles)
    _assert_within_bound(out, ref, t.detach(), fused)
    assert torch.equal(out[..., d2:], t.detach()[..., d2:])  # the rest passes through, bit for bit

    grad = torch.randn(shape).to(dtype)
    out.backward(grad)
    t64 = t.detach().double().requires_grad_()
    _reference(t64, angles).backward(grad.double())
    _assert_within_bound(t.grad, t64.grad, grad, fused)


def _zigzag_rows(cu: list[int], cp: int, rank: int) -> list[int]:
    """megatron's CP partition of a packed batch: rank ``rank`` holds chunks ``rank`` and
    ``2 cp - 1 - rank`` of every sequence (its length split into ``2 cp`` chunks)."""
    rows = []
    for start, end in zip(cu[:-1], cu[1:]):
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            rows += range(start + c * chunk, start + (c + 1) * chunk)
    return rows


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_thd_with_context_parallelism_equals_the_whole_sequence(cp_size):
    torch.manual_seed(SEED)
    cu = [0, 12, 36, 48]  # lengths 12, 24, 12: divisible by 2 * cp for cp = 1, 2, 3
    h, d, d2 = 2, 8, 8
    whole = torch.randn(cu[-1], h, d)
    freqs = _freqs(30, d2)  # max length 24 < 30: every sequence starts at angle row 0
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    full = rope.apply_rotary_pos_emb(whole, freqs, tensor_format="thd", fused=True, cu_seqlens=cu_seqlens)
    per_row = torch.cat([freqs[: end - start] for start, end in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(full.double(), _reference(whole.unsqueeze(1), per_row).squeeze(1), rtol=1e-5, atol=1e-5)
    for rank in range(cp_size):
        rows = _zigzag_rows(cu, cp_size, rank)
        local = whole[rows]
        out = rope.apply_rotary_pos_emb(
            local, freqs, tensor_format="thd", fused=True, cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=rank
        )
        torch.testing.assert_close(out, full[rows], rtol=0, atol=0)


def test_thd_rows_outside_every_sequence_come_back_unchanged():
    t = torch.randn(10, 2, 8)
    out = rope.apply_rotary_pos_emb(
        t, _freqs(8, 8), tensor_format="thd", fused=True, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32)
    )
    assert torch.equal(out[7:], t[7:]) and not torch.equal(out[1:7], t[1:7])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t, f: rope.apply_rotary_pos_emb(t, f, tensor_format="sbhd_"), "tensor_format must be one of"),
        (
            lambda t, f: rope.apply_rotary_pos_emb(t.flatten(0, 1), f, tensor_format="thd", cu_seqlens=None),
            "only supported with fused=True",
        ),
        (
            lambda t, f: rope.apply_rotary_pos_emb(t.flatten(0, 1), f, tensor_format="thd", fused=True),
            "cu_seqlens must not be None",
        ),
        (lambda t, f: rope.apply_rotary_pos_emb(t, f[:3]), "freqs has 3 positions for an input of sequence length 6"),
        (lambda t, f: rope.apply_rotary_pos_emb(t, _freqs(6, 10)), "must be even and at most the input's head dim"),
        (lambda t, f: rope.apply_rotary_pos_emb(t, f.expand(16, 2, 1, 8), fused=True), "fused RoPE takes freqs"),
        (
            lambda t, f: rope.apply_rotary_pos_emb(
                t.flatten(0, 1), f, "thd", True, torch.tensor([0, 6, 12], dtype=torch.int32), cp_size=2, cp_rank=0
            ),
            "local length must be even",
        ),
        (
            lambda t, f: rope.apply_rotary_pos_emb(
                t.flatten(0, 1), f[:4], "thd", True, torch.tensor([0, 12], dtype=torch.int32)
            ),
            "freqs has 4 positions; the packed sequences need 12",
        ),
        (
            lambda t, f: rope.apply_rotary_pos_emb(
                t.flatten(0, 1), f, "thd", True, torch.tensor([0, 12], dtype=torch.int32), cp_size=2, cp_rank=2
            ),
            "0 <= cp_rank < cp_size",
        ),
        (lambda t, f: rope.fused_apply_rotary_pos_emb(t, f, interleaved=True), "Only TE >= 2.3.0 supports"),
    ],
)
def test_what_te_s_kernel_would_misread_is_a_clear_error(call, message):
    t, freqs = torch.randn(6, 2, 2, 8), _freqs(16, 8)
    with pytest.raises(ValueError, match=message):
        call(t, freqs)


def test_freqs_get_no_gradient_as_in_te():
    t = torch.randn(5, 1, 2, 8, requires_grad=True)
    freqs = _freqs(5, 8).requires_grad_()
    rope.apply_rotary_pos_emb(t, freqs, fused=True).sum().backward()
    assert t.grad is not None and freqs.grad is None


# --------------------------------------------------------------------------- megatron's apply_rope_fusion


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, **fields)


@pytest.mark.parametrize("d2", [16, 8])
def test_megatron_rope_fusion_equals_its_unfused_path_sbhd(adapter, d2):
    from megatron.core.models.common.embeddings import rope_utils

    assert rope_utils.fused_apply_rotary_pos_emb is rope.fused_apply_rotary_pos_emb
    torch.manual_seed(SEED)
    t = torch.randn(9, 2, 4, 16)
    freqs = _freqs(9, d2)
    fused = rope_utils.apply_rotary_pos_emb(t, freqs, _config(apply_rope_fusion=True))
    unfused = rope_utils.apply_rotary_pos_emb(t, freqs, _config(apply_rope_fusion=False))
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)
    t16 = t.bfloat16()
    fused16 = rope_utils.apply_rotary_pos_emb(t16, freqs, _config(apply_rope_fusion=True))
    _assert_within_bound(fused16, _reference(t16, freqs), t16, fused=True)


def test_megatron_rope_fusion_equals_its_unfused_path_thd(adapter):
    from megatron.core.models.common.embeddings import rope_utils

    torch.manual_seed(SEED)
    cu_seqlens = torch.tensor([0, 5, 16, 20], dtype=torch.int32)
    t = torch.randn(20, 4, 16, requires_grad=True)
    freqs = _freqs(12, 16)  # max_s rows: megatron restarts every sequence at 0, as TE's kernel does
    fused = rope_utils.apply_rotary_pos_emb(t, freqs, _config(apply_rope_fusion=True), cu_seqlens=cu_seqlens)
    t_unfused = t.detach().requires_grad_()
    unfused = rope_utils.apply_rotary_pos_emb(t_unfused, freqs, _config(apply_rope_fusion=False), cu_seqlens=cu_seqlens)
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(fused)
    fused.backward(grad)
    unfused.backward(grad)
    torch.testing.assert_close(t.grad, t_unfused.grad, rtol=1e-6, atol=1e-6)


def test_without_the_te_backend_megatron_refuses_rope_fusion_and_reset_unbinds_it():
    from megatron.core.models.common.embeddings import rope_utils

    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu", no_te_backend=True)
        assert rope_utils.fused_apply_rotary_pos_emb is None
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            _config(apply_rope_fusion=True)
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu")
        assert rope_utils.fused_apply_rotary_pos_emb_thd is rope.fused_apply_rotary_pos_emb_thd
        assert _config(apply_rope_fusion=True).apply_rope_fusion
    finally:
        mindspeed_like.reset()
    assert rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None


def test_fused_rope_flag_leaves_megatron_s_fusion_to_the_te_backend_even_under_strict():
    """--use-fused-rotary-pos-emb wraps megatron's dispatcher; with apply_rope_fusion (Megatron-LM's
    default, now kept) megatron's fused path is the te-backend's, on the same kernel: no fallback is
    logged, and --strict does not turn it into an error."""
    from megatron.core.models.common.embeddings import rope_utils

    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu", use_fused_rotary_pos_emb=True, strict=True)
        init_parallel(seed=SEED)
        torch.manual_seed(SEED)
        t, freqs = torch.randn(7, 2, 4, 16), _freqs(7, 16)
        out = rope_utils.apply_rotary_pos_emb(t, freqs, _config(apply_rope_fusion=True))
        torch.testing.assert_close(out, rope.fused_apply_rotary_pos_emb(t, freqs), rtol=0, atol=0)
    finally:
        destroy_parallel()
        mindspeed_like.reset()
