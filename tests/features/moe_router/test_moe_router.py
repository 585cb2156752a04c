"""moe-router: the top-k routing kernel against megatron's unfused path (bitwise) and float64, the
npu backend through the contract-checking emulator, and megatron's MoE GPT with the feature on/off
(DeepSeek-style sigmoid + expert bias + group top-k + seq_aux_loss; Mixtral-style softmax top-2),
plus megatron's own ``moe_router_fusion=True`` without TransformerEngine."""

from __future__ import annotations

import inspect

import pytest
import torch

import mindspeed_like
from mindspeed_like.kernels import moe_router as kernel
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.testing import init_parallel, tiny_gpt
from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu
from mindspeed_like.testing.parity import SEED, assert_close_to_reference
from mindspeed_like.testing.training import unwrap

# (score_function, use_pre_softmax, (num_groups, group_topk) or None, expert bias, scaling, topk)
COMBOS = [
    ("softmax", False, None, False, None, 2),
    ("softmax", False, None, False, 2.5, 4),
    ("softmax", True, None, False, None, 2),
    ("softmax", True, None, False, 2.5, 1),
    ("softmax", False, (4, 2), False, None, 4),
    ("softmax", True, (4, 2), False, 1.5, 4),
    ("sigmoid", False, None, False, None, 1),
    ("sigmoid", False, None, False, None, 4),
    ("sigmoid", False, None, True, None, 4),
    ("sigmoid", False, None, True, 2.5, 1),
    ("sigmoid", False, (4, 2), False, 2.5, 4),
    ("sigmoid", False, (4, 2), True, 2.5, 4),
    ("sigmoid", False, (8, 4), True, None, 8),
    # topk not a multiple of group_topk (megatron's TestGroupLimitedRouter: 16 experts, 8 groups, 3 kept, top-4;
    # each group scored by its top 4 // 3 = 1 expert)
    ("softmax", False, (8, 3), False, None, 4),
    ("sigmoid", False, (8, 3), True, 2.5, 4),
]
IDS = [
    f"{sf}{'-pre' if pre else ''}{f'-g{g[0]}k{g[1]}' if g else ''}{'-bias' if b else ''}{f'-x{s}' if s else ''}-top{k}"
    for sf, pre, g, b, s, k in COMBOS
]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    a, b = a.contiguous(), b.contiguous()
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(width), b.view(width))


def _megatron_unfused():
    """megatron's own unfused top-k routing (the 0.13 form returns a third value), unpatched."""
    from megatron.core.transformer.moe import moe_utils

    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    if fn is not None:
        fn = inspect.unwrap(fn)
        return lambda logits, topk, **kw: fn(logits, topk, **kw)
    fn = inspect.unwrap(moe_utils.topk_softmax_with_capacity)
    return lambda logits, topk, **kw: fn(logits, topk, **kw)[:2]


def _layout():
    from megatron.core.transformer.moe import moe_utils

    from mindspeed_like.features.moe_router.routing import routing_layout

    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    if fn is None:  # 0.13: the scores rounded to the logits' dtype at each step
        from mindspeed_like.features.moe_router.routing import RoutingLayout

        return RoutingLayout(fp32_intermediates=False, unsorted_without_grad=False, aux_sigmoid_in_fp32=False)
    return routing_layout(fn)


def _inputs(combo, dtype=torch.float32, tokens=64, experts=16, seed=0):
    sf, pre, groups, bias, scale, k = combo
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    kwargs = dict(
        use_pre_softmax=pre,
        num_groups=groups[0] if groups else None,
        group_topk=groups[1] if groups else None,
        scaling_factor=scale,
        score_function=sf,
        expert_bias=(torch.randn(experts, generator=g) * 0.1) if bias else None,
    )
    upstream = torch.randn(tokens, experts, generator=g).to(dtype)
    return logits, k, kwargs, upstream


def _run(fn, logits, k, kwargs, upstream):
    x = logits.clone().requires_grad_(True)
    probs, routing_map = fn(x, k, **kwargs)
    (probs * upstream).sum().backward()
    return probs.detach(), routing_map, x.grad


def _assert_bitwise_equal_to_megatron(logits, k, kwargs, upstream):
    """Our kernel (with the installed megatron's rounding layout) vs megatron's unfused routing:
    probs, routing map and logits gradient bit for bit; returns ours."""
    ref = _run(_megatron_unfused(), logits, k, kwargs, upstream)
    layout = _layout()
    ours = _run(
        lambda x, k, **kw: kernel.topk_routing(x, k, **kw, fp32_intermediates=layout.fp32_intermediates),
        logits,
        k,
        kwargs,
        upstream,
    )
    for name, a, b in zip(("probs", "map", "grad"), ours, ref):
        assert _bits_equal(a, b), name
    return ours


