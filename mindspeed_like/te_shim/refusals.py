"""What the client module does not implement: TE's CUDA-only mechanisms, refused by name with the
alternative (the te-backend's wording and error type, so one ``except`` catches both)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from mindspeed_like.te_backend.refusals import TransformerEngineFeatureUnsupported, refuse

FP8 = ("fp8 training (fp8 recipes, fp8_autocast)", "train in bf16 (--bf16)")
USERBUFFERS = (
    "userbuffers TP communication overlap (initialize_ub, ub_overlap_*, --tp-comm-overlap)",
    "use --use-tiled-tp-overlap (tiled all-gather/reduce-scatter overlap on any device)",
)
CUDA_GRAPHS = ("CUDA graphs (make_graphed_callables)", "run without CUDA graphs")
CPU_OFFLOAD = (
    "CPU offloading of activations and weights (get_cpu_offload_context)",
    "use --recompute-activation-function or megatron's --recompute-granularity to save activation memory",
)
OPS = (
    "operation-based fusible ops (transformer_engine.pytorch.ops)",
    "use the module API (Linear, LayerNormLinear, ...); megatron's --use-fused-swiglu fuses SwiGLU",
)


class TransformerEngineAttributeRefused(TransformerEngineFeatureUnsupported, AttributeError):
    """A TE attribute this module does not provide; an AttributeError, so ``hasattr`` probes say
    False while a direct use reads the refusal."""


def refuse_attribute(te_feature: str, alternative: str) -> TransformerEngineAttributeRefused:
    try:
        refuse(te_feature, alternative)
    except TransformerEngineFeatureUnsupported as error:
        return TransformerEngineAttributeRefused(str(error))
    raise AssertionError("refuse() returned")  # pragma: no cover


def refused_module_getattr(module: str, refused: dict[str, tuple[str, str]]):
    """A module ``__getattr__``: TE names we refuse raise the refusal, others AttributeError."""

    def __getattr__(name: str) -> Any:
        if name in refused:
            raise refuse_attribute(*refused[name])
        raise AttributeError(
            f"module {module!r} has no attribute {name!r} (mindspeed_like's TransformerEngine client module "
            "implements TE's layer API only; see mindspeed_like/te_shim)"
        )

    return __getattr__


class Refused:
    """A TE class constructed only for a TE-only mechanism: subclassing works (clients do it at
    import), constructing says which feature and what instead."""

    te_feature = ""
    alternative = ""

    def __new__(cls, *args: Any, **kwargs: Any):
        refuse(cls.te_feature, cls.alternative)


@contextlib.contextmanager
def disabled_only(what: tuple[str, str], enabled: bool) -> Iterator[None]:
    """TE's ``fp8_autocast(enabled=False)`` and friends: nothing to do; enabled: refused."""
    if enabled:
        refuse(*what)
    yield


def check_no_userbuffers(kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if name.startswith("ub_") and value not in (None, False, ""):
            refuse(f"{USERBUFFERS[0]} [{name}]", USERBUFFERS[1])
