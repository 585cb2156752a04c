"""The te-backend's layers carry TransformerEngine's tensor-parallel attributes whatever
``perform_initialization`` says, as TE's modules do (``reset_parameters`` marks them), without
relying on megatron's layers or on fix-tp-attributes-without-init (switched off here).

megatron's grad norm and clipping count a parameter on every TP rank only if it is marked
``tensor_model_parallel``; ``partition_dim`` / ``partition_stride`` tell checkpoint resharding and
Muon how it is split; ``sequence_parallel`` tells ``finalize_model_grads`` to sum a norm's gradient
over TP. tests/fixes/test_tp_attributes_without_init.py checks the grad norm at TP=2 equals TP=1's.
"""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.fixes import tp_attributes_without_init as fix
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.te_backend.grouped_linear import TEGroupedLinear
from mindspeed_like.te_backend.linear import TEColumnParallelLinear, TELinear, TERowParallelLinear
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
from mindspeed_like.testing.parity import SEED

VERSION = megatron_core_version()
MODELS = {
    "dense": dict(qk_layernorm=True, add_bias_linear=True),  # column and row biases, the gated fc1's stride
    # expert biases from megatron-core 0.15 ("Bias is not supported for MoE" before)
    "grouped-moe": dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_grouped_gemm=True,
        add_bias_linear=VERSION is not None and VERSION.release >= (0, 15),
    ),
    "mla": dict(multi_latent_attention=True),  # duplicated TELinear down projections
}


@pytest.fixture
def without_megatron_fix():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    runtime.ENGINE.remove(fix.FEATURE.name)
    init_parallel(tp=1, seed=SEED)
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _attributes(param: torch.Tensor) -> tuple:
    return tuple(getattr(param, name, None) for name in fix.TP_ATTRIBUTES)


def te_expected(module: torch.nn.Module, name: str, stride: int) -> tuple | None:
    """What TE's ``reset_parameters`` (then megatron's wrapper's ``partition_stride``) gives the
    parameter ``name`` of a te-backend linear; None for one TE does not mark."""
    if isinstance(module, TEGroupedLinear):
        dim = 1 if module.parallel_mode == "row" else 0
        if name.startswith("weight") or (name.startswith("bias") and module.parallel_mode == "column"):
            return (True, dim if name.startswith("weight") else 0, 1)
        return None
    if isinstance(module, TERowParallelLinear):
        return (True, 1, 1) if name == "weight" else None
    if isinstance(module, TEColumnParallelLinear):
        return (True, 0, stride) if name in ("weight", "bias") else None
    return None


@pytest.mark.parametrize("use_cpu_initialization", [True, False], ids=["cpu-init", "device-init"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_te_backend_marks_its_parameters_without_initialization(without_megatron_fix, kind, use_cpu_initialization):
    args = dict(transformer_impl="transformer_engine", use_cpu_initialization=use_cpu_initialization, **MODELS[kind])
    model = tiny_gpt(perform_initialization=False, **args)
    # the stride megatron's MLP builds its fc1 with (2 for a gated fc1 from 0.16, 1 before), as
    # megatron's initialisation records it
    initialised = dict(tiny_gpt(**args).named_modules())
    checked = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, (TELinear, TEGroupedLinear)):
            continue
        stride = getattr(getattr(initialised[module_name], "weight", None), "partition_stride", 1)
        for name, param in module.named_parameters(recurse=False):
            if name.startswith("layer_norm_"):  # TE's LayerNormLinear: marked like TE's norms
                assert param.sequence_parallel is False, f"{module_name}.{name}"
                continue
            if type(module) is TELinear:  # duplicated: the same weight on every TP rank, counted once
                assert not getattr(param, "tensor_model_parallel", False), f"{module_name}.{name}"
                continue
            expected = te_expected(module, name, stride)
            if expected is None:  # a row bias: not split; megatron marks it sequence_parallel
                assert hasattr(param, "sequence_parallel"), f"{module_name}.{name}"
                continue
            assert _attributes(param) == expected, f"{module_name}.{name}"
            checked += 1
    assert checked >= 6


def test_te_norms_marked_sequence_parallel_as_te_does(without_megatron_fix):
    """TE's LayerNorm / RMSNorm set ``sequence_parallel`` on their parameters from the config."""
    from mindspeed_like.te_backend.norm import build_norm
    from mindspeed_like.testing.models import gpt_config

    for sequence_parallel in (False, True):
        config = gpt_config(perform_initialization=False)
        object.__setattr__(config, "sequence_parallel", sequence_parallel)  # TP=1 refuses SP in __post_init__
        norm = build_norm(config, 64)
        assert [p.sequence_parallel for p in norm.parameters()] == [sequence_parallel] * len(list(norm.parameters()))
