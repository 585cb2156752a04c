"""Fix: megatron's MoE router dies without TransformerEngine, on every device.

``megatron.core.transformer.moe.moe_utils`` binds ``te_general_gemm`` (with the TE fused MoE ops)
inside ``try: import transformer_engine ... except ImportError: HAVE_TE = False``: without TE the
name is never bound, not even to None. ``RouterGatingLinearFunction.forward`` and ``.backward``
(the router's gating GEMM, ``router_gating_linear``, called by every ``TopKRouter.gating``) then
test ``if te_general_gemm is not None and router_dtype != torch.float64`` and raise ``NameError:
name 'te_general_gemm' is not defined`` at the first MoE forward. Seen on one H100 (torch 2.11,
megatron-core 0.16.1, no TE): megatron's own arm of ``mindspeed-like compare --preset moe --device
cuda`` died there. It is megatron's non-TE path, broken wherever TE is absent: the device does not
matter (the cpu-adapter used to cover it on a CPU host only).

The fix: both methods run as twins that read ``te_general_gemm`` as None while the module lacks the
name (megatron's intended non-TE branch, ``torch.mm`` / ``torch.addmm`` in the router dtype: the
same bytecode, so the same numbers). Every other global is read live from the module; where TE is
installed the name exists and the originals run untouched. Nothing is added to megatron's module
(DESIGN principle 1: never create a missing attribute).

Why these two targets: the name is read only in these two methods (0.13-0.19), and
``router_gating_linear`` calls them through ``RouterGatingLinearFunction.apply``, so patching the
methods on the class covers every caller. Releases 0.13-0.16 only: from 0.17 megatron binds the
TE names to None itself without TE (``if HAVE_TE: ... else: (..., te_general_gemm) = (None, ...)``),
so there is nothing to fix.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import MOE_UTILS

UNBOUND_WITHOUT_TE = "te_general_gemm"


class _GlobalsWithDefaults(dict):
    """A function's globals: the module's, live, with a default for names the module lacks."""

    __slots__ = ("_module", "_defaults")

    def __init__(self, module: dict, defaults: dict[str, Any]) -> None:
        super().__init__()
        self["__builtins__"] = module.get("__builtins__", __builtins__)
        self["__name__"] = module.get("__name__")
        self._module = module
        self._defaults = defaults

    def __missing__(self, key: str) -> Any:
        try:
            return self._module[key]
        except KeyError:
            if key in self._defaults:
                return self._defaults[key]
            raise


def with_defaults(func: Callable, defaults: dict[str, Any]) -> Callable:
    """A twin of ``func`` (same code, defaults, closure) whose unbound globals in ``defaults`` read
    their default instead of raising NameError."""
    twin = types.FunctionType(
        func.__code__,
        _GlobalsWithDefaults(func.__globals__, defaults),
        func.__name__,
        func.__defaults__,
        func.__closure__,
    )
    twin.__kwdefaults__ = func.__kwdefaults__
    twin.__qualname__ = func.__qualname__
    twin.__module__ = func.__module__
    twin.__wrapped__ = func
    return twin


_twins: dict[Callable, Callable] = {}


def _te_general_gemm_none_when_unbound(wrapped, instance, args, kwargs):
    func = getattr(wrapped, "__func__", wrapped)
    if UNBOUND_WITHOUT_TE in vars(sys.modules[func.__module__]):  # TE installed: megatron's own
        return wrapped(*args, **kwargs)
    twin = _twins.get(func)
    if twin is None:
        twin = _twins[func] = with_defaults(func, {UNBOUND_WITHOUT_TE: None})
    return twin(*args, **kwargs)


PATCHES = [
    Patch(
        f"{MOE_UTILS}.RouterGatingLinearFunction.{method}",
        Kind.WRAP,
        _te_general_gemm_none_when_unbound,
        versions="<0.17",
        why="te_general_gemm is unbound without TransformerEngine (NameError at the first MoE forward)",
    )
    for method in ("forward", "backward")
]

FEATURE = Feature(
    name="fix-moe-router-without-te",
    summary="megatron's MoE router gating runs without TransformerEngine on every device "
    "(te_general_gemm was unbound: NameError)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
