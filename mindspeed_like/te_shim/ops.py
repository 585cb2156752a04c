"""``transformer_engine.pytorch.ops`` as served to clients: TE's operation-based fusible API, refused.

The names exist (clients use them in annotations and ``isinstance`` checks evaluated at import:
Megatron-Bridge's fused LoRA annotates ``-> tuple[te.ops.Sequential, te.ops.Sequential]``);
constructing one raises the refusal naming the feature and the alternative (the module API:
``Linear``, ``LayerNormLinear``, ...)."""

from __future__ import annotations

from mindspeed_like.te_shim.refusals import OPS, Refused, refused_module_getattr

NAMES = (
    "AddExtraInput",
    "AddInPlace",
    "BasicLinear",
    "Bias",
    "ConstantScale",
    "Dropout",
    "GELU",
    "Identity",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "Quantize",
    "ReLU",
    "RMSNorm",
    "Sequential",
    "SwiGLU",
)


def _refused_op(name: str) -> type:
    return type(
        name, (Refused,), {"te_feature": f"{OPS[0]} [ops.{name}]", "alternative": OPS[1], "__module__": __name__}
    )


globals().update({name: _refused_op(name) for name in NAMES})

__getattr__ = refused_module_getattr("transformer_engine.pytorch.ops", {})

__all__ = list(NAMES)
