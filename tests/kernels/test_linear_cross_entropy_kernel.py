"""The chunked output-layer + cross-entropy kernel against a float64 reference (one rank) and
against megatron's own ``vocab_parallel_cross_entropy`` over TP=2 vocab shards."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.kernels.linear_cross_entropy import auto_chunk_tokens, linear_cross_entropy
from mindspeed_like.testing import run_distributed


def _inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    grad = torch.rand(tokens, generator=g)
    grad[::3] = 0.0  # a loss mask with zeros
    return h, w, labels, grad


def _reference(h, w, labels, grad):
    """float64: loss and d(sum(grad * loss)) / d(hidden, weight)."""
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    logits = h64 @ w64.t()
    loss = torch.logsumexp(logits, -1) - logits.gather(1, labels.unsqueeze(-1)).squeeze(-1)
    (loss * grad.double()).sum().backward()
    return loss.detach(), h64.grad, w64.grad


def _ours(h, w, labels, grad, chunk):
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, chunk_tokens=chunk)
    (loss * grad).sum().backward()
    return loss.detach(), h.grad, w.grad


def _rel(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


# odd sizes: vocab and tokens not divisible by the chunk; a chunk of one token; one larger than all
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 0], ids=["one-token", "odd", "64", "larger-than-all", "auto"])
def test_fp32_matches_float64_reference(chunk):
    h, w, labels, grad = _inputs(tokens=45, hidden=24, vocab=131, dtype=torch.float32)
    loss, gh, gw = _ours(h, w, labels, grad, chunk)
    ref_loss, ref_gh, ref_gw = _reference(h, w, labels, grad)
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    assert _rel(loss, ref_loss) < 1e-6
    assert _rel(gh, ref_gh) < 1e-6
    assert _rel(gw, ref_gw) < 1e-6
    assert torch.all(gh[::3] == 0)  # masked tokens get no gradient


def test_bf16_within_stated_tolerance():
    """bf16 logits are rounded before the fp32 softmax, as megatron's output layer does: the loss
    within 1e-2 relative of float64 (bf16 has 8 bits of mantissa), gradients within 2e-2."""
    h, w, labels, grad = _inputs(tokens=64, hidden=32, vocab=257, dtype=torch.bfloat16)
    loss, gh, gw = _ours(h, w, labels, grad, chunk=10)
    ref_loss, ref_gh, ref_gw = _reference(h, w, labels, grad)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert _rel(loss, ref_loss) < 1e-2
    assert _rel(gh, ref_gh) < 2e-2
    assert _rel(gw, ref_gw) < 2e-2


@pytest.mark.parametrize("chunk", [1, 7, 0], ids=["one-token", "odd", "auto"])
def test_accumulation_fusion_adds_every_row_block_to_main_grad(chunk):
    """With gradient-accumulation fusion the weight gradient goes into ``main_grad`` slice by
    slice of the vocabulary; what was there (an earlier micro-batch) stays, and megatron's dummy
    gradient comes back so DDP's hook runs."""
    h, w, labels, grad = _inputs(tokens=45, hidden=24, vocab=131, dtype=torch.float32)
    _, ref_gh, ref_gw = _reference(h, w, labels, grad)
    earlier = torch.randn(w.shape, dtype=torch.float64)
    weight = w.clone().requires_grad_()
    weight.main_grad = earlier.float().clone()
    weight.grad_added_to_main_grad = False
    hidden = h.clone().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, accumulation_fusion=True)
    (loss * grad).sum().backward()
    assert weight.grad_added_to_main_grad is True
    assert weight.grad is not None and weight.grad.shape == w.shape  # the dummy
    assert _rel(weight.main_grad - earlier, ref_gw) < 1e-6
    assert _rel(hidden.grad, ref_gh) < 1e-6


def test_leading_dimensions_follow_labels():
    h, w, labels, grad = _inputs(tokens=12, hidden=8, vocab=19, dtype=torch.float32)
    loss = linear_cross_entropy(h.view(3, 4, 8), w, labels.view(3, 4), chunk_tokens=5)
    assert loss.shape == (3, 4)
    assert torch.allclose(loss.reshape(-1), _reference(h, w, labels, grad)[0].float(), rtol=1e-6)


def test_bad_input_is_refused_with_the_reason():
    h, w, labels, _ = _inputs(tokens=6, hidden=8, vocab=19, dtype=torch.float32)
    with pytest.raises(ValueError, match="disagree on the tokens"):
        linear_cross_entropy(h, w, labels[:5])
    with pytest.raises(ValueError, match="hidden size 8 != the output weight's 7"):
        linear_cross_entropy(h, w[:, :7], labels)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 0"):
        linear_cross_entropy(h, w, labels, chunk_tokens=-1)


def test_auto_chunk_is_bounded_by_memory():
    assert auto_chunk_tokens(128 * 1024) * 128 * 1024 * 4 <= 64 * 2**20
    assert auto_chunk_tokens(10) == 8192
    assert auto_chunk_tokens(10**9) == 64


def _tp2_against_megatron(chunk: int) -> dict:
    """Each rank holds half of an odd vocabulary (2 x 67); megatron's vocab-parallel CE on the
    full logits of this shard is the reference."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel

    mindspeed_like.configure(device="cpu")
    init_parallel(tp=2)  # megatron's CE reads its TP group from parallel_state
    rank, group = dist.get_rank(), parallel_state.get_tensor_model_parallel_group()
    h, w, labels, grad = _inputs(tokens=33, hidden=16, vocab=134, dtype=torch.float32)
    shard = w[rank * 67 : (rank + 1) * 67]

    ref_h, ref_w = h.clone().requires_grad_(), shard.clone().requires_grad_()
    logits = (ref_h @ ref_w.t()).unsqueeze(1)  # [s, b=1, V/TP]
    ref_loss = vocab_parallel_cross_entropy(logits, labels.unsqueeze(1)).squeeze(1)
    (ref_loss * grad).sum().backward()

    ours_h, ours_w = h.clone().requires_grad_(), shard.clone().requires_grad_()
    loss = linear_cross_entropy(ours_h, ours_w, labels, chunk_tokens=chunk, vocab_start=rank * 67, tp_group=group)
    (loss * grad).sum().backward()
    destroy_parallel()
    return {
        "loss": _rel(loss, ref_loss.detach().double()),
        "grad_hidden": _rel(ours_h.grad, ref_h.grad.double()),  # this shard's partial d hidden
        "grad_weight": _rel(ours_w.grad, ref_w.grad.double()),
    }


@pytest.mark.slow
def test_tp2_vocab_shards_match_megatron_vocab_parallel_cross_entropy():
    for rank_result in run_distributed(_tp2_against_megatron, 2, 5, timeout=120):
        assert all(v < 1e-6 for v in rank_result.values()), rank_result
