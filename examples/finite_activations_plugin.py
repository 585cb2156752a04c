"""A user's own feature, built the way mindspeed_like's are (docs/plugins.md walks through it).

``--check-finite-activations`` stops training at the first transformer layer whose output holds
a NaN or an inf, naming the layer, instead of letting the loss turn into NaN steps later.
``--check-finite-activations-every N`` checks every N-th call only (the check costs one
reduction over the layer output).

Use it like a built-in feature:

    import examples.finite_activations_plugin          # registers the feature
    import mindspeed_like.megatron_adaptor             # then flags, env, configure() all know it
    mindspeed_like.configure(check_finite_activations=True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

import mindspeed_like
from mindspeed_like import ConfigError, Context, Feature, Flag, Kind, Patch

NAME = "check-finite-activations"


class NonFiniteActivation(FloatingPointError):
    """A transformer layer produced a NaN or an inf."""


@dataclass(frozen=True)
class CheckLayerOutput:
    """Wrapper of ``TransformerLayer.forward``: built from the config, compared by value (so an
    unchanged configure() leaves the patch in place)."""

    every: int
    calls: itertools.count = field(default_factory=itertools.count, compare=False)

    def __call__(self, wrapped, instance, args, kwargs):
        output = wrapped(*args, **kwargs)
        hidden = output[0] if isinstance(output, tuple) else output
        if next(self.calls) % self.every == 0 and not torch.isfinite(hidden).all():
            raise NonFiniteActivation(f"transformer layer {instance.layer_number} produced a NaN or inf")
        return output


def check_mlp_output(wrapped, instance, args, kwargs):
    """Wrapper of ``MLP.forward``: the same check at the MLP, where most overflows start. The
    built-in fused-swiglu and recompute-activation-function wrap ``MLP.forward`` too, so this
    patch declares that it sits above them (it sees their result)."""
    output, bias = wrapped(*args, **kwargs)
    if not torch.isfinite(output).all():
        raise NonFiniteActivation("an MLP produced a NaN or inf")
    return output, bias


def patches(ctx: Context) -> list[Patch]:
    return [
        Patch(
            "megatron.core.transformer.transformer_layer.TransformerLayer.forward",
            Kind.WRAP,
            CheckLayerOutput(every=ctx["check_finite_activations_every"]),
            why="stop at the first layer whose output is not finite",
        ),
        Patch(
            "megatron.core.transformer.mlp.MLP.forward",
            Kind.WRAP,
            check_mlp_output,
            why="stop at the first MLP whose output is not finite",
            after=("fused-swiglu", "recompute-activation-function"),
        ),
    ]


def validate(ctx: Context) -> None:
    if ctx["check_finite_activations_every"] < 1:
        raise ConfigError(f"--check-finite-activations-every must be >= 1, got {ctx['check_finite_activations_every']}")


FEATURE = Feature(
    name=NAME,
    summary="stop at the first transformer layer whose output holds a NaN or inf, naming it",
    patches=patches,
    flags=(
        Flag("check_finite_activations", bool, False, "raise at the first non-finite layer output"),
        Flag("check_finite_activations_every", int, 1, "check every N-th layer call only"),
    ),
    validate=validate,
    backend="any",
)

mindspeed_like.register_feature(FEATURE)
