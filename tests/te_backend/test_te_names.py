"""One class per TransformerEngine name (issue 48 item 3): megatron's TE wrappers derive from TE's
``transformer_engine.pytorch`` classes, and clients check them so (megatron's
``test_spec_customization.py::test_build_module``: ``isinstance(TENorm(...), te.pytorch.LayerNorm)``).
The te-backend's classes and the te-client-module's names are the same classes: the te-backend's
are registered subclasses of the client module's."""

from __future__ import annotations

import importlib

import pytest
import torch

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel
from mindspeed_like.testing.models import gpt_config
from mindspeed_like.testing.parity import SEED


@pytest.fixture
def te():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel(seed=SEED)
    yield importlib.import_module("transformer_engine")  # the te-client-module's, after the import line
    destroy_parallel()
    mindspeed_like.reset()


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_te_norm_builds_te_s_norm_class(te, normalization, zero_centered_gamma):
    from megatron.core.extensions.transformer_engine import TENorm

    config = gpt_config(normalization=normalization, layernorm_zero_centered_gamma=zero_centered_gamma)
    norm = TENorm(config, config.hidden_size, eps=1e-5)
    other = "RMSNorm" if normalization == "LayerNorm" else "LayerNorm"
    assert isinstance(norm, getattr(te.pytorch, normalization))
    assert not isinstance(norm, getattr(te.pytorch, other))  # siblings in TE, not one an instance of the other
    assert not isinstance(te.pytorch.RMSNorm(8, device="cpu"), te.pytorch.LayerNorm)


def test_megatrons_te_wrappers_are_instances_of_te_s_classes(te):
    from megatron.core.extensions import transformer_engine as ext
    from megatron.core.transformer.enums import AttnMaskType

    config = gpt_config()
    h = config.hidden_size
    init = torch.nn.init.zeros_
    linear = dict(config=config, init_method=init, bias=False, skip_bias_add=False)
    built = {
        "Linear": [
            ext.TELinear(h, h, parallel_mode="duplicated", skip_weight_param_allocation=False, **linear),
            ext.TEColumnParallelLinear(h, h, gather_output=False, is_expert=False, **linear),
            ext.TERowParallelLinear(h, h, input_is_parallel=True, is_expert=False, **linear),
        ],
        "LayerNormLinear": [ext.TELayerNormColumnParallelLinear(h, h, gather_output=False, is_expert=False, **linear)],
        "DotProductAttention": [ext.TEDotProductAttention(config, 1, AttnMaskType.causal, "self")],
        "GroupedLinear": [
            ext.TEColumnParallelGroupedLinear(2, h, h, is_expert=True, **linear),
            ext.TERowParallelGroupedLinear(2, h, h, is_expert=True, **linear),
        ],
    }
    for name, modules in built.items():
        te_class = getattr(te.pytorch, name)
        for module in modules:
            assert isinstance(module, te_class), (type(module).__name__, name)
            assert issubclass(type(module), te_class)
    # and nothing more: a norm is not a linear, attention is not a linear
    assert not isinstance(built["DotProductAttention"][0], te.pytorch.Linear)
    assert not isinstance(built["Linear"][0], te.pytorch.LayerNormLinear)


def test_spec_customization_build_module_layernorm(te):
    """megatron's test_build_module's LayerNorm check: a spec naming TENorm by module path."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    config = gpt_config(normalization="LayerNorm")
    spec = ModuleSpec(module=("megatron.core.extensions.transformer_engine", "TENorm"))
    layernorm = build_module(spec, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
    assert isinstance(layernorm, te.pytorch.LayerNorm)
