"""kernels/mla_yarn_rope.py: megatron's fused MLA YaRN RoPE contract (fused_apply_mla_rope_for_q/_kv)
against a float64 reference that builds each position's rotation matrix entry by entry from the Triton
kernels' formulas (forward: R x; backward: R^T g), in sbhd and thd, with context-parallel positions, and
through the cpu adapter where megatron's names are bound.

Tolerances against the float64 reference (inputs rounded to the tested dtype first, so only the
kernel's own arithmetic is measured): fp32 rtol 1e-6, atol 1e-6 (two products and a sum in fp32);
bf16 rtol 2**-8, atol 1e-2 (one rounding to bf16 per output, 2**-9 relative). The rotary key's gradient
sums the heads and rounds that sum to the gradient's dtype before rotating it, as the kernel does; the
reference does the same (without that step bf16 is 0.053 off at a value near 8)."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

import mindspeed_like
from mindspeed_like.kernels.mla_yarn_rope import mla_rope_kv, mla_rope_q, token_positions
from mindspeed_like.megatron_version import megatron_core_version

TOLS = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2**-8, atol=1e-2)}


def _angles(rows: int, emb: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [rows, 1, 1, emb] with unrelated halves and an mscale != 1, so a left/right mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(rows, emb, generator=g, dtype=torch.float64) * 6.3
    scale = 1.0 + torch.rand(rows, emb, generator=g, dtype=torch.float64)
    return (theta.cos() * scale).to(dtype).view(rows, 1, 1, emb), (theta.sin() * scale).to(dtype).view(rows, 1, 1, emb)


def _matrix(cos: torch.Tensor, sin: torch.Tensor, p: int) -> torch.Tensor:
    """The kernel's map of position p as an [emb, emb] float64 matrix: interleaved in, half-wise out."""
    c, s = cos.reshape(cos.shape[0], -1)[p].double(), sin.reshape(sin.shape[0], -1)[p].double()
    emb = c.numel()
    h = emb // 2
    r = torch.zeros(emb, emb, dtype=torch.float64)
    for i in range(h):
        r[i, 2 * i], r[i, 2 * i + 1] = c[i], -s[i]  # left = x1 * cos_l - x2 * sin_l
        r[h + i, 2 * i + 1], r[h + i, 2 * i] = c[h + i], s[h + i]  # right = x2 * cos_r + x1 * sin_r
    return r


