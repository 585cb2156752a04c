"""Hybrid (MindSpeed's ``hybrid_cp_algo``): Ulysses inside groups of ``u`` consecutive CP ranks,
ring across them. The all-to-all gives each rank ``heads/u`` and the zigzag chunks of its whole
Ulysses group (``2u`` chunks); the ring then passes K/V blocks between the ranks at the same
position of every Ulysses group (megatron's hierarchical CP groups: level 1 consecutive, level 2
strided). Each step attends every local query chunk to every key chunk of the block by the chunks'
global order (earlier: no mask, same: causal, later: skipped), merged exactly with the log-sum-exp;
backward is the same ring with the dK/dV accumulators travelling home.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.attention_dropout import AttentionDropout
from mindspeed_like.kernels.context_parallel.blocks import KVLayout, accumulator, attend, block_grads
from mindspeed_like.kernels.context_parallel.groups import CPGroup, wait
from mindspeed_like.kernels.context_parallel.ulysses import _AllToAll, check_divisible
from mindspeed_like.kernels.context_parallel.zigzag import rank_chunks


def _ids(outer_rank: int, inner_size: int, cp_size: int) -> list[int]:
    """The chunk ids a rank holds after the all-to-all: its Ulysses group's chunks, rank order."""
    return [c for t in range(inner_size) for c in rank_chunks(outer_rank * inner_size + t, cp_size)]


def _pairs(q_ids: list[int], k_ids: list[int], causal: bool, chunk: int):
    for qi, q_id in enumerate(q_ids):
        for ki, k_id in enumerate(k_ids):
            if causal and k_id > q_id:
                continue
            yield slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk), causal and k_id == q_id


class _ChunkRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, ring: CPGroup, inner_size: int, cp_size: int, dropout):
        chunk = q.shape[2] // (2 * inner_size)
        q_ids = _ids(ring.rank, inner_size, cp_size)
        masks = dropout[0].masks(q.device, dropout[1]) if dropout else None
        acc = accumulator(q, v, masks)
        layout = KVLayout.of(k, v)
        kv = layout.pack(k, v)
        for i in range(ring.size):
            requests, incoming = ring.ring_exchange(kv) if i < ring.size - 1 else ([], None)
            k_ids = _ids((ring.rank - i) % ring.size, inner_size, cp_size)
            block_k, block_v = layout.unpack(kv)
            for q_rows, k_rows, diagonal in _pairs(q_ids, k_ids, causal, chunk):
                attend(acc, q, block_k, block_v, q_rows, k_rows, diagonal, scale, masks)
            wait(requests)
            kv = incoming
        out, stats = acc.finish(q.dtype)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.args = (causal, scale, ring, inner_size, cp_size, dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, stats = ctx.saved_tensors
        causal, scale, ring, inner_size, cp_size, dropout = ctx.args
        masks = dropout[0].masks(q.device, dropout[1]) if dropout else None
        chunk = q.shape[2] // (2 * inner_size)
        q_ids = _ids(ring.rank, inner_size, cp_size)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        layout = KVLayout.of(k, v)
        kv = layout.pack(k, v)
        pending, arriving = [], None
        for i in range(ring.size):
            requests, incoming = ring.ring_exchange(kv) if i < ring.size - 1 else ([], None)
            k_ids = _ids((ring.rank - i) % ring.size, inner_size, cp_size)
            block_k, block_v = layout.unpack(kv)
            shares = []
            for q_rows, k_rows, diagonal in _pairs(q_ids, k_ids, causal, chunk):
                dq_b, dk_b, dv_b = block_grads(
                    dout, q, out, stats, block_k, block_v, q_rows, k_rows, diagonal, scale, masks
                )
                dq[:, :, q_rows] += dq_b
                shares.append((k_rows, dk_b, dv_b))
            wait(pending)
            dkv = arriving if arriving is not None else layout.zeros(kv)
            dk_acc, dv_acc = layout.unpack(dkv)
            for k_rows, dk_b, dv_b in shares:
                dk_acc[:, :, k_rows] += dk_b
                dv_acc[:, :, k_rows] += dv_b
            pending, arriving = ring.ring_exchange(dkv)
            wait(requests)
            kv = incoming
        wait(pending)
        dk, dv = layout.unpack(arriving)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 6)


def hybrid_attention(
    q,
    k,
    v,
    inner: CPGroup,
    outer: CPGroup,
    *,
    causal: bool,
    scale: float,
    dropout: AttentionDropout | None = None,
) -> torch.Tensor:
    """``q [b, n, 2c, d]``, ``k/v [b, groups, 2c, d]`` (this rank's zigzag chunks) -> ``[b, n, 2c, d]``;
    ``inner``: the Ulysses group (consecutive CP ranks), ``outer``: the ring (same position in each)."""
    check_divisible(q.shape[1], k.shape[1], inner.size, "the Ulysses degree of hybrid_cp_algo")
    cp_size = inner.size * outer.size
    whole = [_AllToAll.apply(t, inner, 1, 2) for t in (q, k, v)]  # heads scattered, chunks gathered
    # the masks' stream is seeded by the CP rank: the Ulysses partners hold other heads
    masks_of = (dropout, outer.rank * inner.size + inner.rank) if dropout else None
    out = _ChunkRing.apply(*whole, causal, scale, outer, inner.size, cp_size, masks_of)
    return _AllToAll.apply(out, inner, 2, 1)
