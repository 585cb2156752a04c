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
from mindspeed_like.testing import destroy_parallel, init_parallel, run_distributed, tiny_gpt
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


def test_te_public_sizes_as_te_sets_them(without_megatron_fix):
    """TE's ``Linear`` exposes ``in_features`` / ``out_features`` (this rank's shard), ``tp_size`` and
    ``use_bias``; mcore-bridge's ``TELinear.__repr__`` and LoRA read them (ms-swift's
    ``--tuner_type lora`` stopped at ``'TELinear' object has no attribute 'in_features'``)."""
    gpt = tiny_gpt(transformer_impl="transformer_engine", wrap_float16=False, **MODELS["mla"])
    seen = set()
    for module in gpt.modules():
        if not isinstance(module, TELinear):
            continue
        weight = module.weight
        assert (module.out_features, module.in_features) == tuple(weight.shape)
        assert module.tp_size == 1 and module.use_bias == (module.bias is not None)
        seen.add(type(module).__name__)
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear"} <= seen, seen
    # MLA's down projections: TELinear (duplicated) from megatron-core 0.14, TEColumnParallelLinear in 0.13
    assert seen & {"TELinear", "TEColumnParallelLinear"}, seen


def peft_sizes(module: torch.nn.Module) -> tuple[int, int]:
    """The sizes peft (0.20, ``tuners_utils._get_in_out_features``) gives a LoRA layer on a linear
    that is no ``nn.Linear``: megatron's ``input_size`` / ``output_size`` if it has both, else TE's
    ``in_features`` / ``out_features``."""
    if hasattr(module, "input_size") and hasattr(module, "output_size"):
        return module.input_size, module.output_size
    return module.in_features, module.out_features


def test_column_linears_have_no_megatron_full_sizes_as_te(without_megatron_fix):
    """TE's ``Linear`` has no ``input_size`` / ``output_size``; megatron's ColumnParallelLinear has,
    the full sizes, and peft reads them first: mcore-bridge's LoRA at TP=2 then built a ``lora_B``
    twice as wide as the column linear's shard (ms-swift LoRA at TP=2 with SP stopped on ``64 vs 128``).
    The TP=2 case is below; here the attributes and megatron's repr text."""
    gpt = tiny_gpt(transformer_impl="transformer_engine", wrap_float16=False)
    columns = [m for m in gpt.modules() if isinstance(m, TEColumnParallelLinear)]
    rows = [m for m in gpt.modules() if isinstance(m, TERowParallelLinear)]
    assert columns and rows
    for module in columns:
        assert not hasattr(module, "input_size") and not hasattr(module, "output_size")
        assert peft_sizes(module) == (module.weight.shape[1], module.weight.shape[0])
        assert repr(module).endswith(
            f"(in_features={module.in_features}, out_features={module.out_features}, "
            f"bias={module.bias is not None}, TP=1)"
        )
        with pytest.raises(TypeError, match="takes no weight"):
            module(torch.randn(4, 1, module.in_features), module.weight)
    for module in rows:  # mcore-bridge's RowParallelLinear branch sizes lora_A from the full input
        assert peft_sizes(module) == (module.input_size, module.output_size)


def _lora_sizes_at_tp2() -> list[tuple]:
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel(tp=2, seed=SEED)
    try:
        gpt = tiny_gpt(transformer_impl="transformer_engine", wrap_float16=False, sequence_parallel=True)
        found = []
        for name, module in gpt.named_modules():
            if isinstance(module, TEColumnParallelLinear):
                in_features, out_features = peft_sizes(module)
                # mcore-bridge: lora_A duplicated (in_features -> r), lora_B column-parallel of
                # out_features * tp_size, i.e. out_features on this rank; the base's shard is weight.shape[0]
                found.append((name, in_features, out_features, tuple(module.weight.shape), module.tp_size))
            elif isinstance(module, TERowParallelLinear):
                in_features, out_features = peft_sizes(module)
                # mcore-bridge's native-row branch: RowParallelLinear(in_features) splits it over TP
                found.append((name, in_features // 2, out_features, tuple(module.weight.shape), module.tp_size))
        return found
    finally:
        destroy_parallel()
        mindspeed_like.reset()


@pytest.mark.slow
def test_lora_sizes_match_the_shards_at_tp2_sp():
    """At TP=2 with SP the sizes mcore-bridge's LoRA takes from peft give adapters as wide as this
    rank's shard: a column linear's ``lora_B`` shard (peft's ``out_features``) is its weight's rows,
    a row linear's ``lora_A`` shard (peft's input size / TP) its weight's columns."""
    for found in run_distributed(_lora_sizes_at_tp2, 2, timeout=300):
        assert found
        for name, lora_in, lora_out, shape, tp_size in found:
            assert tp_size == 2, name
            if "linear_proj" in name or "linear_fc2" in name:
                assert lora_in == shape[1], f"{name}: lora_A shard {lora_in} vs the row shard {shape}"
            else:
                assert (lora_in, lora_out) == (shape[1], shape[0]), f"{name}: peft's {lora_in, lora_out} vs {shape}"


def test_layernorm_linear_returns_the_normed_input_when_asked(without_megatron_fix):
    """TE's ``LayerNormLinear(return_layernorm_output=True)`` returns ``((output, normed), bias)``;
    mcore-bridge's LoRA sets it on the built module to feed its adapter (ms-swift's LoRA stopped at
    ``too many values to unpack`` when the flag was ignored)."""
    gpt = tiny_gpt(transformer_impl="transformer_engine", wrap_float16=False)
    qkv = gpt.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(8, 2, qkv.in_features)
    plain, bias = qkv(x)
    qkv.return_layernorm_output = True
    (output, normed), same_bias = qkv(x)
    torch.testing.assert_close(output, plain, rtol=0, atol=0)
    torch.testing.assert_close(normed, qkv._normed(x), rtol=0, atol=0)
    assert same_bias is bias and normed.shape == x.shape


def test_grouped_linear_offers_megatrons_sharded_state_dict_grouped(without_megatron_fix):
    """mcore-bridge 1.6.5 replaces ``TEGroupedLinear.sharded_state_dict`` with a call of megatron's
    ``_sharded_state_dict_grouped(None, ...)`` (ms-swift's MoE save stopped on its absence); the
    column / row subclasses keep their own, with their TP axes, as megatron's do."""
    from mindspeed_like.te_backend.grouped_linear import TEColumnParallelGroupedLinear, TERowParallelGroupedLinear

    gpt = tiny_gpt(transformer_impl="transformer_engine", wrap_float16=False, **MODELS["grouped-moe"])
    grouped = [m for m in gpt.modules() if isinstance(m, TEGroupedLinear)]
    assert grouped
    for module in grouped:
        own = module.sharded_state_dict(prefix="experts.")
        by_name = module._sharded_state_dict_grouped(module._tp_axis_map(), "experts.", (), None)
        assert own.keys() == by_name.keys()
        assert [s.key for s in own.values()] == [s.key for s in by_name.values()]
    for cls in (TEColumnParallelGroupedLinear, TERowParallelGroupedLinear):
        assert "sharded_state_dict" in vars(cls)