@pytest.mark.parametrize("combo", COMBOS, ids=IDS)
def test_bitwise_equal_to_megatrons_unfused_path_fp32(combo):
    logits, k, kwargs, upstream = _inputs(combo)
    ours = _assert_bitwise_equal_to_megatron(logits, k, kwargs, upstream)
    assert ours[1].sum(dim=1).eq(k).all()
    assert torch.count_nonzero(ours[2]) > 0


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[2], COMBOS[8], COMBOS[11]], ids=[IDS[0], IDS[2], IDS[8], IDS[11]])
def test_bf16_bitwise_equal_to_the_installed_megatron(combo):
    """Low precision too, with the rounding layout read from the installed megatron."""
    _assert_bitwise_equal_to_megatron(*_inputs(combo, dtype=torch.bfloat16))


@pytest.mark.parametrize("combo", COMBOS, ids=IDS)
def test_close_to_float64_reference(combo):
    logits, k, kwargs, upstream = _inputs(combo)
    probs, routing_map, grad = _run(kernel.topk_routing, logits, k, kwargs, upstream)
    kw64 = dict(kwargs, expert_bias=None if kwargs["expert_bias"] is None else kwargs["expert_bias"].double())
    probs64, map64, grad64 = _run(kernel.topk_routing_reference, logits.double(), k, kw64, upstream.double())
    assert torch.equal(routing_map, map64)  # random logits: no near-ties decide differently
    assert_close_to_reference(probs, probs64, torch.float32)
    assert_close_to_reference(grad, grad64, torch.float32)


def test_fp32_intermediates_differ_only_below_fp32():
    """The two rounding layouts are one computation in fp32 and differ in bf16 (so the flag matters)."""
    combo = COMBOS[8]
    logits, k, kwargs, _ = _inputs(combo)
    a = kernel.topk_routing(logits, k, **kwargs, fp32_intermediates=True)[0]
    b = kernel.topk_routing(logits, k, **kwargs, fp32_intermediates=False)[0]
    assert _bits_equal(a, b)
    logits = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    kwargs["expert_bias"] = torch.randn(64) * 0.1
    a = kernel.topk_routing(logits, k, **kwargs, fp32_intermediates=True)[0]
    b = kernel.topk_routing(logits, k, **kwargs, fp32_intermediates=False)[0]
    assert not torch.equal(a, b)


def _saved_numel(fn, *args, **kwargs) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel()
        return t

    x = args[0].clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, *args[1:], **kwargs)
    return total


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[8], COMBOS[11]], ids=[IDS[0], IDS[8], IDS[11]])
def test_saves_no_more_than_megatron_and_sigmoid_only_k_per_token(combo):
    logits, k, kwargs, _ = _inputs(combo, tokens=128, experts=32)
    ours = _saved_numel(kernel.topk_routing, logits, k, **kwargs)
    theirs = _saved_numel(_megatron_unfused(), logits, k, **kwargs)
    assert ours <= theirs
    if combo[0] == "sigmoid":
        assert ours <= 128 * (2 * k + 1)  # indices, k sigmoid outputs, one sum per token
        assert theirs >= 128 * 32  # megatron keeps the full sigmoid output


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_aux_loss_scores_bitwise_equal_to_megatron(score_function, dtype):
    from megatron.core.transformer.moe import moe_utils

    layout = _layout()
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    upstream = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))

    def run(fn):
        x = logits.clone().requires_grad_(True)
        routing_map, scores = fn(x)
        (scores * upstream.to(scores.dtype)).sum().backward()
        return routing_map, scores.detach(), x.grad

    ours = run(lambda x: kernel.aux_loss_scores(x, 4, score_function, sigmoid_in_fp32=layout.aux_sigmoid_in_fp32))
    if hasattr(moe_utils, "compute_routing_scores_for_aux_loss"):
        theirs = run(lambda x: inspect.unwrap(moe_utils.compute_routing_scores_for_aux_loss)(x, 4, score_function))
    else:  # 0.13: a TopKRouter method returning (scores, map); its math without a router instance
        from megatron.core.transformer.moe.router import TopKRouter

        stub = type("R", (), {"score_function": score_function, "topk": 4})()
        method = inspect.unwrap(TopKRouter.compute_routing_scores_for_aux_loss)
        theirs = run(lambda x: method(stub, x)[::-1])
    for name, a, b in zip(("map", "scores", "grad"), ours, theirs):
        assert _bits_equal(a, b), name


