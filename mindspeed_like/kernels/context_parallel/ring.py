"""Ring attention over megatron's zigzag split (MindSpeed's ``megatron_cp_algo``).

Rank ``r`` holds query/key/value chunks ``(r, 2*CP-1-r)``. At step ``i`` it holds the K/V block of
rank ``src = r - i``; while that block's attention runs, the next block is already on its way
(``isend``/``irecv`` posted before the compute). Causal work per step is the same on every rank
and fully masked blocks are skipped:
  ``i == 0``: both local chunks against both, causal (the two chunks concatenated are in order);
  ``src < r``: both query chunks against the block's FIRST chunk, no mask;
  ``src > r``: the SECOND query chunk against the whole block, no mask.
Partial results are merged exactly with their log-sum-exp. Backward runs the same ring: each
block's dK/dV accumulator travels with the block and arrives home after CP steps: K/V are on their way while
the block computes, and the accumulator of block ``i`` while block ``i+1`` computes (only the last
hop is exposed); dQ stays local.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.attention_dropout import AttentionDropout
from mindspeed_like.kernels.context_parallel.blocks import KVLayout, accumulator, attend, block_grads
from mindspeed_like.kernels.context_parallel.groups import CPGroup, wait


def _plan(i: int, rank: int, size: int, causal: bool, chunk: int):
    """(query rows, key rows, causal) for step ``i``, or None for nothing to compute."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if i == 0:
        return everything, everything, True
    src = (rank - i) % size
    if src < rank:
        return everything, slice(0, chunk), False
    return slice(chunk, None), everything, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, cp: CPGroup, dropout: AttentionDropout | None):
        chunk = q.shape[2] // 2
        masks = dropout.masks(q.device, cp.rank) if dropout else None
        acc = accumulator(q, v, masks)
        layout = KVLayout.of(k, v)
        kv = layout.pack(k, v)
        for i in range(cp.size):
            requests, incoming = cp.ring_exchange(kv) if i < cp.size - 1 else ([], None)
            q_rows, k_rows, diagonal = _plan(i, cp.rank, cp.size, causal, chunk)
            attend(acc, q, *layout.unpack(kv), q_rows, k_rows, diagonal, scale, masks)
            wait(requests)
            kv = incoming
        out, stats = acc.finish(q.dtype)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.causal, ctx.scale, ctx.cp, ctx.dropout = causal, scale, cp, dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, stats = ctx.saved_tensors
        cp, chunk = ctx.cp, q.shape[2] // 2
        dout = dout.contiguous()
        masks = ctx.dropout.masks(q.device, cp.rank) if ctx.dropout else None
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        layout = KVLayout.of(k, v)
        kv = layout.pack(k, v)
        pending, arriving = [], None  # the accumulator of the block in hand, on its way here
        for i in range(cp.size):
            requests, incoming = cp.ring_exchange(kv) if i < cp.size - 1 else ([], None)
            q_rows, k_rows, diagonal = _plan(i, cp.rank, cp.size, ctx.causal, chunk)
            dq_b, dk_b, dv_b = block_grads(
                dout, q, out, stats, *layout.unpack(kv), q_rows, k_rows, diagonal, ctx.scale, masks
            )
            dq[:, :, q_rows] += dq_b
            # this block's share, added to its accumulator once that arrives (it travelled during
            # the compute above); then the accumulator moves on while the next block computes
            wait(pending)
            dkv = arriving if arriving is not None else layout.zeros(kv)
            dk_acc, dv_acc = layout.unpack(dkv)
            dk_acc[:, :, k_rows] += dk_b
            dv_acc[:, :, k_rows] += dv_b
            pending, arriving = cp.ring_exchange(dkv)  # after CP hops it is back with its owner
            wait(requests)
            kv = incoming
        wait(pending)
        dk, dv = layout.unpack(arriving)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(
    q, k, v, cp: CPGroup, *, causal: bool, scale: float, dropout: AttentionDropout | None = None
) -> torch.Tensor:
    """``q [b, n, 2c, d]``, ``k [b, groups, 2c, d]``, ``v [b, groups, 2c, dv]`` (this rank's zigzag chunks)
    -> ``[b, n, 2c, dv]``."""
    if cp.size == 1:
        raise ValueError("ring attention needs a context-parallel group of more than one rank")
    return _RingAttention.apply(q, k, v, causal, scale, cp, dropout)
