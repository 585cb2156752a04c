"""A pure-torch stand-in for ``torch_npu`` that ENFORCES the documented op contracts.

No NPU exists here and torch-npu cannot be installed (it needs Huawei's CANN), so the npu
backend's calls are verified against this emulator: it checks argument polarity, layouts,
shapes, dtypes and return structure as notes/torch-npu-ops.md states them, and raises
:class:`ContractError` on a wrong call, then computes the documented result in plain torch.
It proves our calls are right, not that they are fast.

    with emulated_torch_npu() as npu:
        ...  # code under test imports torch_npu and gets the emulator
        assert npu.calls["npu_rms_norm"] == 1

Each op lives in its own module of this package and is registered in ``OPS``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator

OPS: dict[str, Callable] = {}


class ContractError(AssertionError):
    """A call that torch_npu's documented contract does not allow."""


def register(name: str) -> Callable[[Callable], Callable]:
    def add(fn: Callable) -> Callable:
        OPS[name] = fn
        return fn

    return add


def _load_ops() -> None:
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


@contextlib.contextmanager
def emulated_torch_npu() -> Iterator[types.ModuleType]:
    """Install the emulator as ``torch_npu`` for the block; ``module.calls`` counts op calls."""
    _load_ops()
    module = types.ModuleType("torch_npu")
    module.__doc__ = "mindspeed_like test emulator of torch_npu (contract checks only)"
    module.calls = Counter()

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            module.calls[name] += 1
            return fn(*args, **kwargs)

        call.__name__ = name
        return call

    for name, fn in OPS.items():
        setattr(module, name, counted(name, fn))
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = module
    try:
        yield module
    finally:
        if previous is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous
