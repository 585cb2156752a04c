"""moe-permute: the kernel against float64 and, bitwise in fp32, against megatron's unfused
``moe_utils.permute/unpermute``; the npu backend through the contract-checking emulator; the real
MoE GPT (allgather and alltoall dispatchers) with the feature on vs off, losses and gradients
bitwise equal; ``moe_permute_fusion=True`` accepted without TransformerEngine; EP=2 over gloo.

Bitwise (``torch.equal`` plus equal bit patterns) is the bound in fp32: the kernel runs the same
gathers and the same scatter_add/index_add in the same row order as megatron, so any difference
is a bug, not rounding.
"""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like.kernels import moe_permute as kernel
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.testing import init_parallel, tiny_gpt
from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu
from mindspeed_like.testing.parity import SEED, assert_close_to_reference
from mindspeed_like.testing.training import unwrap

TOKENS, EXPERTS, HIDDEN, TOPK = 37, 6, 16, 2


def _routing(seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    values, experts = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=gen, dtype=torch.float64), -1).topk(TOPK)
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, experts, True)
    probs = torch.zeros(TOKENS, EXPERTS, dtype=torch.float64).scatter(1, experts, values).to(dtype)
    return routing_map, probs


def _capacity_map(routing_map: torch.Tensor, probs: torch.Tensor, capacity: int) -> torch.Tensor:
    """megatron's drop-and-pad routing: each expert keeps its ``capacity`` highest-prob tokens
    (padding with unrouted ones when fewer were routed, as megatron's capacity top-k does)."""
    scores = torch.where(routing_map, probs.double(), torch.full_like(probs, -1.0, dtype=torch.float64))
    keep = scores.topk(capacity, dim=0).indices
    return torch.zeros_like(routing_map).scatter(0, keep, True)


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _round_trip(permute, unpermute, *, drop_and_pad, probs_in_permute, probs_in_unpermute, dtype=torch.float32):
    """permute -> a row-wise "expert" -> unpermute -> loss; returns output and input gradients."""
    routing_map, probs = _routing(dtype=dtype)
    num_out = int(routing_map.sum())
    if drop_and_pad:
        capacity = 8
        routing_map = _capacity_map(routing_map, probs, capacity)
        num_out = capacity * EXPERTS
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = x.to(dtype).requires_grad_()
    probs = probs.clone().requires_grad_()
    out = permute(
        x, routing_map, probs=probs if probs_in_permute else None, num_out_tokens=num_out, drop_and_pad=drop_and_pad
    )
    permuted, permuted_probs, sorted_indices = out[0], out[1], out[2]
    rows = permuted * 1.5 + 0.25
    if permuted_probs is not None and not probs_in_unpermute:
        rows = rows * permuted_probs.unsqueeze(-1)
    y = unpermute(
        rows,
        sorted_indices,
        restore_shape=x.shape,
        probs=probs if probs_in_unpermute else None,
        routing_map=routing_map,
        drop_and_pad=drop_and_pad,
    )
    (y * torch.arange(1, HIDDEN + 1, dtype=dtype)).sum().backward()
    return y.detach(), x.grad, probs.grad


CASES = [
    pytest.param(
        dp, pp, up, id=f"{'pad' if dp else 'dropless'}-{'pprobs' if pp else 'noprobs'}-{'uprobs' if up else 'u'}"
    )
    for dp in (False, True)
    for pp in (False, True)
    for up in (False, True)
]


@pytest.mark.parametrize(("drop_and_pad", "probs_in_permute", "probs_in_unpermute"), CASES)
def test_bitwise_equal_to_megatrons_unfused_path_fp32(drop_and_pad, probs_in_permute, probs_in_unpermute):
    from megatron.core.transformer.moe import moe_utils

    kw = dict(drop_and_pad=drop_and_pad, probs_in_permute=probs_in_permute, probs_in_unpermute=probs_in_unpermute)
    ours = _round_trip(kernel.permute, kernel.unpermute, **kw)
    theirs = _round_trip(moe_utils.permute, moe_utils.unpermute, **kw)
    for name, a, b in zip(("output", "grad tokens", "grad probs"), ours, theirs):
        assert _bits_equal(a, b), name
    assert ours[1] is not None and torch.count_nonzero(ours[1]) > 0
    if probs_in_permute or probs_in_unpermute:
        assert torch.count_nonzero(ours[2]) > 0


@pytest.mark.parametrize(("drop_and_pad", "probs_in_permute", "probs_in_unpermute"), CASES)
def test_close_to_float64_reference(drop_and_pad, probs_in_permute, probs_in_unpermute):
    kw = dict(drop_and_pad=drop_and_pad, probs_in_permute=probs_in_permute, probs_in_unpermute=probs_in_unpermute)
    ours = _round_trip(kernel.permute, kernel.unpermute, **kw)
    ref = _round_trip(kernel.permute_reference, kernel.unpermute_reference, dtype=torch.float64, **kw)
    for name, a, b in zip(("output", "grad tokens", "grad probs"), ours, ref):
        if b is None:
            assert a is None, name
            continue
        # fp32 inputs are the fp64 ones rounded; outputs sum <= TOPK products, the probs' gradient
        # HIDDEN products: fp32 rounding of the largest magnitude (the table's default bound)
        assert_close_to_reference(a, b, torch.float32, what=name)


def test_pad_to_capacity_keeps_capacity_rows_per_expert_with_padding():
    """drop-and-pad with experts under capacity: padding rows (unrouted tokens) come after the
    routed ones, and their probs are the zeros of the probs tensor."""
    routing_map, probs = _routing()
    capacity = 16  # more than any expert received: every expert is padded
    assert int(routing_map.sum(0).max()) < capacity
    x = torch.randn(TOKENS, HIDDEN)
    permuted, permuted_probs, sorted_indices = kernel.permute(
        x, routing_map, probs=probs, num_out_tokens=capacity * EXPERTS, drop_and_pad=True
    )
    assert permuted.shape == (capacity * EXPERTS, HIDDEN)
    for e in range(EXPERTS):
        rows = sorted_indices[e * capacity : (e + 1) * capacity]
        routed = int(routing_map[:, e].sum())
        assert routing_map[rows[:routed], e].all() and not routing_map[rows[routed:], e].any()
        assert torch.equal(permuted_probs[e * capacity : e * capacity + routed], probs[rows[:routed], e])
        assert not permuted_probs[e * capacity + routed : (e + 1) * capacity].any()


def test_fixed_count_selection_is_nonzeros_without_a_host_read():
    """megatron-core 0.19's dropless selection (argsort cut at num_out_tokens): the same rows as the
    nonzero selection for a top-k map, and on a GPU (fake_cuda) no host round-trip where nonzero
    makes one."""
    from mindspeed_like.testing.fake_cuda import fake_cuda
    from mindspeed_like.testing.host_round_trips import count_host_round_trips

    routing_map, probs = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    out_tokens = int(routing_map.sum())
    plain = kernel.permute(x, routing_map, probs=probs, num_out_tokens=out_tokens)
    fixed = kernel.permute(x, routing_map, probs=probs, num_out_tokens=out_tokens, fixed_count=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, fixed))
    trips = {}
    with fake_cuda():
        gpu_map, gpu_x = routing_map.to("cuda"), x.to("cuda")
        for fixed_count in (False, True):
            with count_host_round_trips() as meter:
                kernel.permute(gpu_x, gpu_map, num_out_tokens=out_tokens, fixed_count=fixed_count)
            trips[fixed_count] = meter.total
    assert trips == {False: 1, True: 0}, trips


def test_unpermute_deterministic_mode_uses_index_add_like_megatron():
    from megatron.core.transformer.moe import moe_utils

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        kw = dict(drop_and_pad=False, probs_in_permute=False, probs_in_unpermute=True)
        ours = _round_trip(kernel.permute, kernel.unpermute, **kw)
        theirs = _round_trip(moe_utils.permute, moe_utils.unpermute, **kw)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(_bits_equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("fixed_count", [False, True], ids=["nonzero", "argsort"])
def test_permute_saves_only_indices(fixed_count):
    """The permute graph holds the two index vectors, not the tokens nor their permuted copy; with
    0.19's argsort selection, not the whole experts x tokens argsort either (the rows' slice of it is
    copied: megatron 0.19's own permute keeps the whole of it, 4x the indices at 8 experts)."""
    routing_map, probs = _routing()
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    probs.requires_grad_()
    rows = int(routing_map.sum())
    permuted, _, sorted_indices = kernel.permute(
        x, routing_map, probs=probs, num_out_tokens=rows, fixed_count=fixed_count
    )
    saved = permuted.grad_fn.saved_tensors
    assert len(saved) == 2 and all(t.dtype == torch.int64 and t.dim() == 1 for t in saved)
    assert all(t.untyped_storage().nbytes() == rows * 8 for t in saved), [t.untyped_storage().nbytes() for t in saved]
    y = kernel.unpermute(permuted * 2.0, sorted_indices, x.shape)
    assert [t.dtype for t in y.grad_fn.saved_tensors] == [torch.int64]


def test_sort_chunks_matches_megatron_bitwise():
    from megatron.core.transformer.moe import moe_utils

    x = torch.randn(10, 4, requires_grad=True)
    probs = torch.rand(10, requires_grad=True)
    sizes, order = torch.tensor([3, 0, 4, 3]), torch.tensor([2, 0, 3, 1])
    results = []
    for fn in (kernel.sort_chunks_by_idxs, moe_utils.sort_chunks_by_idxs):
        out, p = fn(x, sizes, order, probs=probs)
        grads = torch.autograd.grad((out * torch.arange(4.0)).sum() + (p * 3).sum(), (x, probs))
        results.append((out, p, *grads))
    assert all(_bits_equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match="permutation"):
        kernel.sort_chunks_by_idxs(x, sizes, torch.tensor([0, 0, 1, 2]))


# -- npu backend through the emulator -----------------------------------------------------------


@pytest.mark.parametrize("probs_in_unpermute", [False, True])
def test_npu_backend_through_emulator_equals_portable(probs_in_unpermute):
    kw = dict(drop_and_pad=False, probs_in_permute=not probs_in_unpermute, probs_in_unpermute=probs_in_unpermute)
    portable = _round_trip(kernel.permute, kernel.unpermute, **kw)
    with emulated_torch_npu() as npu, force_backend("npu"):
        npu_result = _round_trip(kernel.permute, kernel.unpermute, **kw)
    assert npu.calls["npu_moe_token_permute"] == 1 and npu.calls["npu_moe_token_unpermute"] == 1
    for name, a, b in zip(("output", "grad tokens", "grad probs"), npu_result, portable):
        # the op sums a token's k rows in its own order (one product each): fp32 rounding only
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_npu_backend_runs_portable_where_the_op_cannot():
    """drop-and-pad, and tokens with different numbers of experts, never reach the op."""
    with emulated_torch_npu() as npu, force_backend("npu"):
        _round_trip(
            kernel.permute, kernel.unpermute, drop_and_pad=True, probs_in_permute=True, probs_in_unpermute=False
        )
        routing_map, probs = _routing()
        routing_map[0] = False
        kernel.permute(torch.randn(TOKENS, HIDDEN), routing_map, probs=probs)
    assert npu.calls["npu_moe_token_permute"] == 0 and npu.calls["npu_moe_token_unpermute"] == 0


def test_emulator_enforces_the_contract():
    with emulated_torch_npu() as npu:
        x = torch.randn(4, 8)
        idx = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1]], dtype=torch.int32)
        with pytest.raises(ContractError, match="int32 or int64"):
            npu.npu_moe_token_permute(x, idx.float())
        with pytest.raises(ContractError, match="padded_mode"):
            npu.npu_moe_token_permute(x, idx, padded_mode=True)
        with pytest.raises(ContractError, match="2-D"):
            npu.npu_moe_token_permute(x.view(2, 2, 8), idx)
        with pytest.raises(ContractError, match="topk"):
            npu.npu_moe_token_permute(torch.randn(1, 8), torch.zeros(1, 513, dtype=torch.int32))
        permuted, sorted_indices = npu.npu_moe_token_permute(x, idx)
        assert sorted_indices.dtype == torch.int32 and permuted.shape == (8, 8)
        with pytest.raises(ContractError, match="int32"):
            npu.npu_moe_token_unpermute(permuted, sorted_indices.long(), probs=torch.ones(4, 2))
        with pytest.raises(ContractError, match="dtype"):
            npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.ones(4, 2, dtype=torch.float64))
        with pytest.raises(ContractError, match="distinct"):
            npu.npu_moe_token_unpermute(permuted, torch.zeros(8, dtype=torch.int32), probs=torch.ones(4, 2))
        out = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.full((4, 2), 0.5))
        torch.testing.assert_close(out, x)  # each token's two copies, weighted 1/2 each


