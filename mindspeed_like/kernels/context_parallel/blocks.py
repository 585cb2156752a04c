"""One block of attention with its softmax statistics, its backward given the FINAL output and
statistics, and the exact merge of partial results (the algebra of flash attention):

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward of a block against the merged (out, statistics) is the block's exact share of the
gradient: with ``D = rowsum(dout * out)``, ``P = exp(S - lse)``, ``dV = P^T dout``,
``dS = P * (dout V^T - D)``, ``dQ = dS K scale``, ``dK = dS^T Q scale``.

Per backend (``kernels.backend``): ``portable`` on CPU uses torch's flash kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward op), which returns the
log-sum-exp; ``reference`` (and ``portable`` off CPU) the same formulas in plain torch (fp32
softmax); ``npu`` torch_npu's ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` and the
``npu_ring_attention_update`` merge (``npu_blocks``), whose statistics are softmax max and sum.
The statistics travel as one opaque tensor whose 4th dim is the query row (portable:
``lse[None]`` ``[1, b, n, s]``; npu: ``stack(max, sum)`` ``[2, b, n, s, 8]``).
Shapes: q, k ``[b, n|groups, s, d]``, v ``[b, groups, sk, dv]`` (GQA groups unexpanded; ``dv`` may differ
from ``d``: multi-latent attention), causal = top-left
(query i sees keys <= i; used only on diagonal blocks where sq == sk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindspeed_like.kernels.backend import backend_for
from mindspeed_like.kernels.blocked_attention import blocked_attention
from mindspeed_like.kernels.context_parallel import npu_blocks


def _flash_cpu(q: torch.Tensor, v: torch.Tensor) -> bool:
    """torch's CPU flash kernel: portable backend on CPU, one head dim for q, k and v (multi-latent
    attention's V head dim differs: the plain formulas run those blocks)."""
    return backend_for(q) == "portable" and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