_AUX_016 = """
def compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False, padding_mask=None):
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
"""


@pytest.mark.parametrize(
    ("cast", "in_fp32"),
    [
        ("logits", False),  # 0.14-0.16
        ("logits.to(torch.float32)", True),  # 0.17.1
        ("logits.float()", True),  # 0.18.2, 0.19.2
        ("logits.to(dtype=torch.float32)", True),
        ("logits.to(torch.bfloat16)", False),
    ],
)
def test_aux_loss_sigmoid_precision_is_read_from_each_releases_spelling(cast, in_fp32):
    """The aux-loss sigmoid's precision from megatron's code whatever the cast's spelling (0.17.1 wrote
    ``logits.to(torch.float32)``, read as the logits' dtype before, so its bf16 sigmoid scores differed)."""
    from mindspeed_like.features.moe_router.routing import _sigmoid_of_fp32_logits

    source = _AUX_016.replace("torch.sigmoid(logits)", f"torch.sigmoid({cast})")
    assert _sigmoid_of_fp32_logits(source, "compute_routing_scores_for_aux_loss") is in_fp32


def test_aux_loss_sigmoid_precision_of_the_installed_release():
    from megatron.core.transformer.moe import moe_utils
    from packaging.version import Version

    from mindspeed_like.megatron_version import megatron_core_version

    if not hasattr(moe_utils, "compute_routing_scores_for_aux_loss"):
        pytest.skip("megatron-core 0.13: the aux-loss scores are a TopKRouter method (sigmoid in the logits' dtype)")
    assert _layout().aux_sigmoid_in_fp32 is (megatron_core_version() >= Version("0.17"))


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("pad_to_capacity", [False, True], ids=["drop", "pad"])
@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[11]], ids=[IDS[0], IDS[11]])
def test_capacity_and_drop_policies_bitwise(combo, drop_policy, pad_to_capacity):
    """Token dropping on top of our routing equals megatron's: 0.14+ applies its own
    apply_router_token_dropping to our output; 0.13's capacity step is in our wrapper."""
    from megatron.core.transformer.moe import moe_utils

    from mindspeed_like.features.moe_router import routing

    logits, k, kwargs, upstream = _inputs(combo)
    capacity = dict(capacity_factor=0.5, drop_policy=drop_policy, pad_to_capacity=pad_to_capacity)
    if hasattr(moe_utils, "apply_router_token_dropping"):
        drop = moe_utils.apply_router_token_dropping

        def with_capacity(route):
            def fn(x, k, **kw):
                probs, routing_map = route(x, k, **kw)
                return drop(probs, routing_map, router_topk=k, **capacity)

            return fn

        theirs = _run(with_capacity(_megatron_unfused()), logits, k, kwargs, upstream)
        layout = _layout()
        ours = _run(
            with_capacity(
                lambda x, k, **kw: kernel.topk_routing(x, k, **kw, fp32_intermediates=layout.fp32_intermediates)
            ),
            logits,
            k,
            kwargs,
            upstream,
        )
    else:
        original = inspect.unwrap(moe_utils.topk_softmax_with_capacity)

        def theirs_fn(x, k, **kw):
            return original(x, k, **capacity, **kw)[:2]

        def ours_fn(x, k, **kw):
            return routing.topk_softmax_with_capacity(original, None, (x, k), dict(capacity, **kw))[:2]

        theirs = _run(theirs_fn, logits, k, kwargs, upstream)
        ours = _run(ours_fn, logits, k, kwargs, upstream)
    assert not torch.equal(theirs[1].sum(dim=1), torch.full((64,), k))  # tokens were dropped / padded
    for name, a, b in zip(("probs", "map", "grad"), ours, theirs):
        assert _bits_equal(a, b), name


def test_bad_arguments_are_clear_errors():
    logits = torch.randn(8, 16)
    with pytest.raises(ValueError, match="score_function"):
        kernel.topk_routing(logits, 2, score_function="sqrtsoftplus")
    with pytest.raises(ValueError, match="topk=17"):
        kernel.topk_routing(logits, 17)
    with pytest.raises(ValueError, match="group-limited"):
        kernel.topk_routing(logits, 3, num_groups=5, group_topk=2)  # 5 groups do not split 16 experts
    with pytest.raises(ValueError, match="group-limited"):
        kernel.topk_routing(logits, 4, num_groups=4, group_topk=5)  # more groups kept than exist
    with pytest.raises(ValueError, match="group-limited"):
        kernel.topk_routing(logits, 4, num_groups=8, group_topk=1)  # a group's top 4 of its 2 experts
    with pytest.raises(ValueError, match="2D"):
        kernel.topk_routing(logits.view(2, 4, 16), 2)