# -- the feature on megatron's MoE model ---------------------------------------------------------


def _wrapped() -> bool:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    ours = type(getattr(moe_utils.permute, "_self_wrapper", None)).__name__ == "PermuteWrapper"
    return ours and token_dispatcher.permute is moe_utils.permute


def _forward_backward(model, tokens):
    gpt = unwrap(model)
    gpt.zero_grad(set_to_none=True)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = model(tokens, position_ids, None, labels=tokens)
    loss.float().mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}


def _model(**config):
    init_parallel(seed=SEED)
    return tiny_gpt(num_moe_experts=4, **config)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(moe_token_dispatcher_type="allgather"), id="allgather"),
        pytest.param(dict(moe_token_dispatcher_type="alltoall"), id="alltoall"),
        pytest.param(
            dict(
                moe_token_dispatcher_type="alltoall",
                moe_expert_capacity_factor=1.0,
                moe_pad_expert_input_to_capacity=True,
            ),
            id="alltoall-pad-to-capacity",
        ),
    ],
)
def test_moe_gpt_losses_and_grads_bitwise_equal_on_vs_off(cpu_config, config):
    cpu_config(use_fused_moe_token_permute_and_unpermute=False)
    assert not _wrapped()
    model = _model(**config)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    loss_off, grads_off = _forward_backward(model, tokens)
    mindspeed_like.configure(use_fused_moe_token_permute_and_unpermute=True)
    assert _wrapped()
    loss_on, grads_on = _forward_backward(model, tokens)
    assert _bits_equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys()
    for name, grad in grads_on.items():
        assert _bits_equal(grad, grads_off[name]), name
    assert any("experts" in n and torch.count_nonzero(g) > 0 for n, g in grads_on.items())
    mindspeed_like.configure(use_fused_moe_token_permute_and_unpermute=False)
    assert not _wrapped()


def test_moe_permute_fusion_config_accepted_and_bitwise_equal(cpu_config):
    """megatron's own ``moe_permute_fusion=True``: TransformerConfig refuses it without TE (here
    with the te-backend off, which would otherwise switch it off, said once) unless the feature is
    on; with it, megatron's fused branches run our kernel, bitwise its unfused result."""
    cpu_config(no_te_backend=True)
    from megatron.core.extensions import transformer_engine as te_ext

    if te_ext.fused_permute is None:  # no TransformerEngine installed
        with pytest.raises((ImportError, ValueError), match="permut"):
            _model(moe_permute_fusion=True)
    model_off = _model(moe_permute_fusion=False)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    loss_off, grads_off = _forward_backward(model_off, tokens)
    mindspeed_like.configure(moe_permute_fusion=True)
    assert _wrapped() and te_ext.fused_permute is not None
    model_on = _model(moe_permute_fusion=True)
    assert unwrap(model_on).config.moe_permute_fusion
    loss_on, grads_on = _forward_backward(model_on, tokens)
    assert _bits_equal(loss_on, loss_off)
    assert all(_bits_equal(g, grads_off[n]) for n, g in grads_on.items())
    mindspeed_like.configure(moe_permute_fusion=False)
    assert te_ext.fused_permute is None or te_ext.fused_permute.__module__.startswith("transformer_engine")


