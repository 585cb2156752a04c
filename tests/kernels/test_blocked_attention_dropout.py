"""The blocked attention kernel's dropout (kernels/blocked_attention.py): what the flash-attention
feature runs on a CPU host when megatron's attention dropout is on (torch's CPU flash kernel takes
none). Against a float64 reference built with the very masks the kernel drew (forward and every
gradient), several blocks per call, GQA, causal and an explicit mask; the masks follow the caller's
RNG; nothing s x s is kept for backward."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.kernels import blocked_attention as blocked
from mindspeed_like.kernels.attention_dropout import AttentionDropout
from mindspeed_like.kernels.blocked_attention import blocked_attention
from mindspeed_like.kernels.flash_attention import CAUSAL, flash_attention
from mindspeed_like.testing.memory import SavedBytesMeter

B, NQ, NK, S, D, DV = 2, 4, 2, 40, 8, 6


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NQ, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, NK, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, NK, S, DV, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _reference(q, k, v, scale, keep, causal, dropout: AttentionDropout, step: int):
    """float64 softmax attention with the kernel's own masks, block by block as it drew them."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = NQ // NK
    scores = torch.einsum("bnid,bnjd->bnij", q, k.repeat_interleave(rep, 1)) * scale
    allowed = torch.ones(S, S, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    if keep is not None:
        allowed = allowed & keep
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    masks, stream = [], dropout.masks(torch.device("cpu"))
    for start in range(0, S, step):
        stop = min(S, start + step)
        keys = stop if causal else S  # a causal block draws over the keys it can see
        mask = stream.next((B, NK, rep, stop - start, keys)).reshape(B, NQ, stop - start, keys)
        masks.append(torch.nn.functional.pad(mask, (0, S - keys)))  # probabilities there are 0
    dropped = probs * torch.cat(masks, dim=2).double() / dropout.keep
    out = torch.einsum("bnij,bnjd->bnid", dropped, v.repeat_interleave(rep, 1))
    return out, (q, k, v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask_kind", ["causal", "explicit"])
def test_forward_and_gradients_equal_float64_with_the_same_masks(monkeypatch, dtype, mask_kind):
    monkeypatch.setattr(blocked, "BLOCK_BYTES", B * NQ * 7 * S * 4)  # 7 query rows a block: 6 blocks, the last short
    step = blocked.block_rows(B, NQ, S, S)
    assert step == 7
    q, k, v = _inputs(dtype)
    keep = torch.rand(S, S, generator=torch.Generator().manual_seed(5)) > 0.3 if mask_kind == "explicit" else None
    if keep is not None:
        keep[:, 0] = True  # no fully masked row (the caller's job)
    causal = mask_kind == "causal"
    torch.manual_seed(11)
    out = blocked_attention(q, k, v, scale=0.3, keep=keep, causal=causal, dropout_p=0.25)
    torch.manual_seed(11)
    dropout = AttentionDropout.draw(0.25, torch.device("cpu"))  # the seed the kernel drew
    ref, leaves = _reference(q, k, v, 0.3, keep, causal, dropout, step)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    tol = dict(rtol=2e-5, atol=2e-5)  # the kernel computes in fp32 whatever the input dtype (by design)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for name, mine, theirs in zip("qkv", (q, k, v), leaves):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol, msg=lambda m, n=name: f"d{n}: {m}")
    # dropout did act: some probabilities dropped, and the output differs from no dropout
    assert not dropout.masks(torch.device("cpu")).next((B, NK, 2, step, S)).all()
    plain = blocked_attention(*(t.detach() for t in (q, k, v)), scale=0.3, keep=keep, causal=causal)
    assert not torch.allclose(plain, out.detach())


def test_masks_follow_the_callers_rng_and_are_dropouts():
    """One draw from the current CPU generator per call: the same state gives the same output, the
    next call other masks; the kept fraction and the 1 / (1 - p) scale are dropout's."""
    q = torch.zeros(1, 2, 256, 8)  # uniform probabilities 1/256
    v = torch.ones(1, 2, 256, 8)
    torch.manual_seed(1)
    a = blocked_attention(q, q, v, scale=1.0, dropout_p=0.5)
    b = blocked_attention(q, q, v, scale=1.0, dropout_p=0.5)
    torch.manual_seed(1)
    again = blocked_attention(q, q, v, scale=1.0, dropout_p=0.5)
    assert torch.equal(a, again) and not torch.equal(a, b)
    # each output = sum over 256 keys of keep * 2 / 256: mean 1, std sqrt(1 / 256) = 0.0625
    assert abs(float(a.mean()) - 1.0) < 0.02
    assert 0.05 < float(a.std()) < 0.075
    with pytest.raises(ValueError, match="dropout_p"):
        blocked_attention(q, q, v, scale=1.0, dropout_p=1.0)


def test_flash_attention_on_a_host_with_dropout_keeps_nothing_quadratic():
    """The flash-attention op on CPU with dropout: the blocked kernel, not SDPA's math kernel (three
    fp32 s x s tensors and fp32 copies of q, k, v per head)."""
    s, heads, d = 256, 4, 16
    q, k, v = (torch.randn(s, 1, heads, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.profiler.profile() as prof, SavedBytesMeter() as meter:
        out = flash_attention(q, k, v, scale=d**-0.5, band=CAUSAL, dropout_p=0.1)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" not in ops
    saved = meter.current_bytes(exclude=[q, k, v])
    assert saved < s * s * heads, f"{saved} bytes saved for backward: an s x s matrix is kept"
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
