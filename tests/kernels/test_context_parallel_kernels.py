"""Context-parallel attention against one-rank attention over the whole sequence (float64).

Every rank builds the same full q/k/v and output gradient, keeps megatron's zigzag chunks
(``r`` and ``2*CP-1-r``), runs an algorithm, and compares its output and its q/k/v gradients
with the float64 reference's rows for those chunks. fp32 within 1e-6 (relative, over each
tensor); bf16 within 2e-2 (bf16 inputs and outputs; fp32 merge and accumulation).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.testing import run_distributed

ALGOS = ("ring", "ulysses", "allgather_kv")


def _full(b, heads, groups, seq, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, seq, d, generator=g)
    k = torch.randn(b, groups, seq, d, generator=g)
    v = torch.randn(b, groups, seq, d, generator=g)
    dout = torch.randn(b, heads, seq, d, generator=g)
    return q, k, v, dout


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


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _hybrid_groups(size: int, inner: int):
    """megatron's hierarchical CP groups: level 1 consecutive ranks, level 2 strided (every rank
    creates every group, as torch requires)."""
    import torch.distributed as dist

    from mindspeed_like.kernels.context_parallel import CPGroup

    rank, mine = dist.get_rank(), {}
    for start in range(0, size, inner):
        ranks = tuple(range(start, start + inner))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine["inner"] = CPGroup(group, ranks)
    for offset in range(inner):
        ranks = tuple(range(offset, size, inner))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine["outer"] = CPGroup(group, ranks)
    return mine["inner"], mine["outer"]


def worker(algo, causal, heads, groups, d, dtype_name, backend="portable", merge_op=True) -> dict:
    """Errors per tensor; with backend "npu" (through the torch_npu emulator) also the op calls."""
    import contextlib

    from mindspeed_like.kernels.backend import force_backend
    from mindspeed_like.testing.npu_emulator import emulated_torch_npu

    if backend != "npu":
        return _run(algo, causal, heads, groups, d, dtype_name)
    with contextlib.ExitStack() as stack:
        npu = stack.enter_context(emulated_torch_npu())
        stack.enter_context(force_backend("npu"))
        if not merge_op:  # a torch_npu build without the fused merge: the torch algebra runs instead
            del npu.npu_ring_attention_update
        errors = _run(algo, causal, heads, groups, d, dtype_name)
        return {**errors, "calls": dict(npu.calls)}


def _run(algo, causal, heads, groups, d, dtype_name) -> dict:
    import torch.distributed as dist

    from mindspeed_like.kernels.context_parallel import (
        CPGroup,
        allgather_kv_attention,
        hybrid_attention,
        ring_attention,
        ulysses_attention,
    )

    size, rank = dist.get_world_size(), dist.get_rank()
    cp = CPGroup(dist.group.WORLD, tuple(range(size)))
    dtype = getattr(torch, dtype_name)
    q, k, v, dout = _full(2, heads, groups, 8 * size, d)
    scale = d**-0.5
    ref = _reference(q, k, v, dout, causal, scale)
    local = [_mine(t, rank, size).to(dtype).requires_grad_() for t in (q, k, v)]
    if algo.startswith("hybrid"):
        inner, outer = _hybrid_groups(size, int(algo.split("-")[1]))
        out = hybrid_attention(*local, inner, outer, causal=causal, scale=scale)
    else:
        fn = {"ring": ring_attention, "ulysses": ulysses_attention, "allgather_kv": allgather_kv_attention}[algo]
        out = fn(*local, cp, causal=causal, scale=scale)
    out.backward(_mine(dout, rank, size).to(dtype))
    got = (out.detach(), *(t.grad for t in local))
    return {name: _rel(a, _mine(b, rank, size)) for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}


SLOW = pytest.mark.slow  # each case spawns CP processes (~5 s); the default lane keeps one of each kind
CASES = [
    # (cp, causal, heads, groups, head dim)
    (2, True, 4, 2, 13),  # causal, GQA, odd head dim
    pytest.param(2, False, 4, 4, 16, marks=SLOW),
    pytest.param(2, True, 4, 4, 16, marks=SLOW),
    pytest.param(2, True, 2, 2, 8, marks=SLOW),
    pytest.param(4, True, 4, 4, 8, marks=SLOW),
    pytest.param(4, False, 8, 4, 8, marks=SLOW),
]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("cp, causal, heads, groups, d", CASES)
def test_fp32_matches_one_rank_float64(algo, cp, causal, heads, groups, d):
    for rank in run_distributed(worker, cp, algo, causal, heads, groups, d, "float32", timeout=120):
        assert all(err < 1e-6 for err in rank.values()), rank


# ---------------------------------------------------------------- the npu backend, through the emulator
# npu_fusion_attention (BNSD, GQA unexpanded, causal as sparse_mode 2) returning softmax max/sum,
# npu_ring_attention_update merging them, npu_fusion_attention_grad given the merged results; the
# emulator enforces each op's documented contract. Verified here only: there is no Ascend device.
NPU_CASES = [
    ("ring", 2, True, 4, 2, 13),
    pytest.param("ring", 4, True, 4, 4, 8, marks=SLOW),
    pytest.param("ring", 2, False, 4, 1, 16, marks=SLOW),
    ("allgather_kv", 2, True, 4, 2, 13),
    pytest.param("allgather_kv", 4, False, 4, 2, 8, marks=SLOW),
    ("ulysses", 2, True, 4, 2, 13),
    pytest.param("hybrid-2", 4, True, 4, 4, 8, marks=SLOW),
]


@pytest.mark.parametrize("algo, cp, causal, heads, groups, d", NPU_CASES)
def test_npu_backend_matches_one_rank_float64(algo, cp, causal, heads, groups, d):
    for rank in run_distributed(worker, cp, algo, causal, heads, groups, d, "float32", "npu", timeout=180):
        calls = rank.pop("calls")
        assert all(err < 1e-6 for err in rank.values()), rank
        assert calls["npu_fusion_attention"] > 0, calls
        if algo != "ulysses":  # Ulysses' whole-sequence attention differentiates through the forward op
            assert calls["npu_fusion_attention_grad"] > 0 and calls["npu_ring_attention_update"] > 0, calls


@pytest.mark.slow
def test_npu_backend_without_the_fused_merge_op():
    for rank in run_distributed(worker, 2, "ring", True, 4, 2, 16, "float32", "npu", False, timeout=180):
        calls = rank.pop("calls")
        assert all(err < 1e-6 for err in rank.values()), rank
        assert "npu_ring_attention_update" not in calls and calls["npu_fusion_attention_grad"] > 0, calls


@pytest.mark.parametrize("algo", ["ring", pytest.param("allgather_kv", marks=SLOW)])
def test_npu_backend_bf16_within_stated_tolerance(algo):
    for rank in run_distributed(worker, 2, algo, True, 4, 2, 16, "bfloat16", "npu", timeout=180):
        rank.pop("calls")
        assert all(err < 2e-2 for err in rank.values()), rank


@pytest.mark.parametrize("algo", ["ring", pytest.param("allgather_kv", marks=SLOW)])
def test_mqa_one_key_value_group(algo):
    for rank in run_distributed(worker, 2, algo, True, 4, 1, 8, "float32", timeout=120):
        assert all(err < 1e-6 for err in rank.values()), rank


@pytest.mark.parametrize(
    "algo", ["ring", pytest.param("ulysses", marks=SLOW), pytest.param("allgather_kv", marks=SLOW)]
)
def test_bf16_within_stated_tolerance(algo):
    for rank in run_distributed(worker, 2, algo, True, 4, 2, 16, "bfloat16", timeout=120):
        assert all(err < 2e-2 for err in rank.values()), rank


@SLOW
def test_ulysses_names_the_numbers_when_heads_do_not_divide():
    from mindspeed_like.testing.distributed import DistributedError

    with pytest.raises(DistributedError, match="2 key/value groups per TP rank must both divide by CP=4"):
        run_distributed(worker, 4, "ulysses", True, 4, 2, 8, "float32", timeout=120)


@pytest.mark.parametrize(
    "inner, causal",
    [
        (2, True),
        pytest.param(2, False, marks=SLOW),
        pytest.param(4, True, marks=SLOW),
        pytest.param(1, True, marks=SLOW),
    ],
    ids=["u2-causal", "u2-no-mask", "u4-causal", "u1-causal"],
)
def test_hybrid_cp4_matches_one_rank_float64(inner, causal):
    """CP=4 as Ulysses degree ``inner`` x ring of 4/inner (u=4: Ulysses only; u=1: ring only), GQA."""
    for rank in run_distributed(worker, 4, f"hybrid-{inner}", causal, 4, 4, 8, "float32", timeout=180):
        assert all(err < 1e-6 for err in rank.values()), rank


# ---------------------------------------------------------------- attention dropout inside the blocks
# Dropout masks differ from any one-rank reference's, so the checks are: the backward is the exact
# derivative of the forward with those masks (a central difference of the whole loss over all
# ranks along a random direction), the forward is unbiased dropout of the attention probabilities
# (the mean over seeds approaches undropped attention), and one seed gives one result.
def _dropout_run(algo, cp, q, k, v, causal, scale, dropout):
    from mindspeed_like.kernels.context_parallel import (
        allgather_kv_attention,
        hybrid_attention,
        ring_attention,
        ulysses_attention,
    )

    if algo.startswith("hybrid"):
        inner, outer = cp
        return hybrid_attention(q, k, v, inner, outer, causal=causal, scale=scale, dropout=dropout)
    fn = {"ring": ring_attention, "ulysses": ulysses_attention, "allgather_kv": allgather_kv_attention}[algo]
    return fn(q, k, v, cp, causal=causal, scale=scale, dropout=dropout)


def dropout_worker(algo: str, causal: bool) -> dict:
    import torch.distributed as dist

    from mindspeed_like.kernels.context_parallel import AttentionDropout, CPGroup

    size, rank = dist.get_world_size(), dist.get_rank()
    cp = _hybrid_groups(size, 2) if algo.startswith("hybrid") else CPGroup(dist.group.WORLD, tuple(range(size)))
    q, k, v, dout = (_mine(t, rank, size) for t in _full(1, 4, 2, 8 * size, 8, seed=5))
    scale, dropout = 8**-0.5, AttentionDropout(0.3, seed=1234)

    def loss(inputs):  # the whole loss over all ranks
        local = (_dropout_run(algo, cp, *inputs, causal, scale, dropout) * dout).sum().reshape(1)
        dist.all_reduce(local)
        return local.item()

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _dropout_run(algo, cp, *inputs, causal, scale, dropout)
    out.backward(dout)
    again = _dropout_run(algo, cp, q, k, v, causal, scale, dropout)
    undropped = _dropout_run(algo, cp, q, k, v, causal, scale, None)
    g = torch.Generator().manual_seed(100 + rank)
    direction = [torch.randn(t.shape, generator=g) for t in (q, k, v)]
    analytic = torch.tensor([sum((t.grad * d).sum().item() for t, d in zip(inputs, direction))])
    dist.all_reduce(analytic)
    eps = 1e-2
    plus = loss([t + eps * d for t, d in zip((q, k, v), direction)])
    minus = loss([t - eps * d for t, d in zip((q, k, v), direction)])
    numeric = (plus - minus) / (2 * eps)
    mean = torch.zeros_like(out)
    seeds = 200
    for seed in range(seeds):
        mean += _dropout_run(algo, cp, q, k, v, causal, scale, AttentionDropout(0.3, seed)).detach() / seeds
    return {
        "derivative": abs(numeric - analytic.item()) / abs(analytic.item()),
        "deterministic": torch.equal(out.detach(), again.detach()),
        "dropped_differs": _rel(out.detach(), undropped.detach().double()),
        "mean_vs_undropped": _rel(mean, undropped.detach().double()),
        "one_sample_vs_undropped": _rel(out.detach(), undropped.detach().double()),
    }


@pytest.mark.parametrize(
    "algo, cp, causal",
    [
        ("ring", 2, True),
        pytest.param("ring", 2, False, marks=SLOW),
        pytest.param("allgather_kv", 2, True, marks=SLOW),
        pytest.param("ulysses", 2, True, marks=SLOW),
        pytest.param("hybrid-2", 4, True, marks=SLOW),
    ],
)
def test_dropout_backward_is_the_derivative_and_forward_is_unbiased(algo, cp, causal):
    for rank in run_distributed(dropout_worker, cp, algo, causal, timeout=300):
        assert rank["deterministic"], rank
        # fp32 central difference (eps 1e-2): measured 2e-5..2e-4 over the algorithms; a wrong mask in the
        # backward is off by O(1)
        assert rank["derivative"] < 1e-3, rank
        assert rank["dropped_differs"] > 0.1, rank
        # 200 seeds: the mean's error shrinks ~1/sqrt(200) of one sample's (0.3-0.5 here)
        assert rank["mean_vs_undropped"] < 0.25 * rank["one_sample_vs_undropped"], rank
