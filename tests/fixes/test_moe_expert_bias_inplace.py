"""MoE experts with biases (megatron's default ``add_bias_linear=True``), with and without our fix.

megatron-core 0.15+ adds an expert's fc2 bias in place into the fc2 output, which at TP=1 without EP
is a view returned by a custom autograd Function (mindspeed_like/fixes/moe_expert_bias_inplace.py).
0.13/0.14 refuse biases on MoE layers in ``TransformerConfig``: there the fix must not be applied.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.fixes import moe_expert_bias_inplace as fix
from mindspeed_like.testing import destroy_parallel, gpt_config, init_parallel, run_distributed, tiny_gpt, train_steps
from mindspeed_like.testing.parity import SEED, assert_losses_equal

STEPS = 2
EXPERTS = dict(num_moe_experts=4, add_bias_linear=True)
CASES = {
    "sequential": dict(),  # local spec: SequentialMLP of megatron's MLPs (RowParallelLinear fc2)
    "te-sequential": dict(transformer_impl="transformer_engine"),  # SequentialMLP, te-backend's TE linears
    "grouped": dict(transformer_impl="transformer_engine", moe_grouped_gemm=True),  # TEGroupedMLP (te-backend)
}
VIEW_ERROR = "is a view and is being modified inplace"


@pytest.fixture
def adaptor():
    mindspeed_like.reset()
    runtime.apply()
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _fix_applied() -> bool:
    import megatron.core.tensor_parallel.layers  # noqa: F401  (the target's module: pending until imported)

    return any(r.feature == fix.FEATURE.name and r.status == "applied" for r in runtime.report())


def _expert_biases_supported() -> bool:
    """False on releases whose TransformerConfig refuses biases on MoE layers (0.13, 0.14)."""
    try:
        gpt_config(**EXPERTS)
    except AssertionError as error:
        assert "Bias is not supported for MoE" in str(error)
        return False
    return True


def _train(case: str, tp: int = 1, sp: bool = False) -> tuple[list[float], dict[str, torch.Tensor], list[bool]]:
    """Losses, trained parameters and the expert fc2s' ``explicit_expert_comm`` of a tiny MoE GPT
    (expert-TP 1: megatron allows expert biases only there)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    init_parallel(tp=tp, seed=SEED, expert_tensor_parallel_size=1)
    try:
        model = tiny_gpt(**EXPERTS, **CASES[case], expert_tensor_parallel_size=1, sequence_parallel=sp)
        flags = [m.explicit_expert_comm for m in model.modules() if isinstance(m, RowParallelLinear) and m.is_expert]
        losses = train_steps(model, STEPS, seed=SEED)
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return losses, params, flags
    finally:
        destroy_parallel()


@contextlib.contextmanager
def _size_one_reductions_return_a_copy():
    """megatron's path with PyTorch's own remedy for the error ("clone the output of the custom
    Function"): a reduction (all-reduce, or reduce-scatter under SP) over a group of one returns a
    copy of its input. Values and gradients are the identity's, so this is megatron's intended
    ``output + bias * scale``, at the price of one copy."""
    from megatron.core.tensor_parallel import mappings

    regions = (mappings._ReduceFromModelParallelRegion, mappings._ReduceScatterToSequenceParallelRegion)
    originals = {region: inspect.getattr_static(region, "forward") for region in regions}

    def copying(original):
        def forward(ctx, input_, *args, **kwargs):
            output = original.__func__(ctx, input_, *args, **kwargs)
            return output.clone() if output is input_ else output

        return staticmethod(forward)

    for region, original in originals.items():
        region.forward = copying(original)
    try:
        yield
    finally:
        for region, original in originals.items():
            region.forward = original


def _check(case: str, tp: int = 1, sp: bool = False) -> None:
    """With the fix it trains; megatron's own path dies on the view (TEGroupedMLP: trains, the
    same numbers); megatron's path with copying reductions: bitwise the fixed run's losses and
    parameters. Leaves the fix removed."""
    losses, params, flags = _train(case, tp, sp)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1], losses
    assert (not flags) if case == "grouped" else (flags and all(flags)), flags

    runtime.ENGINE.remove(fix.FEATURE.name)  # megatron's own behaviour
    if case == "grouped":  # TEGroupedMLP adds its biases out of place: nothing to fix, nothing changed
        assert_losses_equal(_train(case, tp, sp)[0], losses)
    else:
        region = "_ReduceScatterToSequenceParallelRegion" if sp else "_ReduceFromModelParallelRegion"
        with pytest.raises(RuntimeError, match=f"Output 0 of {region} {VIEW_ERROR}"):
            _train(case, tp, sp)
    with _size_one_reductions_return_a_copy():
        ref_losses, ref_params, ref_flags = _train(case, tp, sp)
    assert not any(ref_flags)
    assert_losses_equal(losses, ref_losses)
    assert ref_params.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(value, ref_params[name]), name


@pytest.mark.parametrize("case", list(CASES))
def test_tp1_moe_with_biases_trains_bitwise_as_megatron_intends(adaptor, case):
    if not _expert_biases_supported():
        assert not _fix_applied()  # no expert biases, no bug: megatron's constructors untouched
        return
    assert _fix_applied()
    _check(case)


# megatron refuses MoE training at TP>1 without SP ("performance may degrade")
TP2_CASES = [("sequential", True), ("grouped", True)]


def tp2_worker() -> bool:
    for case, sp in TP2_CASES:
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu")
        assert _fix_applied()
        _check(case, tp=2, sp=sp)
    mindspeed_like.reset()
    return True


@pytest.mark.slow
def test_tp2_moe_with_biases_trains_bitwise_as_megatron_intends(adaptor):
    """Expert biases need expert-TP 1, so at TP=2 without EP the experts reduce over a group of
    one as at TP=1 (with SP, which megatron requires there: a reduce-scatter): the same bug, the same fix."""
    if not _expert_biases_supported():
        pytest.skip("this megatron-core refuses biases on MoE layers (0.13/0.14)")
    assert run_distributed(tp2_worker, 2, timeout=900) == [True, True]