@dataclass(frozen=True)
class KVLayout:
    """K and V packed into ONE flat buffer, so a block travels the ring as one message whatever
    the V head dim (multi-latent attention: ``d_v != d_qk``); unpacked as contiguous views."""

    k_shape: torch.Size
    v_shape: torch.Size

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> KVLayout:
        return cls(k.shape, v.shape)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def unpack(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.k_shape.numel()
        return kv[:n].view(self.k_shape), kv[n:].view(self.v_shape)

    def zeros(self, like: torch.Tensor) -> torch.Tensor:
        """An fp32 (dK, dV) accumulator in the same packed layout."""
        return torch.zeros(self.k_shape.numel() + self.v_shape.numel(), dtype=torch.float32, device=like.device)


def block_forward(q, k, v, causal: bool, scale: float, masks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse fp32 ``[b, n, sq]``) of q against k/v of q's head count; with a
    dropout :class:`~.dropout.MaskStream`, the probabilities are dropped by its next mask (the lse
    is the undropped normalizer, so merges stay exact)."""
    if _flash_cpu(q, v) and masks is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if masks is not None:
        probs = probs * masks.next(probs.shape) / masks.keep
    out = torch.matmul(probs, v.float()).to(q.dtype)
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, masks=None):
    if _flash_cpu(q, v) and masks is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dout32 = dout.float()
    dprobs = torch.matmul(dout32, v.float().transpose(-1, -2))
    if masks is None:
        dv = torch.matmul(probs.transpose(-1, -2), dout32)
    else:
        kept = masks.next(probs.shape) / masks.keep
        dv = torch.matmul((probs * kept).transpose(-1, -2), dout32)
        dprobs = dprobs * kept
    delta = (dout32 * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k.float())
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _upper(scores: torch.Tensor) -> torch.Tensor:
    sq, sk = scores.shape[-2:]
    return torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)


class Accumulator:
    """Running (out, lse) of some query rows over the key blocks seen so far (fp32); ``out`` has
    the V head dim ``dv``."""

    def __init__(self, q: torch.Tensor, dv: int) -> None:
        self.out = torch.zeros(*q.shape[:-1], dv, dtype=torch.float32, device=q.device)
        self.lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)

    def merge(self, out: torch.Tensor, lse: torch.Tensor, rows: slice = slice(None)) -> None:
        old_out, old_lse = self.out[..., rows, :], self.lse[..., rows]
        new_lse = torch.logaddexp(old_lse, lse)
        self.out[..., rows, :] = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + out.float() * torch.exp(
            lse - new_lse
        ).unsqueeze(-1)
        self.lse[..., rows] = new_lse

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in ``dtype``, statistics ``[1, b, n, s]``) to save for the backward."""
        return self.out.to(dtype), self.lse.unsqueeze(0)


def _npu(q: torch.Tensor, masks) -> bool:
    """The npu ops, unless dropout: then the plain formulas with our masks (see kernels/attention_dropout.py)."""
    return backend_for(q) == "npu" and masks is None


def accumulator(q: torch.Tensor, v: torch.Tensor, masks=None):
    """The running result of ``q``'s rows for its backend (output head dim: ``v``'s)."""
    return npu_blocks.NpuAccumulator(q, v.shape[-1]) if _npu(q, masks) else Accumulator(q, v.shape[-1])


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: ``[b, groups, s, d]`` -> ``[b, heads, s, d]`` (each group repeated for its heads)."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def reduce_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_heads`: the heads of each group summed."""
    b, heads, s, d = t.shape
    return t if groups == heads else t.view(b, groups, heads // groups, s, d).sum(2)


def attend(acc, q, k, v, q_rows: slice, k_rows: slice, diagonal: bool, scale: float, masks=None) -> None:
    """Rows ``q_rows`` of ``q`` against keys/values ``k_rows``, merged into ``acc``."""
    if _npu(q, masks):
        out, stats = npu_blocks.block_forward(q[:, :, q_rows], k[:, :, k_rows], v[:, :, k_rows], diagonal, scale)
        acc.merge(out, stats, q_rows)
        return
    heads = q.shape[1]
    kb, vb = expand_heads(k[:, :, k_rows], heads), expand_heads(v[:, :, k_rows], heads)
    out, lse = block_forward(q[:, :, q_rows], kb, vb, diagonal, scale, masks)
    acc.merge(out, lse, q_rows)


def block_grads(dout, q, out, stats, k, v, q_rows: slice, k_rows: slice, diagonal: bool, scale: float, masks=None):
    """That block's (dq rows, dk rows, dv rows) in fp32, dk/dv summed back to the GQA groups;
    ``out``/``stats`` are the merged results the forward saved (``Accumulator.finish``)."""
    rows = (dout[:, :, q_rows], q[:, :, q_rows])
    stats = stats[:, :, :, q_rows]
    if _npu(q, masks):
        dq, dk, dv = npu_blocks.block_backward(
            *rows, k[:, :, k_rows], v[:, :, k_rows], out[:, :, q_rows], stats, diagonal, scale
        )
        return dq.float(), dk.float(), dv.float()
    heads, groups = q.shape[1], k.shape[1]
    kb, vb = expand_heads(k[:, :, k_rows], heads), expand_heads(v[:, :, k_rows], heads)
    dq, dk, dv = block_backward(*rows, kb, vb, out[:, :, q_rows], stats[0], diagonal, scale, masks)
    return dq.float(), reduce_heads(dk.float(), groups), reduce_heads(dv.float(), groups)


def full_attention(q, k, v, causal: bool, scale: float, masks=None) -> torch.Tensor:
    """Attention of the whole sequence (Ulysses), differentiable, GQA groups unexpanded; with
    dropout masks the plain formulas under autograd (the whole score matrix is held)."""
    if masks is not None:
        heads = q.shape[1]
        scores = torch.matmul(q.float(), expand_heads(k, heads).float().transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(_upper(scores), float("-inf"))
        probs = torch.softmax(scores, dim=-1) * masks.next(scores.shape) / masks.keep
        return torch.matmul(probs, expand_heads(v, heads).float()).to(q.dtype)
    if _npu(q, masks):
        return npu_blocks.full_attention(q, k, v, causal, scale)
    if q.device.type == "cpu" and q.shape[-1] != v.shape[-1]:  # the CPU flash kernel needs one head dim
        return blocked_attention(q, k, v, scale=scale, causal=causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
