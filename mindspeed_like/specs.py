"""Explicit composition: our norm, attention and MLP modules in a megatron-core layer spec,
for users who build their own specs instead of letting the adaptor patch megatron (the way
Liger-Kernel offers both). Nothing of megatron is patched by these modules themselves::

    from mindspeed_like.specs import gpt_layer_spec, gpt_block_spec
    spec = gpt_block_spec(config, use_flash_attn=True, use_fused_rmsnorm=True, use_fused_swiglu=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=..., max_sequence_length=...)

``gpt_layer_spec(**flags, **local_spec_kwargs)`` is megatron's ``get_gpt_layer_local_spec`` with
the modules swapped; ``gpt_block_spec(config, ...)`` also gives the final norm ours (megatron builds
the block's final norm outside the layer spec). :class:`MindSpeedSpecProvider` is a
``BackendSpecProvider`` for megatron's backend-aware spec helpers. The flags are ours, typed and
validated as everywhere (``ConfigError`` for a wrong name or value). On a CPU host megatron itself
still needs the device bring-up (``import mindspeed_like.megatron_adaptor`` with no feature flags).

Covered: RMSNorm (input, pre-MLP, q/k and final norms), core attention, the dense MLP's SwiGLU and
activation recompute. MoE experts are built by megatron's expert classes from their own
submodules: for them use the flags (patching).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from mindspeed_like import config as config_mod
from mindspeed_like import registry
from mindspeed_like.adapters.detect import detect_device
from mindspeed_like.toolkit.declaration import Context
from mindspeed_like.toolkit.errors import ConfigError

SPEC_FEATURES = ("fused-rmsnorm", "flash-attention", "fused-swiglu", "recompute-activation-function")


def resolve(flags: Mapping[str, Any]) -> Context:
    """A Context from explicit flag values only (no env, no command line): typed and validated."""
    features = [registry.feature_by_name(name) for name in SPEC_FEATURES]
    all_flags = [f for f in config_mod.all_flags(features)]
    config = config_mod.resolve(all_flags, code=dict(flags))
    ctx = Context(config=config, device=detect_device(config["device"]))
    for feature in features:
        if feature.is_enabled(ctx) and feature.validate is not None:
            feature.validate(ctx)
    return ctx


@functools.cache
def _norm_class():
    from mindspeed_like.features.fused_rmsnorm.norm import new_fused_rmsnorm

    class FusedNorm:
        """megatron's ``WrappedTorchNorm`` factory, with RMSNorm configs built as FusedRMSNorm."""

        def __new__(cls, config, hidden_size, eps=1e-5):
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            return new_fused_rmsnorm(WrappedTorchNorm, None, (config, hidden_size, eps), {})

    return FusedNorm


@functools.cache
def _attention_class(flash):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class FlashDotProductAttention(DotProductAttention):
        """megatron's DotProductAttention computed by mindspeed_like's flash kernel."""

        def forward(self, *args, **kwargs):
            return flash(super().forward, self, args, kwargs)

    return FlashDotProductAttention


@functools.cache
def _mlp_class(fused_swiglu: bool, recompute):
    from megatron.core.transformer.mlp import MLP

    from mindspeed_like.features.fused_swiglu.activation import is_swiglu_inline

    class ComposedMLP(MLP):
        """megatron's MLP with mindspeed_like's fused SwiGLU and/or activation recompute."""

        def forward(self, *args, **kwargs):
            inner = self.swiglu_forward if fused_swiglu else super().forward
            if recompute is None:
                return inner(*args, **kwargs)
            return recompute(inner, self, args, kwargs)

        def swiglu_forward(self, hidden_states, per_token_scale=None, **kwargs):
            """megatron's MLP.forward for a plain SwiGLU, with our fused kernel as the activation."""
            from mindspeed_like.kernels.swiglu import swiglu, weighted_swiglu

            if not is_swiglu_inline(self) or kwargs:
                return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
            intermediate, bias = self.linear_fc1(hidden_states)
            if per_token_scale is None:
                intermediate = swiglu(intermediate, bias)
            elif bias is None:
                intermediate = weighted_swiglu(intermediate, per_token_scale.unsqueeze(-1))
            else:
                return super().forward(hidden_states, per_token_scale=per_token_scale)
            output, output_bias = self.linear_fc2(intermediate)
            if per_token_scale is not None and output_bias is not None:
                output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
                output_bias = None
            return output, output_bias

    return ComposedMLP


@functools.cache
def _layer_class():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mindspeed_like.features.recompute_activation.layers import layer_init

    class NumberedTransformerLayer(TransformerLayer):
        """megatron's TransformerLayer recording its layer number on its MLPs (per-layer recompute)."""

        def __init__(self, *args, **kwargs):
            layer_init(super().__init__, self, args, kwargs)

    return NumberedTransformerLayer