def test_te_names_round_trip_matches_kernel():
    """The TransformerEngine-API functions bound for moe_permute_fusion compute the same thing."""
    from mindspeed_like.features.moe_permute import dispatch

    routing_map, probs = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    permuted, permuted_probs, row_map = dispatch.fused_permute_with_probs(x, probs, routing_map, -1)
    ours, ours_probs, _ = kernel.permute(x, routing_map, probs=probs)
    assert torch.equal(permuted, ours) and torch.equal(permuted_probs, ours_probs)
    out = dispatch.fused_unpermute(permuted, row_map, merging_probs=probs, restore_shape=x.shape)
    expected = kernel.unpermute(ours, kernel.permute(x, routing_map)[2], x.shape, probs=probs, routing_map=routing_map)
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, x * probs.sum(1, keepdim=True))


@pytest.mark.slow
def test_expert_parallel_2_gloo_bitwise_on_vs_off():
    from mindspeed_like.testing.distributed import run_distributed

    results = run_distributed(_ep2_worker, 2, timeout=300)
    for rank_result in results:
        assert rank_result == "ok", rank_result


def _ep2_worker() -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    out = {}
    for dispatcher in ("allgather", "alltoall"):
        runs = []
        for on in (False, True):
            mindspeed_like.configure(use_fused_moe_token_permute_and_unpermute=on)
            init_parallel(ep=2, seed=SEED)
            model = tiny_gpt(num_moe_experts=4, moe_token_dispatcher_type=dispatcher)
            tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5 + rank))
            runs.append(_forward_backward(model, tokens))
        (loss_off, grads_off), (loss_on, grads_on) = runs
        bad = [n for n, g in grads_on.items() if not _bits_equal(g, grads_off[n])]
        if not _bits_equal(loss_on, loss_off) or bad:
            out[dispatcher] = f"loss {loss_on.item()} vs {loss_off.item()}, grads differ: {bad[:3]}"
    mindspeed_like.reset()
    return "ok" if not out else str(out)


def test_moe_permute_fusion_kept_with_the_te_backend_on(cpu_config, caplog):
    """The te-backend (on by default without TE) switches moe_permute_fusion off when nothing
    provides it; with this feature on, our wrapper (above te-backend's) keeps it, nothing said."""
    cpu_config(moe_permute_fusion=True)
    model = _model(moe_permute_fusion=True)
    assert unwrap(model).config.moe_permute_fusion
    assert "moe_permute_fusion" not in caplog.text
    loss, grads = _forward_backward(model, torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(6)))
    assert torch.isfinite(loss).all() and any("experts" in n for n in grads)


def test_with_grouped_gemm_and_fused_swiglu_still_bitwise(cpu_config):
    """Stacked with the other MoE accelerations (grouped experts, fused SwiGLU): switching
    moe-permute changes nothing bitwise."""
    cpu_config(grouped_gemm="on", use_fused_swiglu=True)
    model = _model(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    loss_off, grads_off = _forward_backward(model, tokens)
    mindspeed_like.configure(use_fused_moe_token_permute_and_unpermute=True)
    assert _wrapped()
    loss_on, grads_on = _forward_backward(model, tokens)
    assert _bits_equal(loss_on, loss_off)
    assert all(_bits_equal(g, grads_off[n]) for n, g in grads_on.items())
