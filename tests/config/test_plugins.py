"""The plugin API, used as a downstream framework would: docs/plugins.md's worked example
(examples/finite_activations_plugin.py) registered, driven by flags/env/configure(), reported,
stacked on the built-in features that patch the same target, and reset."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest
import torch

import mindspeed_like
from mindspeed_like import ConfigError, Feature, Flag, Kind, Patch
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)
    module = importlib.import_module("finite_activations_plugin")
    mindspeed_like.reset()
    yield module
    destroy_parallel()
    mindspeed_like.reset()
    mindspeed_like.unregister_feature(module.NAME)
    sys.modules.pop("finite_activations_plugin", None)


def _forward(model, poison: bool = False):
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).unsqueeze(0).expand_as(tokens)
    if poison:
        with torch.no_grad():
            model.decoder.layers[1].mlp.linear_fc2.weight[0, 0] = float("nan")
    return model(tokens, positions, None, labels=tokens)


def test_the_worked_example_runs_like_a_builtin_feature(plugin):
    config = mindspeed_like.configure(device="cpu", check_finite_activations=True)
    assert config.check_finite_activations is True and config.check_finite_activations_every == 1
    records = {r.target: r for r in mindspeed_like.report() if r.feature == plugin.NAME}
    assert set(records) == {
        "megatron.core.transformer.transformer_layer.TransformerLayer.forward",
        "megatron.core.transformer.mlp.MLP.forward",
    }
    init_parallel(seed=1234)
    model = tiny_gpt()
    assert torch.isfinite(_forward(model)).all()
    with pytest.raises(plugin.NonFiniteActivation, match="MLP"):
        _forward(model, poison=True)
    mindspeed_like.configure(check_finite_activations=False)
    assert not any(r.feature == plugin.NAME for r in mindspeed_like.report())
    assert torch.isnan(_forward(model)).any()  # megatron's own path: the NaN flows on


def test_its_flags_come_from_env_and_command_line_too(plugin, monkeypatch):
    monkeypatch.setenv("MINDSPEED_LIKE_ARGS", "--check-finite-activations --check-finite-activations-every 3")
    config = mindspeed_like.configure(device="cpu")
    assert config.check_finite_activations is True and config.check_finite_activations_every == 3
    assert config.sources["check_finite_activations_every"] == "env"
    with pytest.raises(ConfigError, match="must be >= 1"):
        mindspeed_like.configure(check_finite_activations_every=0)
    with pytest.raises(ConfigError, match="Did you mean 'check_finite_activations'"):
        mindspeed_like.configure(check_finite_activation=True)


def test_it_stacks_above_the_builtin_features_in_its_declared_order(plugin):
    mindspeed_like.configure(
        device="cpu", check_finite_activations=True, use_fused_swiglu=True, recompute_activation_function=True
    )
    (record,) = [r for r in mindspeed_like.report() if r.feature == plugin.NAME and r.target.endswith("MLP.forward")]
    assert record.stack == ("fused-swiglu", "recompute-activation-function", plugin.NAME)
    from megatron.core.transformer.mlp import MLP

    assert MLP.__dict__["forward"].__wrapped__.__wrapped__.__wrapped__ is not None  # three wrappers deep
    init_parallel(seed=1234)
    assert torch.isfinite(_forward(tiny_gpt())).all()
    mindspeed_like.reset()
    assert not hasattr(MLP.__dict__["forward"], "__wrapped__")  # every original back by identity


def test_an_undeclared_order_on_a_shared_target_is_refused_at_configure(plugin):
    rude = Feature(
        name="rude-plugin",
        summary="wraps MLP.forward without saying where",
        flags=(Flag("use_rude_plugin", bool, False, "rude"),),
        patches=[Patch("megatron.core.transformer.mlp.MLP.forward", Kind.WRAP, plugin.check_mlp_output)],
    )
    mindspeed_like.register_feature(rude)
    try:
        mindspeed_like.configure(device="cpu", use_rude_plugin=True)  # alone on the target: fine
        with pytest.raises(ConfigError, match=r"both patch '.*MLP\.forward' and neither declares") as refused:
            mindspeed_like.configure(use_fused_swiglu=True)
        assert "'rude-plugin'" in str(refused.value) and "'fused-swiglu'" in str(refused.value)
        assert mindspeed_like.current_config().use_fused_swiglu is False  # the refused configure() did not stick
        assert not any(r.feature == "fused-swiglu" for r in mindspeed_like.report())
    finally:
        mindspeed_like.reset()
        mindspeed_like.unregister_feature("rude-plugin")


def test_registration_errors_are_clear(plugin):
    with pytest.raises(ConfigError, match="already registered"):
        mindspeed_like.register_feature(Feature(name=plugin.NAME, summary="again"))
    clash = Feature(name="clash", summary="x", flags=(Flag("other", bool, False, "x", aliases=("--use-flash-attn",)),))
    with pytest.raises(ConfigError, match="--use-flash-attn"):
        mindspeed_like.register_feature(clash)
    with pytest.raises(TypeError, match="mindspeed_like.Feature"):
        mindspeed_like.register_feature("not a feature")
    with pytest.raises(KeyError, match="built-in"):
        mindspeed_like.unregister_feature("flash-attention")