class MindSpeedSpecProvider:
    """A megatron ``BackendSpecProvider``: the local provider's modules, ours where a flag asks.

    ``MindSpeedSpecProvider(use_flash_attn=True, use_fused_rmsnorm=True)``; the methods are
    megatron's protocol (``layer_norm``, ``core_attention``, ...).
    """

    def __init__(self, **flags: Any) -> None:
        from megatron.core.models.backends import LocalSpecProvider

        self.ctx = resolve(flags)
        self._local = LocalSpecProvider()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)  # linears, grouped MLP modules, activation_func

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        if self.ctx["use_fused_rmsnorm"]:
            return _norm_class()  # RMSNorm configs become fused; LayerNorm ones stay megatron's
        return self._local.layer_norm(rms_norm=rms_norm, for_qk=for_qk)

    def core_attention(self) -> type:
        if not self.ctx["use_flash_attn"]:
            return self._local.core_attention()
        from mindspeed_like.features.flash_attention import FlashAttentionUnsupported
        from mindspeed_like.features.flash_attention.forward import CausalShape, FlashAttentionForward

        shape = CausalShape(self.ctx["sparse_mode"], self.ctx["pre_tockens"], self.ctx["next_tockens"])
        fallback = self.ctx.fallback("flash-attention", FlashAttentionUnsupported, "using megatron's attention")
        return _attention_class(FlashAttentionForward(shape, fallback))

    def mlp(self) -> type | None:
        """The dense MLP class, or None when no flag changes it."""
        fused = bool(self.ctx["use_fused_swiglu"])
        recompute = None
        if self.ctx["recompute_activation_function"]:
            from mindspeed_like.features.recompute_activation.mlp import (
                MLPForward,
                Recompute,
                RecomputeActivationUnsupported,
            )

            fallback = self.ctx.fallback(
                "recompute-activation-function", RecomputeActivationUnsupported, "keeping the activation output"
            )
            from mindspeed_like.features.recompute_activation.checkpoint import needs_hook_safe_checkpoint

            hook_safe = needs_hook_safe_checkpoint(Context(self.ctx.config, megatron_version=_megatron_version()))
            recompute = MLPForward(Recompute(self.ctx["recompute_activation_function_num_layers"], hook_safe, fallback))
        return _mlp_class(fused, recompute) if fused or recompute is not None else None

    def transformer_layer(self) -> type | None:
        """A layer class that records layer numbers (for the recompute's per-layer selection)."""
        if self.ctx["recompute_activation_function"] and self.ctx["recompute_activation_function_num_layers"]:
            return _layer_class()
        return None


def _megatron_version():
    from mindspeed_like.megatron_version import megatron_core_version

    return megatron_core_version()


def _swap_modules(spec, provider: MindSpeedSpecProvider):
    """Walk a ModuleSpec tree and replace megatron's local modules by the provider's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def swap(module):
        if module is WrappedTorchNorm:
            return provider.layer_norm(rms_norm=True)
        if module is DotProductAttention:
            return provider.core_attention()
        if module is MLP:
            return provider.mlp() or MLP
        if module is TransformerLayer:
            return provider.transformer_layer() or TransformerLayer
        return module

    def walk(node):
        if isinstance(node, functools.partial):
            return walk_builder(node)
        if isinstance(node, ModuleSpec):
            node.module = swap(node.module)
            walk(node.submodules)
            return node
        if isinstance(node, type):
            return swap(node)
        if node is not None and hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                setattr(node, name, walk(getattr(node, name)))
        return node

    def walk_builder(builder: functools.partial):
        """megatron-core 0.18+ spells a submodule as a builder, ``partial(MLP.as_mlp_submodule,
        submodules=...)``: a classmethod of the module class, bound to it. The same builder of
        our class (a subclass) builds ours."""
        func = builder.func
        owner = getattr(func, "__self__", None)
        keywords = {name: walk(value) for name, value in builder.keywords.items()}
        if isinstance(owner, type):
            swapped = swap(owner)
            if swapped is not owner:
                func = getattr(swapped, func.__name__)
        return functools.partial(func, *builder.args, **keywords)

    return walk(spec)


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    ours = {f.name for name in SPEC_FEATURES for f in registry.feature_by_name(name).flags} | {"strict", "device"}
    return {k: v for k, v in kwargs.items() if k in ours}, {k: v for k, v in kwargs.items() if k not in ours}


def gpt_layer_spec(**kwargs: Any):
    """megatron's ``get_gpt_layer_local_spec(**megatron_kwargs)`` with our modules where our flags
    (``use_fused_rmsnorm``, ``use_flash_attn``/``sparse_mode``/``pre_tockens``/``next_tockens``,
    ``use_fused_swiglu``, ``recompute_activation_function``/``..._num_layers``, ``strict``) ask."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    flags, megatron_kwargs = _split(kwargs)
    try:
        spec = get_gpt_layer_local_spec(**megatron_kwargs)
    except TypeError as error:
        raise ConfigError(
            f"gpt_layer_spec: {error} (neither one of our flags nor get_gpt_layer_local_spec's)"
        ) from error
    return _swap_modules(spec, MindSpeedSpecProvider(**flags))


def gpt_block_spec(config, **kwargs: Any):
    """A ``TransformerBlockSubmodules`` for ``config.num_layers`` layers of :func:`gpt_layer_spec`
    whose final norm is ours too (megatron builds the final norm outside the layer spec)."""
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    flags, _ = _split(kwargs)
    if "normalization" in inspect.signature(get_gpt_layer_local_spec).parameters:  # not in every version
        kwargs.setdefault("normalization", config.normalization)
    layer = gpt_layer_spec(**kwargs)
    provider = MindSpeedSpecProvider(**flags)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=provider.layer_norm(rms_norm=True)
    )