# -- npu backend through the emulator ------------------------------------------------------------


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[1], COMBOS[2], COMBOS[3]], ids=IDS[:4])
def test_npu_backend_through_emulator_equals_portable(combo):
    logits, k, kwargs, upstream = _inputs(combo)
    with force_backend("portable"):
        portable = _run(kernel.topk_routing, logits, k, kwargs, upstream)
    with emulated_torch_npu() as npu, force_backend("npu"):
        npu_out = _run(kernel.topk_routing, logits, k, kwargs, upstream)
    assert npu.calls["npu_moe_gating_top_k_softmax"] == 1
    for name, a, b in zip(("probs", "map", "grad"), npu_out, portable):
        assert _bits_equal(a, b), name


@pytest.mark.parametrize("combo", [COMBOS[4], COMBOS[8], COMBOS[11]], ids=[IDS[4], IDS[8], IDS[11]])
def test_npu_backend_runs_portable_where_the_op_cannot(combo):
    """Groups, expert bias and sigmoid are outside npu_moe_gating_top_k_softmax's contract."""
    logits, k, kwargs, upstream = _inputs(combo)
    with force_backend("portable"):
        portable = _run(kernel.topk_routing, logits, k, kwargs, upstream)
    with emulated_torch_npu() as npu, force_backend("npu"):
        npu_out = _run(kernel.topk_routing, logits, k, kwargs, upstream)
    assert npu.calls["npu_moe_gating_top_k_softmax"] == 0
    assert all(_bits_equal(a, b) for a, b in zip(npu_out, portable))


def test_emulator_enforces_the_contract():
    with emulated_torch_npu() as npu:
        op = npu.npu_moe_gating_top_k_softmax
        x = torch.randn(6, 8)
        y, idx, row = op(x, None, k=2)
        assert y.shape == (6, 2) and idx.dtype == torch.int32 and row.dtype == torch.int32
        assert torch.equal(row, torch.arange(12, dtype=torch.int32).reshape(2, 6).t())
        torch.testing.assert_close(y, torch.softmax(x, -1).topk(2).values)
        finished = torch.tensor([True, False, False, False, False, True])
        _, idx, _ = op(x, finished, k=2)
        assert (idx[0] == 8).all() and (idx[1] < 8).all()
        with pytest.raises(ContractError, match="k="):
            op(x, None, k=9)
        with pytest.raises(ContractError, match="2D/3D"):
            op(torch.randn(8), None, k=1)
        with pytest.raises(ContractError, match="dtype"):
            op(x.double(), None, k=1)
        with pytest.raises(ContractError, match="finished shape"):
            op(x, torch.zeros(5, dtype=torch.bool), k=1)
        with pytest.raises(ContractError, match="inference-only"):
            op(x.requires_grad_(True), None, k=1)
        with pytest.raises(ContractError, match="unexpected"):
            op(x.detach(), None, k=1, renorm=1)


# -- the feature on megatron's MoE model ---------------------------------------------------------

DEEPSEEK = dict(
    num_moe_experts=8,
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-2,
)
MIXTRAL = dict(num_moe_experts=4, moe_router_topk=2, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)


def _routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def _wrapped() -> bool:
    from megatron.core.transformer.moe import moe_utils, router

    name = "topk_routing_with_score_function"
    if not hasattr(moe_utils, name):
        name = "topk_softmax_with_capacity"
    fn = getattr(moe_utils, name)
    return getattr(fn, "__wrapped__", None) is not None and getattr(router, name) is fn


