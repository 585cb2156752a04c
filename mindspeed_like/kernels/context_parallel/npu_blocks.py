"""The npu backend of context-parallel blocks (contracts in notes/torch-npu-ops.md).

- A block's forward is ``npu_fusion_attention`` in the BNSD layout (GQA groups unexpanded: the op
  takes ``Nq/Nkv`` natively; a diagonal block is causal as sparse_mode 2 with the compressed
  mask), returning the block's softmax max and sum ``[b, n, s, 8]``.
- The merge is ``npu_ring_attention_update`` in the SBH layout, the accumulator kept in SBH so a
  block of query rows is a slice of its first dim. The op ships with newer torch_npu builds and
  MindSpeed (CANN's aclnnRingAttentionUpdate); where torch_npu lacks it the same algebra runs as
  torch ops on the device.
- A block's backward is ``npu_fusion_attention_grad`` given the MERGED max/sum and output
  (``attention_in``): exactly that block's share of dQ/dK/dV.
Verified only against the contract-enforcing emulator (``mindspeed_like.testing.npu_emulator``);
no Ascend hardware exists here.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.backends.npu import torch_npu


def _causal(device: torch.device) -> dict:
    from mindspeed_like.kernels.flash_attention import npu_compressed_mask

    return dict(atten_mask=npu_compressed_mask(device), sparse_mode=2)


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[b, n, sq, d]`` in q's dtype, statistics ``stack(max, sum)`` ``[2, b, n, sq, 8]``)."""
    extra = _causal(q.device) if causal else {}
    out, row_max, row_sum = torch_npu().npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], "BNSD", scale=float(scale), **extra
    )[:3]
    return out, torch.stack([row_max, row_sum])


def block_backward(dout, q, k, v, out, stats, causal: bool, scale: float):
    """(dq, dk, dv) of one block against the merged ``out`` and ``stats`` (dk/dv per GQA group)."""
    extra = _causal(q.device) if causal else {}
    dq, dk, dv, _ = torch_npu().npu_fusion_attention_grad(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        dout.contiguous(),
        q.shape[1],
        "BNSD",
        softmax_max=stats[0].contiguous(),
        softmax_sum=stats[1].contiguous(),
        attention_in=out.contiguous(),
        scale_value=float(scale),
        **extra,
    )
    return dq, dk, dv


def full_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    extra = _causal(q.device) if causal else {}
    return torch_npu().npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], "BNSD", scale=float(scale), **extra
    )[0]


def _sbh(t: torch.Tensor) -> torch.Tensor:
    b, n, s, d = t.shape
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _merge_with_torch(prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum):
    """``npu_ring_attention_update``'s algebra (SBH) as torch ops, for torch_npu builds without it."""
    m1, s1, m2, s2 = (t[..., 0] for t in (prev_max, prev_sum, cur_max, cur_sum))
    new_max = torch.maximum(m1, m2)
    w1 = torch.where(m1 == float("-inf"), 0.0, s1 * torch.exp(m1 - new_max))
    w2 = torch.where(m2 == float("-inf"), 0.0, s2 * torch.exp(m2 - new_max))
    total = w1 + w2
    s, b, h = prev_out.shape
    n = prev_max.shape[1]

    def spread(w):  # [b, n, s] -> [s, b, n*d]
        return w.permute(2, 0, 1).unsqueeze(-1).expand(s, b, n, h // n).reshape(s, b, h)

    out = (prev_out * spread(w1) + cur_out.float() * spread(w2)) / spread(total)
    widen = lambda w: w.unsqueeze(-1).expand(*w.shape, 8)  # noqa: E731
    return out, widen(new_max), widen(total)


class NpuAccumulator:
    """Running (out SBH fp32, softmax max, softmax sum) of some query rows."""

    def __init__(self, q: torch.Tensor, dv: int) -> None:
        b, n, s, _ = q.shape
        self.shape = (b, n, s, dv)
        self.out = torch.zeros(s, b, n * dv, dtype=torch.float32, device=q.device)
        self.max = torch.full((b, n, s, 8), float("-inf"), dtype=torch.float32, device=q.device)
        self.sum = torch.zeros((b, n, s, 8), dtype=torch.float32, device=q.device)

    def merge(self, out: torch.Tensor, stats: torch.Tensor, rows: slice = slice(None)) -> None:
        update = getattr(torch_npu(), "npu_ring_attention_update", None)
        merge = update if callable(update) else _merge_with_torch
        prev = (self.out[rows], self.max[:, :, rows].contiguous(), self.sum[:, :, rows].contiguous())
        new_out, new_max, new_sum = merge(*prev, _sbh(out.float()), stats[0], stats[1])
        self.out[rows], self.max[:, :, rows], self.sum[:, :, rows] = new_out, new_max, new_sum

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, s, d = self.shape
        out = self.out.view(s, b, n, d).permute(1, 2, 0, 3).to(dtype).contiguous()
        return out, torch.stack([self.max, self.sum])
