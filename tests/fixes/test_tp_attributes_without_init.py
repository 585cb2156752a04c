"""A model built with ``perform_initialization=False`` (weights loaded afterwards, as ms-swift and
Megatron-Bridge do) has TP=1's grad norm at TP=2 (mindspeed_like/fixes/tp_attributes_without_init.py
for megatron's layers, the te-backend's own TE attributes for the TE spec).

megatron's optimizer counts a parameter's gradient in the norm on every TP rank only if it is marked
``tensor_model_parallel``; megatron-core < 0.18 marks its sharded weights only while initialising
them. Here both TP sizes get the same weights: a model built with initialisation (CPU
initialisation scatters one master weight, so the same seed is the same function at every TP size)
is copied into the model built without it, which then takes one step of megatron's DDP + optimizer
on the same batch; the grad norm megatron computes for that step (what it logs and clips with) must
equal TP=1's up to float32 summation order.
"""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.fixes import tp_attributes_without_init as fix
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import destroy_parallel, init_parallel, run_distributed, tiny_gpt, train_steps
from mindspeed_like.testing.parity import SEED
from mindspeed_like.testing.training import make_batches, unwrap

FP32_RTOL = 1e-5  # same sums over other shards and in another order
# the grad-norm runs: (spec, model arguments); TE-spec MLA adds the duplicated TELinear down
# projections (the same weight on every TP rank: counted once, not TP times)
NORM_CASES = {
    "local": ("local", {}),
    "te": ("transformer_engine", {}),
    "te-mla": ("transformer_engine", dict(multi_latent_attention=True)),
}
MOE = dict(num_moe_experts=4, moe_router_topk=2)
HAS_GROUPED_MLP = megatron_core_version() is not None and megatron_core_version().release < (0, 17)
# every kind of sharded weight: embedding, column/row linears (stride 2 on the gated fc1), the output
# layer, experts as SequentialMLP's linears, megatron's legacy GroupedMLP and TE's grouped linears
MODELS = {
    "local-dense": dict(),
    "local-sequential-moe": dict(MOE, moe_grouped_gemm=False),
    "te-dense": dict(transformer_impl="transformer_engine"),
    "te-grouped-moe": dict(MOE, moe_grouped_gemm=True, transformer_impl="transformer_engine"),
}
if HAS_GROUPED_MLP:
    MODELS["local-grouped-moe"] = dict(MOE, moe_grouped_gemm=True)


def tp_attributes(model: torch.nn.Module) -> dict[str, tuple]:
    """Each parameter's megatron TP attributes (None where absent)."""
    return {
        name: tuple(getattr(param, attribute, None) for attribute in fix.TP_ATTRIBUTES)
        for name, param in model.named_parameters()
    }


@pytest.mark.parametrize("use_cpu_initialization", [True, False], ids=["cpu-init", "device-init"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_weights_marked_as_with_initialization(adaptor, kind, use_cpu_initialization):
    """Every parameter carries the TP attributes megatron's initialisation would have given it."""
    init_parallel(tp=1, seed=SEED)
    try:
        args = dict(MODELS[kind], use_cpu_initialization=use_cpu_initialization)
        expected = tp_attributes(tiny_gpt(**args))
        actual = tp_attributes(tiny_gpt(perform_initialization=False, **args))
        assert actual == expected
        assert sum(attributes[0] is True for attributes in expected.values()) >= 5
    finally:
        destroy_parallel()


MICRO_BATCH = 4  # rows of the one batch: split 2 + 2 over DP at TP=1 on two ranks, whole at TP=2


def _record_grad_norm(norms: list[float]):
    """``on_optimizer``: keep the grad norm megatron's optimizer computes in ``step()`` (the value
    Megatron-LM logs and ``clip_grad_norm_fp32`` clips with)."""

    def on_optimizer(model, optimizer) -> None:
        original = optimizer.get_grad_norm

        def get_grad_norm():
            norm = original()
            norms.append(float(norm))
            return norm

        optimizer.get_grad_norm = get_grad_norm

    return on_optimizer


def _loaded_without_init(transformer_impl: str, sequence_parallel: bool, **model_args):
    """The model built with ``perform_initialization=False`` on the device route (no
    ``use_cpu_initialization``, as ms-swift builds it), holding an initialised model's weights."""
    common = dict(transformer_impl=transformer_impl, sequence_parallel=sequence_parallel, **model_args)
    reference = tiny_gpt(**common)
    model = tiny_gpt(perform_initialization=False, use_cpu_initialization=False, **common)
    model.load_state_dict(reference.state_dict())
    return model


def grad_norms_worker(fixed: bool, cases: tuple[str, ...] = tuple(NORM_CASES)) -> dict:
    """``{(case, tp): first step's grad norm}`` for :data:`NORM_CASES` at TP=1 (DP=2) and TP=2 (with SP
    on the TE spec, so its norms' ``sequence_parallel`` marks are exercised too)."""
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    if not fixed:
        runtime.ENGINE.remove(fix.FEATURE.name)  # megatron's own layers
    out = {}
    try:
        for case in cases:
            impl, model_args = NORM_CASES[case]
            for tp in (1, 2):
                init_parallel(tp=tp, seed=SEED)
                try:
                    model = _loaded_without_init(impl, tp > 1 and impl != "local", **model_args)
                    gpt = unwrap(model)
                    batch = make_batches(1, MICRO_BATCH, gpt.max_sequence_length, gpt.vocab_size, SEED)[0]
                    norms: list[float] = []
                    train_steps(
                        model,
                        1,
                        data=batch,
                        micro_batch_size=MICRO_BATCH // (2 // tp),
                        finalize_grads=True,
                        on_optimizer=_record_grad_norm(norms),
                    )
                    out[(case, tp)] = norms[0]
                finally:
                    destroy_parallel()
    finally:
        mindspeed_like.reset()
    return out


FAST_NORM_CASES = ("local", "te")


@pytest.fixture(scope="module")
def fixed_norms() -> list[dict]:
    return run_distributed(grad_norms_worker, 2, True, FAST_NORM_CASES, timeout=300)


def _assert_tp2_equals_tp1(results: list[dict], case: str) -> None:
    for rank, norms in enumerate(results):
        tp1, tp2 = norms[(case, 1)], norms[(case, 2)]
        assert abs(tp2 - tp1) <= FP32_RTOL * tp1, f"{case}, rank {rank}: TP=2 grad norm {tp2!r}, TP=1 {tp1!r}"


@pytest.mark.parametrize("case", FAST_NORM_CASES)
def test_tp2_grad_norm_equals_tp1_without_initialization(fixed_norms, case):
    _assert_tp2_equals_tp1(fixed_norms, case)


@pytest.mark.slow
def test_te_mla_tp2_grad_norm_equals_tp1_duplicated_linears_counted_once():
    _assert_tp2_equals_tp1(run_distributed(grad_norms_worker, 2, True, ("te-mla",), timeout=300), "te-mla")


@pytest.mark.slow
@pytest.mark.skipif(
    megatron_core_version() not in fix.PATCHES[0].specifier(),
    reason="megatron-core 0.18+ marks the weights itself: nothing to show",
)
def test_megatron_tp2_grad_norm_too_small_without_the_fix():
    """The bug: megatron's own layers leave TP rank 1's shards out of the norm."""
    norms = run_distributed(grad_norms_worker, 2, False, timeout=300)[0]
    for case in NORM_CASES:
        tp1, tp2 = norms[(case, 1)], norms[(case, 2)]
        assert tp2 < (1 - 1e-3) * tp1, f"{case}: TP=2 {tp2!r}, TP=1 {tp1!r}"