def _train(config: dict, steps: int = 3):
    """A few SGD steps (and expert-bias updates) from the same seed: losses and grads per step."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    init_parallel(seed=SEED)
    model = tiny_gpt(**config)
    routers = _routers(model)
    assert routers
    with torch.no_grad():  # a non-zero expert bias from the start, so it changes the choice
        for i, router in enumerate(routers):
            if router.expert_bias is not None:
                router.expert_bias.copy_(
                    torch.randn(router.expert_bias.shape, generator=torch.Generator().manual_seed(i)) * 0.05
                )
    gpt = unwrap(model)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    losses, grads = [], []
    for _ in range(steps):
        gpt.zero_grad(set_to_none=True)
        loss = model(tokens, position_ids, None, labels=tokens)
        loss.float().mean().backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in gpt.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
            for router in routers:
                if router.expert_bias is not None:
                    router.expert_bias.copy_(
                        get_updated_expert_bias(router.local_tokens_per_expert, router.expert_bias, 1e-2)
                    )
                    router.local_tokens_per_expert.zero_()
    return losses, grads


def _assert_runs_bitwise_equal(on, off):
    (losses_on, grads_on), (losses_off, grads_off) = on, off
    for step, (a, b) in enumerate(zip(losses_on, losses_off)):
        assert _bits_equal(a, b), f"loss of step {step}"
    for step, (a, b) in enumerate(zip(grads_on, grads_off)):
        assert a.keys() == b.keys()
        for name in a:
            assert _bits_equal(a[name], b[name]), f"step {step}: {name}"
    assert any("router" in n and torch.count_nonzero(g) > 0 for n, g in grads_on[-1].items())


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(DEEPSEEK, id="deepseek-sigmoid-bias-groups-seq-aux"),
        pytest.param(MIXTRAL, id="mixtral-softmax-top2-aux"),
        pytest.param(
            dict(MIXTRAL, moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"),
            id="mixtral-capacity-position",
            marks=pytest.mark.slow,
        ),
        pytest.param(dict(MIXTRAL, moe_router_pre_softmax=True), id="mixtral-pre-softmax", marks=pytest.mark.slow),
    ],
)
def test_moe_gpt_losses_and_grads_bitwise_equal_on_vs_off(cpu_config, config):
    cpu_config(use_fused_moe_router=False)
    assert not _wrapped()
    off = _train(config)
    mindspeed_like.configure(use_fused_moe_router=True)
    assert _wrapped()
    on = _train(config)
    _assert_runs_bitwise_equal(on, off)
    mindspeed_like.configure(use_fused_moe_router=False)
    assert not _wrapped()


def test_moe_router_fusion_works_without_te_and_is_bitwise_equal(cpu_config):
    """megatron's own ``moe_router_fusion=True``: without TransformerEngine megatron raises at the
    first routing; with the feature on (switched on by that flag) our kernel serves the fused calls."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "topk_routing_with_score_function"):
        pytest.skip("megatron-core 0.13 has no moe_router_fusion")
    from mindspeed_like.features.moe_router.routing import te_has

    cpu_config()
    if not te_has("fused_topk_with_score_function"):
        with pytest.raises(ValueError, match="fused_topk_with_score_function"):
            _train(dict(DEEPSEEK, moe_router_fusion=True), steps=1)
    off = _train(DEEPSEEK)
    mindspeed_like.configure(moe_router_fusion=True)
    assert _wrapped()
    on = _train(dict(DEEPSEEK, moe_router_fusion=True))
    _assert_runs_bitwise_equal(on, off)
    mindspeed_like.configure(moe_router_fusion=False)
    assert not _wrapped()


def test_calls_outside_the_kernel_go_to_megatron_unfused_said_once_and_refused_under_strict():
    """Router replay is megatron's: the wrapper hands it back (with fused=True and no TE, as the
    unfused call: megatron would raise) and says why; --strict makes it an error."""
    from megatron.core.transformer.moe import moe_utils

    from mindspeed_like.features.moe_router import routing
    from mindspeed_like.toolkit.errors import FeatureUnsupported
    from mindspeed_like.toolkit.fallback import Fallback, fell_back, forget_logged

    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    if fn is None or "router_replay" not in inspect.signature(fn).parameters:
        pytest.skip("this megatron-core has no router replay")
    fn = inspect.unwrap(fn)

    class Replay:  # replays nothing: computes the top-k megatron's way
        def get_replay_topk(self, scores, topk, num_groups, group_topk, compute):
            return compute(scores, topk, num_groups=num_groups, group_topk=group_topk)

    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(6))
    forget_logged()
    wrapper = routing.TopKRouting(Fallback("moe-router", strict=False))
    fused = not routing.te_has("fused_topk_with_score_function")
    probs, routing_map = wrapper(fn, None, (logits, 2), dict(fused=fused, router_replay=Replay()))
    ref_probs, ref_map = fn(logits, 2)
    assert _bits_equal(probs, ref_probs) and torch.equal(routing_map, ref_map)
    assert any("router replay" in reason for reason in fell_back()["moe-router"])
    with pytest.raises(FeatureUnsupported, match="router replay"):
        routing.TopKRouting(Fallback("moe-router", strict=True))(fn, None, (logits, 2), dict(router_replay=Replay()))
    forget_logged()
