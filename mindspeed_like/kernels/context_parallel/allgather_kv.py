"""All-gather K/V (MindSpeed's ``kvallgather_cp_algo``, Llama-3 style): every rank gathers the
whole sequence's keys and values (unexpanded GQA groups) and attends with its own queries.
Each local query chunk ``j`` sees keys ``[0, (j+1)*c)`` when causal: the earlier chunks without a
mask and its own chunk causally, two blocks merged with their log-sum-exp. Backward: each block's
dQ locally, dK/dV of the whole sequence summed over the CP ranks and each rank keeps its chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_like.kernels.attention_dropout import AttentionDropout
from mindspeed_like.kernels.context_parallel.blocks import KVLayout, accumulator, attend, block_grads
from mindspeed_like.kernels.context_parallel.groups import CPGroup
from mindspeed_like.kernels.context_parallel.zigzag import gathered_to_natural, rank_chunks, reorder_chunks


def _gather_natural(t: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(cp.size)]
    dist.all_gather(parts, t.contiguous(), group=cp.group)
    return reorder_chunks(torch.cat(parts, dim=2), gathered_to_natural(cp.size), dim=2)


def _blocks(cp: CPGroup, chunk: int, causal: bool):
    """Per local query chunk (its rows here): the key ranges and whether each is causal."""
    for local, j in enumerate(rank_chunks(cp.rank, cp.size)):
        rows = slice(local * chunk, (local + 1) * chunk)
        if not causal:
            yield rows, [(slice(None), False)]
        else:
            earlier = [(slice(0, j * chunk), False)] if j else []
            yield rows, [*earlier, (slice(j * chunk, (j + 1) * chunk), True)]


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, cp: CPGroup, dropout: AttentionDropout | None):
        chunk = q.shape[2] // 2
        k_all, v_all = _gather_natural(k, cp), _gather_natural(v, cp)
        masks = dropout.masks(q.device, cp.rank) if dropout else None
        acc = accumulator(q, v, masks)
        for rows, keys in _blocks(cp, chunk, causal):
            for key_rows, diagonal in keys:
                attend(acc, q, k_all, v_all, rows, key_rows, diagonal, scale, masks)
        out, stats = acc.finish(q.dtype)
        ctx.save_for_backward(q, k_all, v_all, out, stats)
        ctx.causal, ctx.scale, ctx.cp, ctx.dropout = causal, scale, cp, dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_all, v_all, out, stats = ctx.saved_tensors
        cp, chunk = ctx.cp, q.shape[2] // 2
        dout = dout.contiguous()
        masks = ctx.dropout.masks(q.device, cp.rank) if ctx.dropout else None
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        layout = KVLayout.of(k_all, v_all)
        dkv = layout.zeros(q)  # dK and dV of the whole sequence, one buffer for one all-reduce
        dk_all, dv_all = layout.unpack(dkv)
        for rows, keys in _blocks(cp, chunk, ctx.causal):
            for key_rows, diagonal in keys:
                dq_b, dk_b, dv_b = block_grads(
                    dout, q, out, stats, k_all, v_all, rows, key_rows, diagonal, ctx.scale, masks
                )
                dq[:, :, rows] += dq_b
                dk_all[:, :, key_rows] += dk_b
                dv_all[:, :, key_rows] += dv_b
        dist.all_reduce(dkv, group=cp.group)
        dk, dv = (
            torch.cat([t[..., j * chunk : (j + 1) * chunk, :] for j in rank_chunks(cp.rank, cp.size)], dim=-2)
            for t in (dk_all, dv_all)
        )
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None, None, None


def allgather_kv_attention(
    q, k, v, cp: CPGroup, *, causal: bool, scale: float, dropout: AttentionDropout | None = None
) -> torch.Tensor:
    """``q [b, n, 2c, d]``, ``k [b, groups, 2c, d]``, ``v [b, groups, 2c, dv]`` (zigzag chunks)
    -> ``[b, n, 2c, dv]``."""
    return _AllGatherKV.apply(q, k, v, causal, scale, cp, dropout)