def _thd_positions_loop(cu: list[int], tokens: int, cp_rank: int, cp_size: int) -> list[int]:
    """megatron's ``_get_thd_token_idx``, transcribed statement by statement."""
    out = []
    for pid_m in range(tokens):
        token_idx, this_seq_len, last = -1, 0, cu[0] // cp_size
        for seq_idx in range(len(cu) - 1):
            cur = cu[seq_idx + 1] // cp_size
            if token_idx == -1 and cur > pid_m:
                token_idx, this_seq_len = pid_m - last, cur - last
            last = cur
        if cp_size > 1:
            if token_idx < this_seq_len // 2:
                token_idx = token_idx + cp_rank * this_seq_len // 2
            else:
                token_idx = (token_idx - this_seq_len // 2) + (2 * cp_size - cp_rank - 1) * this_seq_len // 2
        out.append(token_idx)
    return out


def _positions(layout: str, shape: tuple[int, ...]) -> list[int]:
    if layout == "sbhd":
        return [s for s in range(shape[0]) for _ in range(shape[1])]
    return _thd_positions_loop(CU, shape[0], 0, 1)


CU = [0, 5, 12, 20]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_q_matches_the_float64_reference(layout, dtype):
    qk, emb, heads = 6, 8, 3
    shape = (7, 2, heads, qk + emb) if layout == "sbhd" else (CU[-1], heads, qk + emb)
    cos, sin = _angles(20, emb, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    cu = None if layout == "sbhd" else torch.tensor(CU, dtype=torch.int32)

    t = x.clone().requires_grad_()
    work = t.detach().requires_grad_()  # megatron's test does the same: the kernel writes into its input
    out = mla_rope_q(work, cos, sin, qk, emb, cu_seqlens_q=cu)
    out.backward(grad)
    assert out.dtype == dtype and out.shape == shape
    assert out.data_ptr() == work.data_ptr() and torch.equal(work, out)  # in place, as megatron documents

    flat_x, flat_g = x.double().reshape(-1, heads, qk + emb), grad.double().reshape(-1, heads, qk + emb)
    ref, ref_grad = flat_x.clone(), flat_g.clone()
    for m, p in enumerate(_positions(layout, shape)):
        r = _matrix(cos, sin, p)
        ref[m, :, qk:] = flat_x[m, :, qk:] @ r.T
        ref_grad[m, :, qk:] = flat_g[m, :, qk:] @ r
    torch.testing.assert_close(out.double().reshape(ref.shape), ref, **TOLS[dtype])
    torch.testing.assert_close(work.grad.double().reshape(ref.shape), ref_grad, **TOLS[dtype])
    assert torch.equal(out[..., :qk], x[..., :qk])  # the no-pe channels are not touched
    assert torch.equal(work.grad[..., :qk], grad[..., :qk])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_kv_matches_the_float64_reference(layout, dtype):
    k_dim, v_dim, emb, heads = 5, 6, 8, 3
    lead = (7, 2) if layout == "sbhd" else (CU[-1],)
    cos, sin = _angles(20, emb, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(*lead, heads, k_dim + v_dim, generator=g).to(dtype).requires_grad_()
    pe = torch.randn(*lead, 1, emb, generator=g).to(dtype).requires_grad_()
    dk = torch.randn(*lead, heads, k_dim + emb, generator=g).to(dtype)
    dv = torch.randn(*lead, heads, v_dim, generator=g).to(dtype)
    cu = None if layout == "sbhd" else torch.tensor(CU, dtype=torch.int32)

    key, value = mla_rope_kv(kv, pe, cos, sin, emb, k_dim, v_dim, cu_seqlens_kv=cu)
    torch.autograd.backward((key, value), (dk, dv))
    assert key.shape == (*lead, heads, k_dim + emb) and value.shape == (*lead, heads, v_dim)
    assert key.dtype == value.dtype == dtype and kv.grad.shape == kv.shape and pe.grad.shape == pe.shape

    tokens = kv[..., 0, 0].numel()
    fkv, fpe = kv.detach().double().reshape(tokens, heads, -1), pe.detach().double().reshape(tokens, emb)
    fdk, fdv = dk.double().reshape(tokens, heads, -1), dv.double().reshape(tokens, heads, -1)
    ref_key = torch.empty(tokens, heads, k_dim + emb, dtype=torch.float64)
    ref_dpe = torch.empty(tokens, emb, dtype=torch.float64)
    for m, p in enumerate(_positions(layout, (*lead, heads))):
        r = _matrix(cos, sin, p)
        ref_key[m, :, :k_dim] = fkv[m, :, :k_dim]
        ref_key[m, :, k_dim:] = r @ fpe[m]
        # the kernel rounds the heads' sum to the gradient's dtype before rotating it back
        ref_dpe[m] = r.T @ fdk[m, :, k_dim:].sum(0).to(dtype).double()
    torch.testing.assert_close(key.double().reshape(ref_key.shape), ref_key, **TOLS[dtype])
    assert torch.equal(value.reshape(tokens, heads, -1), kv.detach()[..., k_dim:].reshape(tokens, heads, -1))
    ref_dkv = torch.cat([fdk[..., :k_dim], fdv], dim=-1)
    assert torch.equal(kv.grad.double().reshape(ref_dkv.shape), ref_dkv)  # copies: exact
    torch.testing.assert_close(pe.grad.double().reshape(ref_dpe.shape), ref_dpe, **TOLS[dtype])


def test_float64_gradients_are_the_jacobians_transposes():
    """torch.autograd.gradcheck in float64 (q through a clone: the function writes into its input)."""
    cos, sin = _angles(9, 8, torch.float64, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(9, 2, 2, 4 + 8, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(9, 2, 2, 3 + 5, generator=g, dtype=torch.float64, requires_grad=True)
    pe = torch.randn(9, 2, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mla_rope_q(x.clone(), cos, sin, 4, 8), (q,))
    assert torch.autograd.gradcheck(lambda a, b: mla_rope_kv(a, b, cos, sin, 8, 3, 5), (kv, pe))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_thd_positions_are_megatrons_token_index(cp_size):
    cu = [0, 8, 24, 40, 48]
    for cp_rank in range(cp_size):
        tokens = cu[-1] // cp_size
        got = token_positions(tokens, torch.tensor(cu), cp_rank, cp_size).tolist()
        assert got == _thd_positions_loop(cu, tokens, cp_rank, cp_size)


def test_context_parallel_shards_equal_the_whole_sequence():
    """Each CP rank's thd share (megatron's load-balanced chunks r and 2cp-1-r of every sequence) gives
    the rows of the whole-sequence result at those tokens."""
    cu, cp, qk, emb, heads = [0, 8, 24], 2, 4, 8, 2
    cos, sin = _angles(16, emb, torch.float32, seed=6)
    x = torch.randn(cu[-1], heads, qk + emb, generator=torch.Generator().manual_seed(7))
    whole = mla_rope_q(x.clone(), cos, sin, qk, emb, cu_seqlens_q=torch.tensor(cu))
    for rank in range(cp):
        rows = []
        for start, end in zip(cu[:-1], cu[1:]):
            chunk = (end - start) // (2 * cp)
            for c in (rank, 2 * cp - 1 - rank):
                rows += range(start + c * chunk, start + (c + 1) * chunk)
        part = mla_rope_q(x[rows].clone(), cos, sin, qk, emb, torch.tensor(cu), cp_rank=rank, cp_size=cp)
        assert torch.equal(part, whole[rows])


def test_bad_arguments_are_named():
    cos, sin = _angles(4, 8, torch.float32)
    with pytest.raises(ValueError, match="last dimension 11 != 4 \\+ 8"):
        mla_rope_q(torch.zeros(4, 1, 1, 11), cos, sin, 4, 8)
    with pytest.raises(ValueError, match="multiple of 4"):
        mla_rope_q(torch.zeros(4, 1, 1, 10), cos[..., :6], sin[..., :6], 4, 6)
    with pytest.raises(NotImplementedError, match="rotary_interleaved"):
        mla_rope_q(torch.zeros(4, 1, 1, 12), cos, sin, 4, 8, rotary_interleaved=True)
    with pytest.raises(ValueError, match="outside cos/sin's 4 rows"):
        mla_rope_q(torch.zeros(5, 1, 1, 12), cos, sin, 4, 8)
    with pytest.raises(ValueError, match="cover the 9 packed tokens"):
        mla_rope_q(torch.zeros(9, 1, 12), cos, sin, 4, 8, cu_seqlens_q=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match="k_pos_emb"):
        mla_rope_kv(torch.zeros(4, 1, 2, 7), torch.zeros(4, 1, 2, 8), cos, sin, 8, 3, 4)


def test_the_cpu_adapter_binds_it_where_megatron_takes_the_names():
    from megatron.core import config

    experimental = megatron_core_version() < Version("0.16")  # @experimental_fn there, and on ours
    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu")
        from megatron.core.fusions import fused_mla_yarn_rope_apply as fused
        from megatron.core.transformer import multi_latent_attention as mla

        cos, sin = _angles(4, 8, torch.float32)
        if experimental:
            from megatron.core.utils import ExperimentalNotEnabledError

            with pytest.raises(ExperimentalNotEnabledError):
                mla.fused_apply_mla_rope_for_q(torch.zeros(4, 1, 2, 12), cos, sin, 4, 8)
            config.set_experimental_flag(True)
        x = torch.randn(4, 1, 2, 12)
        for q_fn in (fused.fused_apply_mla_rope_for_q, mla.fused_apply_mla_rope_for_q):
            assert torch.equal(q_fn(x.clone(), cos, sin, 4, 8), mla_rope_q(x.clone(), cos, sin, 4, 8))
        kv, pe = torch.randn(4, 1, 2, 7), torch.randn(4, 1, 1, 8)
        for kv_fn in (fused.fused_apply_mla_rope_for_kv, mla.fused_apply_mla_rope_for_kv):
            for got, want in zip(kv_fn(kv, pe, cos, sin, 8, 3, 4), mla_rope_kv(kv, pe, cos, sin, 8, 3, 4)):
                assert torch.equal(got, want)
    finally:
        mindspeed_like.reset()
        if experimental:
            config.set_experimental_flag(False)
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    assert fused.fused_apply_mla_rope_for_q.__module__ == fused.__name__


def _mla_attention(apply_rope_fusion: bool) -> dict[str, torch.Tensor]:
    """Layer 0's MLA self-attention of a tiny GPT with YaRN RoPE (scaling 4 over an original 16 of a
    sequence of 32, mscale 1.0 against mscale_all_dim 0.8): output and gradients on fixed inputs."""
    from megatron.core import config as megatron_config

    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
    from mindspeed_like.testing.parity import SEED

    experimental = megatron_core_version() < Version("0.16")
    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu")
        megatron_config.set_experimental_flag(experimental)
        init_parallel(tp=1, seed=SEED)
        model = tiny_gpt(
            multi_latent_attention=True,
            seq_length=32,
            apply_rope_fusion=apply_rope_fusion,
            rope_type="yarn",
            rotary_scaling_factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=4.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=0.8,
        )
        attention = model.decoder.layers[0].self_attention
        gen = torch.Generator().manual_seed(SEED)
        hidden = torch.randn(32, 2, model.config.hidden_size, generator=gen).requires_grad_(True)
        output, _ = attention(hidden, attention_mask=None)
        output.backward(torch.randn(output.shape, generator=gen))
        out = {"output": output.detach().clone(), "d_hidden": hidden.grad.clone()}
        out.update({name: p.grad.clone() for name, p in attention.named_parameters()})
        return out
    finally:
        megatron_config.set_experimental_flag(False)
        destroy_parallel()
        mindspeed_like.reset()


@pytest.mark.skipif(megatron_core_version() < Version("0.14"), reason="0.13 names the original length otherwise")
def test_megatron_mla_with_rope_fusion_equals_its_unfused_path(monkeypatch):
    """megatron's MLASelfAttention with apply_rope_fusion (cos/sin from get_cached_cos_sin, then the two
    functions bound here) against its unfused YaRN path (apply_rotary_pos_emb on split q/k): fp32 output
    and every gradient within 1e-6 of the reference's largest entry (the same products, another order)."""
    from mindspeed_like.kernels import mla_yarn_rope

    calls = []
    for cls in (mla_yarn_rope.MLARopeQ, mla_yarn_rope.MLARopeKV):
        forward = cls.forward
        monkeypatch.setattr(cls, "forward", staticmethod(lambda *a, f=forward, c=cls: calls.append(c) or f(*a)))
    unfused = _mla_attention(False)
    assert calls == []
    fused = _mla_attention(True)
    assert calls == [mla_yarn_rope.MLARopeQ, mla_yarn_rope.MLARopeKV]  # megatron's fused path reached ours
    assert fused.keys() == unfused.keys()
    for name, want in unfused.items():
        error = ((fused[name] - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        assert error < 1e-6, f"{name}: {error:.2e}"
