"""One block of attention with its log-sum-exp, its backward given the FINAL output and
log-sum-exp, and the exact merge of partial results (the algebra of flash attention):

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward of a block against the merged (out, lse) is the block's exact share of the gradient:
with ``D = rowsum(dout * out)``, ``P = exp(S - lse)``, ``dV = P^T dout``,
``dS = P * (dout V^T - D)``, ``dQ = dS K scale``, ``dK = dS^T Q scale``.
On CPU torch's flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward op)
computes both; elsewhere the same formulas in plain torch (fp32 softmax).
Shapes: q ``[b, n, sq, d]``, k/v ``[b, n, sk, d]`` (GQA expanded by the caller), causal = top-left
(query i sees keys <= i; used only on diagonal blocks where sq == sk).
"""

from __future__ import annotations

import torch


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dout32 = dout.float()
    dv = torch.matmul(probs.transpose(-1, -2), dout32)
    dprobs = torch.matmul(dout32, v.float().transpose(-1, -2))
    delta = (dout32 * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k.float())
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _upper(scores: torch.Tensor) -> torch.Tensor:
    sq, sk = scores.shape[-2:]
    return torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)


class Accumulator:
    """Running (out, lse) of some query rows over the key blocks seen so far (fp32)."""

    def __init__(self, like_out: torch.Tensor) -> None:
        self.out = torch.zeros(like_out.shape, dtype=torch.float32, device=like_out.device)
        self.lse = torch.full(like_out.shape[:-1], float("-inf"), dtype=torch.float32, device=like_out.device)

    def merge(self, out: torch.Tensor, lse: torch.Tensor, rows: slice = slice(None)) -> None:
        old_out, old_lse = self.out[..., rows, :], self.lse[..., rows]
        new_lse = torch.logaddexp(old_lse, lse)
        self.out[..., rows, :] = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + out.float() * torch.exp(
            lse - new_lse
        ).unsqueeze(-1)
        self.lse[..., rows] = new_lse


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: ``[b, groups, s, d]`` -> ``[b, heads, s, d]`` (each group repeated for its heads)."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def reduce_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_heads`: the heads of each group summed."""
    b, heads, s, d = t.shape
    return t if groups == heads else t.view(b, groups, heads // groups, s, d).sum(2)


def attend(acc: Accumulator, q, k, v, q_rows: slice, k_rows: slice, diagonal: bool, scale: float) -> None:
    """Rows ``q_rows`` of ``q`` against keys/values ``k_rows`` (GQA groups expanded here), merged."""
    heads = q.shape[1]
    kb, vb = expand_heads(k[:, :, k_rows], heads), expand_heads(v[:, :, k_rows], heads)
    out, lse = block_forward(q[:, :, q_rows], kb, vb, diagonal, scale)
    acc.merge(out, lse, q_rows)


def block_grads(dout, q, out, lse, k, v, q_rows: slice, k_rows: slice, diagonal: bool, scale: float):
    """That block's (dq rows, dk rows, dv rows) in fp32, dk/dv summed back to the GQA groups."""
    heads, groups = q.shape[1], k.shape[1]
    kb, vb = expand_heads(k[:, :, k_rows], heads), expand_heads(v[:, :, k_rows], heads)
    dq, dk, dv = block_backward(
        dout[:, :, q_rows], q[:, :, q_rows], kb, vb, out[:, :, q_rows], lse[:, :, q_rows], diagonal, scale
    )
    return dq.float(), reduce_heads(dk.float(), groups), reduce_heads(dv.float(), groups)
