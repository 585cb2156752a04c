"""Flash attention in plain torch ops, one block of query rows at a time, for the shapes the fused
CPU kernel refuses: a value head dim different from the query/key head dim.

Multi-latent attention (DeepSeek-V2/V3) attends with ``d_qk = qk_head_dim + qk_pos_emb_head_dim``
(192) and ``d_v = v_head_dim`` (128). PyTorch's CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``) requires one head dim for q, k and v ("Q/K/V
should have the same head size"); ``scaled_dot_product_attention`` then runs its math kernel,
which materializes the ``[b, n, sq, sk]`` probabilities and saves them for backward: the saving
flash attention exists for is lost. Padding V to ``d_qk`` would make the fused kernel run, at the
price of a padded copy of V, ``d_qk / d_v`` times the PV work and a padded output to slice.

This op keeps the flash property without padding: the forward walks blocks of query rows, each
against every key (the block's fp32 scores ``[b, n, rows, sk]`` are the only quadratic tensor, alive
one block at a time), and saves only ``q, k, v``; the backward recomputes each block's
probabilities with the forward's own ops (``P = softmax(S)``, bitwise the forward's), then
``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO V^T * P))`` (torch's fused softmax backward),
``dQ = dS K scale``, ``dK = dS^T Q scale``.

Semantics are SDPA's (the caller, ``kernels/flash_attention.py``, prepares them as for SDPA):
``keep`` is a boolean mask broadcastable to ``[b, nq, sq, sk]`` with True = attend; ``causal`` is
SDPA's top-left causal; GQA query heads ``h`` use key/value head ``h // (nq / nk)`` (megatron's
``repeat_interleave``), through a broadcast view (k/v are not copied). Scores and softmax in fp32
for every input dtype, the output in the input dtype. Rows with no key kept must not be passed (the
caller substitutes megatron's uniform average for them, as it does for SDPA).

Dropout (``dropout_p``; torch's fused CPU kernel takes none, and its math kernel keeps three fp32
``s x s`` tensors): each block's probabilities are multiplied by its keep-mask and ``1 / (1 - p)``,
as ``torch.nn.functional.dropout`` does. The masks come from the context-parallel kernels' stream
(:class:`~mindspeed_like.kernels.attention_dropout.AttentionDropout`): one seed the forward draws
from the current generator (inside megatron's RNG tracker fork, the tracker's state; under
activation recompute the restored state draws the same seed), the blocks' masks drawn in the same
order forward and backward: nothing quadratic is kept.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.attention_dropout import AttentionDropout

BLOCK_BYTES = 16 * 2**20  # one block's fp32 scores: small enough to stay in cache-friendly chunks


def block_rows(b: int, heads: int, sq: int, sk: int) -> int:
    """Query rows per block so that one block's fp32 scores stay within :data:`BLOCK_BYTES`."""
    return max(1, min(sq, BLOCK_BYTES // max(1, b * heads * sk * 4)))


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, nq, s, d]`` -> ``[b, groups, nq/groups, s, d]`` (a view)."""
    b, n, s, d = t.shape
    return t.view(b, groups, n // groups, s, d)


def _keys(rows: slice, causal: bool, sk: int) -> int:
    """Keys a block of query rows can see: under (top-left) causal attention none past its last row,
    so the block's matmuls skip the masked-out rest (half the work of a causal call)."""
    return min(sk, rows.stop) if causal else sk


def _keep_rows(keep: torch.Tensor | None, rows: slice, groups: int, causal: bool, sk: int, device) -> torch.Tensor:
    """This block's keep-mask over its first ``sk`` keys, broadcastable to ``[b, groups, r, rows, sk]``
    (None: keep all)."""
    block = None
    if keep is not None:
        k4 = keep
        while k4.dim() < 4:
            k4 = k4.unsqueeze(0)
        k4 = k4[..., rows, :sk]
        heads = k4.shape[1]
        block = k4.unsqueeze(2) if heads == 1 else k4.reshape(k4.shape[0], groups, heads // groups, *k4.shape[2:])
    if causal:
        index = torch.arange(rows.start, rows.stop, device=device)[:, None]
        band = torch.arange(sk, device=device)[None, :] <= index
        block = band if block is None else block & band
    return block


def _probs(qb: torch.Tensor, k5: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``softmax(qb k^T)`` of one block in fp32, ``qb`` already fp32 and scaled: the mask fill and the
    softmax run in place on the one score buffer (torch's vectorized softmax is one pass; a
    logsumexp-then-exp formulation took four elementwise passes and was 2x slower end to end)."""
    scores = torch.matmul(qb, k5.transpose(-1, -2))
    if keep is not None:
        scores.masked_fill_(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1)


class _BlockedAttention(torch.autograd.Function):
    """Saves only ``q, k, v`` (and the mask): backward recomputes each block's probabilities with
    the very ops of the forward (bitwise the forward's, no log-sum-exp to keep), and its softmax
    gradient is torch's fused ``_softmax_backward_data`` (``P * (dP - rowsum(dP * P))``). With
    dropout the block's mask is drawn again, in the forward's order, from the forward's seed."""

    @staticmethod
    def forward(ctx, q, k, v, keep, causal: bool, scale: float, dropout: AttentionDropout | None):
        b, nq, sq, _ = q.shape
        groups, sk = k.shape[1], k.shape[2]
        q5, k5, v5 = _grouped(q, groups), k.unsqueeze(2).float(), v.unsqueeze(2).float()
        out = torch.empty(*q5.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        step = block_rows(b, nq, sq, sk)
        masks = dropout.masks(q.device) if dropout is not None else None
        for start in range(0, sq, step):
            rows = slice(start, min(sq, start + step))
            keys = _keys(rows, causal, sk)
            qb = q5[..., rows, :].float() * scale
            probs = _probs(qb, k5[..., :keys, :], _keep_rows(keep, rows, groups, causal, keys, q.device))
            if masks is not None:
                probs.mul_(masks.next(probs.shape)).div_(dropout.keep)
            out[..., rows, :] = torch.matmul(probs, v5[..., :keys, :]).to(q.dtype)
        ctx.save_for_backward(q, k, v, keep)
        ctx.causal, ctx.scale, ctx.dropout = causal, scale, dropout
        return out.view(b, nq, sq, v.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        q, k, v, keep = ctx.saved_tensors
        b, nq, sq, _ = q.shape
        groups, sk = k.shape[1], k.shape[2]
        q5, k5, v5 = _grouped(q, groups), k.unsqueeze(2).float(), v.unsqueeze(2).float()
        do5 = _grouped(dout.contiguous(), groups)
        dq = torch.empty(q5.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k5.shape[:2] + k5.shape[3:], dtype=torch.float32, device=q.device)
        dv = torch.zeros(v5.shape[:2] + v5.shape[3:], dtype=torch.float32, device=q.device)
        step = block_rows(b, nq, sq, sk)
        masks = ctx.dropout.masks(q.device) if ctx.dropout is not None else None
        for start in range(0, sq, step):
            rows = slice(start, min(sq, start + step))
            keys = _keys(rows, ctx.causal, sk)
            kb, vb = k5[..., :keys, :], v5[..., :keys, :]
            qb, dob = q5[..., rows, :].float() * ctx.scale, do5[..., rows, :].float()
            probs = _probs(qb, kb, _keep_rows(keep, rows, groups, ctx.causal, keys, q.device))  # [b, g, r, rows, keys]
            dprobs = torch.matmul(dob, vb.transpose(-1, -2))
            if masks is None:
                dv[..., :keys, :] += torch.matmul(probs.transpose(-1, -2), dob).sum(2)
            else:  # out = (P * M / keep) V: dV = (P * M / keep)^T dO, dP = (dO V^T) * M / keep
                mask = masks.next(probs.shape)
                dv[..., :keys, :] += torch.matmul((probs * mask).div_(ctx.dropout.keep).transpose(-1, -2), dob).sum(2)
                dprobs.mul_(mask).div_(ctx.dropout.keep)
            dscores = torch.ops.aten._softmax_backward_data(dprobs, probs, -1, torch.float32)
            dq[..., rows, :] = torch.matmul(dscores, kb) * ctx.scale
            dk[..., :keys, :] += torch.matmul(dscores.transpose(-1, -2), qb).sum(2)
        return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    keep: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``q [b, nq, sq, d]``, ``k [b, nk, sk, d]``, ``v [b, nk, sk, dv]`` -> ``[b, nq, sq, dv]``
    (SDPA's layout and mask semantics, see the module docstring). ``dropout_p``: on the
    probabilities, drawn from the current CPU generator (pass 0 outside training)."""
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"blocked_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [b, nq, sq, d], "
            "[b, nk, sk, d], [b, nk, sk, dv] with nq a multiple of nk"
        )
    if keep is not None and keep.dtype != torch.bool:
        raise ValueError(f"blocked_attention: keep must be a bool mask (True = attend), got {keep.dtype}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"blocked_attention: dropout_p must be in [0, 1), got {dropout_p}")
    dropout = AttentionDropout.draw(float(dropout_p), q.device) if dropout_p > 0 else None
    return _BlockedAttention.apply(q, k, v, keep, causal, float(scale), dropout)
