"""The emulator's context-parallel attention ops against float64 math, and their contracts.

npu_fusion_attention's softmax max/sum, npu_fusion_attention_grad given merged statistics, and
npu_ring_attention_update's merge: what the npu backend of context parallelism relies on
(notes/torch-npu-ops.md). The emulator computes in fp32; tolerances are fp32 round-off.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu

B, N, G, S, D = 2, 4, 2, 12, 16
SCALE = D**-0.5


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, heads, S, D, generator=g) for heads in (N, G, G))


def _scores64(q, k, causal: bool) -> torch.Tensor:
    scores = q.double() @ k.double().repeat_interleave(N // G, 1).transpose(-1, -2) * SCALE
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _causal():
    return dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=2)


@pytest.mark.parametrize("causal", [True, False])
def test_forward_returns_softmax_max_and_sum(causal):
    q, k, v = _qkv()
    scores = _scores64(q, k, causal)
    row_max = scores.amax(-1)
    row_sum = torch.exp(scores - row_max.unsqueeze(-1)).sum(-1)
    with emulated_torch_npu() as npu:
        out, got_max, got_sum = npu.npu_fusion_attention(
            q, k, v, N, "BNSD", scale=SCALE, **(_causal() if causal else {})
        )[:3]
    assert got_max.shape == got_sum.shape == (B, N, S, 8) and got_max.dtype == torch.float32
    assert torch.equal(got_max[..., :1].expand_as(got_max), got_max)  # the 8 entries identical
    torch.testing.assert_close(got_max[..., 0].double(), row_max, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_sum[..., 0].double(), row_sum, rtol=1e-6, atol=1e-6)
    ref = torch.softmax(scores, -1) @ v.double().repeat_interleave(N // G, 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["BNSD", "SBH"])
def test_grad_with_the_forward_statistics_is_the_attention_gradient(layout):
    q, k, v = _qkv(1)
    dout = torch.randn(B, N, S, D, generator=torch.Generator().manual_seed(2))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.softmax(_scores64(q64, k64, True), -1) @ v64.repeat_interleave(N // G, 1)
    ref.backward(dout.double())

    def lay(t):  # BNSD -> the layout under test
        return t if layout == "BNSD" else t.permute(2, 0, 1, 3).reshape(S, B, -1)

    with emulated_torch_npu() as npu:
        out, row_max, row_sum = npu.npu_fusion_attention(lay(q), lay(k), lay(v), N, layout, scale=SCALE, **_causal())[
            :3
        ]
        dq, dk, dv, dpse = npu.npu_fusion_attention_grad(
            lay(q), lay(k), lay(v), lay(dout), N, layout,
            softmax_max=row_max, softmax_sum=row_sum, attention_in=out, scale_value=SCALE, **_causal(),
        )  # fmt: skip
    assert dpse.numel() == 0 and npu.calls["npu_fusion_attention_grad"] == 1
    for got, want in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        torch.testing.assert_close(got.double(), lay(want), rtol=1e-5, atol=1e-5)


def test_ring_update_merges_two_key_halves_into_full_attention():
    q, k, v = _qkv(3)
    half = S // 2
    full = torch.softmax(_scores64(q, k, False), -1) @ v.double().repeat_interleave(N // G, 1)

    def sbh(t):
        return t.permute(2, 0, 1, 3).reshape(S, B, -1)

    with emulated_torch_npu() as npu:
        parts = [
            npu.npu_fusion_attention(q, k[:, :, keys], v[:, :, keys], N, "BNSD", scale=SCALE)[:3]
            for keys in (slice(0, half), slice(half, None))
        ]
        (o1, m1, s1), (o2, m2, s2) = parts
        out, m, s = npu.npu_ring_attention_update(sbh(o1), m1, s1, sbh(o2), m2, s2)
    torch.testing.assert_close(out.double(), sbh(full), rtol=1e-5, atol=1e-6)
    scores = _scores64(q, k, False)
    torch.testing.assert_close(m[..., 0].double(), scores.amax(-1), rtol=1e-6, atol=1e-6)
    assert m.shape == s.shape == (B, N, S, 8)


def test_ring_update_with_an_empty_side_keeps_the_other():
    q, k, v = _qkv(4)
    with emulated_torch_npu() as npu:
        o, m, s = npu.npu_fusion_attention(q, k, v, N, "BNSD", scale=SCALE)[:3]
        o = o.permute(2, 0, 1, 3).reshape(S, B, -1)
        empty = (torch.zeros_like(o), torch.full_like(m, float("-inf")), torch.zeros_like(s))
        out, m2, s2 = npu.npu_ring_attention_update(*empty, o, m, s)
    assert torch.equal(m2, m) and torch.allclose(out, o) and torch.allclose(s2, s)


def _grad_call(**change):
    q, k, v = _qkv()
    with emulated_torch_npu() as npu:
        out, row_max, row_sum = npu.npu_fusion_attention(q, k, v, N, "BNSD", scale=SCALE)[:3]
    call = dict(softmax_max=row_max, softmax_sum=row_sum, attention_in=out, scale_value=SCALE)
    call.update(change)
    return (q, k, v, torch.ones_like(out), N, "BNSD"), {n: x for n, x in call.items() if x is not None}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(scale_value=None, scale=SCALE), "unexpected keyword 'scale'"),
        (dict(softmax_max=None), "softmax_max .* must be given"),
        (dict(attention_in=None), "attention_in"),
        (dict(softmax_sum=torch.ones(B, N, S, 8, dtype=torch.float16)), "must be fp32"),
        (dict(softmax_sum=torch.ones(B, N, S, 1)), r"\[2, 4, 12, 8\]"),
        (dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).tril(), sparse_mode=2), "wrong polarity"),
    ],
    ids=["scale-name", "no-max", "no-out", "fp16-stats", "stat-shape", "mask-polarity"],
)
def test_grad_rejects_wrong_calls(change, message):
    args, kwargs = _grad_call(**change)
    with emulated_torch_npu() as npu, pytest.raises(ContractError, match=message):
        npu.npu_fusion_attention_grad(*args, **kwargs)


def test_ring_update_rejects_wrong_calls():
    out = torch.zeros(S, B, N * 64)
    stat = torch.zeros(B, N, S, 8)
    with emulated_torch_npu() as npu:
        with pytest.raises(ContractError, match="layout must be"):
            npu.npu_ring_attention_update(out, stat, stat, out, stat, stat, layout="BSH")
        with pytest.raises(ContractError, match=r"\[B, N, S, 8\]"):
            npu.npu_ring_attention_update(out, stat[..., :1], stat[..., :1], out, stat[..., :1], stat[..., :1])
        with pytest.raises(ContractError, match="share one"):
            npu.npu_ring_attention_update(out, stat, stat, out.bfloat16(), stat, stat)
        tnd, tnd_stat = torch.zeros(S, N, 32), torch.zeros(S, N, 8)
        with pytest.raises(ContractError, match="multiple of 64"):
            npu.npu_ring_attention_update(tnd, tnd_stat, tnd_stat, tnd, tnd_stat, tnd_stat, [0, S], "TND")
        tnd = torch.zeros(S, N, 64)
        with pytest.raises(ContractError, match="needs actual_seq_qlen"):
            npu.npu_ring_attention_update(tnd, tnd_stat, tnd_stat, tnd, tnd_stat, tnd_stat, None, "TND")
