"""The te-backend's TE modules initialise as TE's do when megatron's RNG tracker was never seeded.

megatron gives TE ``get_rng_state_tracker=None`` then, and TE runs ``init_method`` on the default
generator; megatron's parallel linears under the te-backend's classes always fork the tracker and
stopped with "cuda rng state expert-parallel-rng is not added when instantiating
TEColumnParallelGroupedLinear" (16 cases of megatron's test_grad_sync_with_expert_parallel.py at 8
ranks, which builds a TE-spec MoE layer without seeding). A seeded tracker keeps being forked.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig, spec_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel

SEED = 4321


@pytest.fixture
def parallel():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel(tp=1, seed=SEED)
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _te_layer_submodules(**options):
    """The TE spec's layer submodules (megatron-core 0.19 builds ``..._spec()`` from ``functools.partial``
    parts and has ``..._submodules()`` for them)."""
    submodules = getattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_submodules", None)
    if submodules is not None:
        return submodules(**options)
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options).submodules


def _mlp_submodules(layer_submodules):
    get = getattr(spec_utils, "get_submodules", None)
    return get(layer_submodules.mlp) if get is not None else layer_submodules.mlp.submodules


def _config(**moe) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, add_bias_linear=False, init_method_std=0.02, **moe
    )


def _moe_layer() -> MoELayer:
    config = _config(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
    return MoELayer(config, _mlp_submodules(_te_layer_submodules(num_experts=4, moe_grouped_gemm=True)))


def _dense_layer() -> TransformerLayer:
    return TransformerLayer(_config(), _te_layer_submodules())


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters() if "weight" in name and p.dim() == 2}


@pytest.mark.parametrize("build", [_dense_layer, _moe_layer], ids=["dense", "grouped-moe"])
def test_unseeded_tracker_initialises_on_the_default_generator(parallel, build) -> None:
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(SEED)
    first = _weights(build())
    assert "fork" not in vars(tracker), "the tracker's fork must be restored after construction"
    assert not tracker.is_initialized()
    torch.manual_seed(SEED)
    again = _weights(build())
    assert first.keys() == again.keys() and first
    for name in first:  # the default generator alone decides them, as under TE
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0, msg=name)
        assert first[name].std() > 0.005, name


def test_seeded_tracker_still_forks(parallel) -> None:
    """The experts' weights come from the tracker's expert-parallel state, whatever the default
    generator holds: the same tracker states give the same experts under two default seeds."""
    tracker = get_cuda_rng_tracker()
    assert tracker.is_initialized()
    states = {name: state.clone() for name, state in tracker.get_states().items()}
    torch.manual_seed(1)
    first = {n: w for n, w in _weights(_moe_layer()).items() if n.startswith("experts.")}
    assert "fork" not in vars(tracker)
    tracker.set_states({name: state.clone() for name, state in states.items()})
    torch.manual_seed(2)
    again = {n: w for n, w in _weights(_moe_layer()).items() if n.startswith("experts.")}
    assert first.keys() == again.keys() and len(first) == 8
    for name in first:
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0, msg=name)
