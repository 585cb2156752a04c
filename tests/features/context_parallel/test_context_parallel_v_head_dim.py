"""Context-parallel attention with a value head dim different from the query/key head dim
(multi-latent attention: ``d_v = v_head_dim``, ``d_qk = qk_head_dim + qk_pos_emb_head_dim``).

Every rank builds the same full q/k/v (``d_v != d_qk``) and output gradient, keeps megatron's
zigzag chunks, runs an algorithm and compares output and q/k/v gradients with a one-rank float64
reference. fp32 within 1e-6 relative per tensor (as the equal-dim kernel tests: fp32 blocks merged
exactly with their log-sum-exp); bf16 2e-2. K and V travel packed in one buffer (``KVLayout``);
a broken unpacking or an accumulator with the wrong head dim fails these (the equal-dim tests
cannot see it: ``torch.stack`` worked there).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.testing import run_distributed

SLOW = pytest.mark.slow


def _reference(q, k, v, dout, causal, scale):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    scores = q64 @ k64.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, -1) @ v64.repeat_interleave(rep, 1)
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _mine(t, rank, size):
    chunks = t.chunk(2 * size, dim=2)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=2)


def worker(algo: str, causal: bool, heads: int, groups: int, d: int, dv: int, dtype_name: str, backend: str) -> dict:
    import contextlib

    import torch.distributed as dist

    from mindspeed_like.kernels.backend import force_backend
    from mindspeed_like.kernels.context_parallel import (
        CPGroup,
        allgather_kv_attention,
        hybrid_attention,
        ring_attention,
        ulysses_attention,
    )
    from mindspeed_like.testing.npu_emulator import emulated_torch_npu

    size, rank = dist.get_world_size(), dist.get_rank()
    cp = CPGroup(dist.group.WORLD, tuple(range(size)))
    g = torch.Generator().manual_seed(7)
    seq = 8 * size
    q, k = torch.randn(2, heads, seq, d, generator=g), torch.randn(2, groups, seq, d, generator=g)
    v, dout = torch.randn(2, groups, seq, dv, generator=g), torch.randn(2, heads, seq, dv, generator=g)
    scale = d**-0.5
    ref = _reference(q, k, v, dout, causal, scale)
    dtype = getattr(torch, dtype_name)
    local = [_mine(t, rank, size).to(dtype).requires_grad_() for t in (q, k, v)]
    with contextlib.ExitStack() as stack:
        npu = stack.enter_context(emulated_torch_npu())
        stack.enter_context(force_backend(backend))
        if algo == "hybrid":  # the whole CP group as the Ulysses group: a ring of one
            out = hybrid_attention(*local, cp, CPGroup(dist.new_group([rank]), (rank,)), causal=causal, scale=scale)
        else:
            fn = {"ring": ring_attention, "ulysses": ulysses_attention, "allgather_kv": allgather_kv_attention}[algo]
            out = fn(*local, cp, causal=causal, scale=scale)
        out.backward(_mine(dout, rank, size).to(dtype))
    got = (out.detach(), *(t.grad for t in local))
    errors = {
        name: ((a.double() - _mine(b, rank, size)).norm() / _mine(b, rank, size).norm()).item()
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)
    }
    return {**errors, "shape": tuple(out.shape), "npu_calls": npu.calls["npu_fusion_attention"]}


@pytest.mark.parametrize(
    "algo, causal, backend",
    [
        ("ring", True, "portable"),
        ("allgather_kv", True, "portable"),
        ("ulysses", True, "portable"),
        pytest.param("ring", False, "portable", marks=SLOW),
        pytest.param("hybrid", True, "portable", marks=SLOW),
        ("ring", True, "npu"),
        pytest.param("allgather_kv", True, "npu", marks=SLOW),
        pytest.param("ulysses", True, "npu", marks=SLOW),
    ],
)
def test_fp32_v_head_dim_differs_matches_one_rank_float64(algo, causal, backend):
    """d_qk 12, d_v 8 (MLA's d_v < d_qk), GQA 4 heads over 2 groups, CP=2."""
    for rank in run_distributed(worker, 2, algo, causal, 4, 2, 12, 8, "float32", backend, timeout=180):
        assert rank.pop("shape") == (2, 4, 8, 8)  # this rank's 8 of 16 tokens, d_v
        calls = rank.pop("npu_calls")
        assert (calls > 0) == (backend == "npu"), calls
        assert all(err < 1e-6 for err in rank.values()), rank


@pytest.mark.slow
def test_bf16_v_head_dim_differs_within_stated_tolerance():
    for rank in run_distributed(worker, 2, "ring", True, 4, 2, 12, 8, "bfloat16", "portable", timeout=180):
        rank.pop("shape"), rank.pop("npu_calls")
        assert all(err < 2e-2 for err in rank.values()), rank
