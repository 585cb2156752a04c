"""Parity helpers: one seed, one dtype tolerance table, float64 comparisons, loss curves, backends.

What every parity test of this project (and of a downstream feature) needs, in one place:

    from mindspeed_like.testing.parity import SEED, assert_close_to_reference, assert_losses_close

    ref = op_in_float64(x.double())                      # the oracle, float64
    assert_close_to_reference(op(x), ref, x.dtype, what="out")   # table tolerance for x.dtype
    assert_losses_close(ours, megatron, rtol=1e-5, what="fp32 GPT, 10 steps")
    assert_losses_equal(ours, megatron, what="recompute")        # bitwise

Kernel tests run once per backend with the ``kernel_backend`` fixture of
:mod:`mindspeed_like.testing.pytest_plugin` (``pytest_plugins =
["mindspeed_like.testing.pytest_plugin"]`` in a conftest): ``portable``, ``reference`` and
``npu`` (torch_npu's ops through :func:`~mindspeed_like.testing.npu_emulator.emulated_torch_npu`);
the test reads the emulator's call counts from it. Outside pytest the same is
:func:`run_with_backend`.

Two ways to compare with a float64 reference, both reading :data:`TOLERANCES`:

- :func:`assert_close_to_reference` (most kernels): the largest error relative to the
  reference's largest magnitude, ``max|actual - ref| <= rtol * max|ref|``. One number per
  tensor, insensitive to elements near zero, which a ``rtol`` per element would over-weight.
- :func:`assert_elementwise_close`: ``torch.testing.assert_close`` on float64 copies with the
  table's ``rtol`` and ``atol`` (per element), for tests that stated their bound that way.

A test whose op needs another bound passes it explicitly (``tol=``, ``rtol=``, ``atol=``) and
says why next to it; the table is the default, not a ceiling. Never loosen a bound to make a
change pass: find out why the error grew.

Importing this module does not import megatron (nor pytest).
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, ModuleType

import torch

SEED = 1234
"""The seed of every parity run (``init_parallel``, ``train_steps``, data): two runs that differ
only in a feature must start from the same weights and see the same tokens."""


@dataclass(frozen=True)
class Tolerance:
    """Bounds for one dtype against a float64 reference.

    rtol: relative bound; for :func:`assert_close_to_reference` it is relative to the
        reference's largest magnitude, for :func:`assert_elementwise_close` per element.
    atol: absolute bound per element (:func:`assert_elementwise_close` only).
    why: the reasoning, kept with the numbers.
    """

    rtol: float
    atol: float
    why: str


TOLERANCES: Mapping[torch.dtype, Tolerance] = MappingProxyType(
    {
        torch.float32: Tolerance(
            rtol=1e-5,
            atol=1e-6,
            why="fp32 rounds each step at 2^-24 (6e-8) relative; a fused op reorders a few "
            "elementwise steps or a reduction of up to a few hundred terms (error ~1e-7 * log n), "
            "so a wrong formula shows at 1e-3 or more while reordering stays below 1e-6: 1e-5 "
            "leaves two orders of margin. atol 1e-6 bounds elements near zero at the same scale "
            "for O(1) values.",
        ),
        torch.bfloat16: Tolerance(
            rtol=2e-2,
            atol=2e-2,
            why="bf16 has 8 mantissa bits (2^-8 = 3.9e-3 relative per rounding); inputs, "
            "intermediates and outputs are each rounded, 2-5 times in a fused op, and gradients "
            "sum many rounded products: 2e-2 is about five roundings of O(1) values.",
        ),
    }
)
"""Default bounds per dtype against a float64 reference (see :class:`Tolerance`.why)."""


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The table's entry for ``dtype``; an unknown dtype is an error naming the known ones."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        known = ", ".join(str(d) for d in TOLERANCES)
        raise KeyError(f"no default tolerance for {dtype} (known: {known}); pass one explicitly") from None


def max_relative_error(actual: torch.Tensor, reference: torch.Tensor, floor: float = 0.0) -> float:
    """``max|actual - reference| / max(max|reference|, floor)``, computed in float64.

    ``floor``: the smallest scale to measure against, for tensors that can be exactly zero
    where the op's inputs are O(1) (e.g. dq of causal attention over one key): their error is
    then judged at the inputs' scale. Without one, a reference that is all zeros has no scale:
    the error is 0.0 when ``actual`` is exactly zero too and infinite otherwise.
    """
    actual = actual.detach().double()
    reference = reference.detach().double()
    if actual.shape != reference.shape:
        raise AssertionError(f"shapes differ: {tuple(actual.shape)} vs reference {tuple(reference.shape)}")
    if reference.numel() == 0:
        return 0.0
    error = (actual - reference).abs().max().item()
    scale = max(reference.abs().max().item(), floor)
    if scale == 0.0:
        return 0.0 if error == 0.0 else math.inf
    return error / scale


def assert_close_to_reference(
    actual: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    what: str = "",
    tol: float | None = None,
    floor: float = 0.0,
) -> float:
    """Assert ``max|actual - reference| <= tol * max(max|reference|, floor)``; return the error.

    ``dtype`` picks the table's bound (``TOLERANCES[dtype].rtol``; default: ``actual.dtype``);
    ``tol`` overrides it (say why in the test). ``reference`` is normally float64. ``floor``:
    see :func:`max_relative_error`.
    """
    dtype = actual.dtype if dtype is None else dtype
    bound = tolerance(dtype).rtol if tol is None else tol
    error = max_relative_error(actual, reference, floor)
    assert error <= bound, (
        f"{what or 'tensor'}: max error {error:.3g} of the reference's largest magnitude exceeds {bound:g} ({dtype})"
    )
    return error


def assert_elementwise_close(
    actual: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    what: str = "",
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """``torch.testing.assert_close`` of float64 copies, per element, with the table's ``rtol``
    and ``atol`` for ``dtype`` (default: ``actual.dtype``) unless given."""
    dtype = actual.dtype if dtype is None else dtype
    entry = tolerance(dtype) if rtol is None or atol is None else None
    torch.testing.assert_close(
        actual.detach().double(),
        reference.detach().double(),
        rtol=entry.rtol if rtol is None else rtol,
        atol=entry.atol if atol is None else atol,
        msg=(lambda m: f"{what}: {m}") if what else None,
    )


# ---------------------------------------------------------------- loss curves


def rel_close(actual: Sequence[float], expected: Sequence[float], rtol: float) -> bool:
    """Each step's value within ``rtol`` relative (``math.isclose``); the lengths must match."""
    return all(math.isclose(a, b, rel_tol=rtol) for a, b in zip(actual, expected, strict=True))


def _curves(actual: Sequence[float], expected: Sequence[float]) -> str:
    return f"\n  actual:   {list(actual)}\n  expected: {list(expected)}"


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], rtol: float, what: str = "losses") -> None:
    """Every step's loss within ``rtol`` relative of the expected one (``math.isclose``); the
    message names the first step that is not, both values and their relative difference."""
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected), f"{what}: {len(actual)} steps vs {len(expected)}{_curves(actual, expected)}"
    for step, (a, b) in enumerate(zip(actual, expected)):
        if not math.isclose(a, b, rel_tol=rtol):
            diff = abs(a - b) / max(abs(a), abs(b)) if math.isfinite(a) and math.isfinite(b) else math.nan
            raise AssertionError(
                f"{what}: step {step}: {a!r} vs {b!r} (relative difference {diff:.3g} > {rtol:g})"
                f"{_curves(actual, expected)}"
            )


def assert_losses_equal(actual: Sequence[float], expected: Sequence[float], what: str = "losses") -> None:
    """Bitwise equal loss curves (float64 bit patterns, so -0.0 differs from 0.0 and NaN
    equals only the same NaN); the message names the first step that differs."""
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected), f"{what}: {len(actual)} steps vs {len(expected)}{_curves(actual, expected)}"
    for step, (a, b) in enumerate(zip(actual, expected)):
        if struct.pack("<d", a) != struct.pack("<d", b):
            raise AssertionError(f"{what}: step {step}: {a!r} vs {b!r} (not bitwise equal){_curves(actual, expected)}")


# ---------------------------------------------------------------- kernel backends


BACKENDS = ("portable", "reference", "npu")
"""The kernel backends a kernel test runs on (``npu`` through the torch_npu emulator)."""


@dataclass(frozen=True)
class KernelBackend:
    """What ``kernel_backend`` / :func:`run_with_backend` hands a test.

    name: the forced backend. npu: the emulated ``torch_npu`` module, installed for every
    backend, so ``calls`` also proves that portable and reference never call torch_npu.
    """

    name: str
    npu: ModuleType

    @property
    def is_npu(self) -> bool:
        return self.name == "npu"

    @property
    def calls(self) -> Counter:
        """torch_npu op name -> calls so far (through the emulator)."""
        return self.npu.calls

    def expected_npu_calls(self, on_npu: int) -> int:
        """``on_npu`` for the npu backend, 0 for the others."""
        return on_npu if self.is_npu else 0

    def assert_npu_calls(self, op: str, on_npu: int) -> None:
        """``op`` ran ``on_npu`` times on the npu backend and never on the others."""
        expected = self.expected_npu_calls(on_npu)
        assert self.calls[op] == expected, f"{self.name}: {op} called {self.calls[op]} times, expected {expected}"


@contextlib.contextmanager
def run_with_backend(name: str) -> Iterator[KernelBackend]:
    """Force kernel backend ``name`` for the block, with the torch_npu emulator installed."""
    from mindspeed_like.kernels.backend import force_backend
    from mindspeed_like.testing.npu_emulator import emulated_torch_npu

    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    with emulated_torch_npu() as npu, force_backend(name):
        yield KernelBackend(name, npu)


__all__ = [
    "SEED",
    "Tolerance",
    "TOLERANCES",
    "tolerance",
    "max_relative_error",
    "assert_close_to_reference",
    "assert_elementwise_close",
    "rel_close",
    "assert_losses_close",
    "assert_losses_equal",
    "BACKENDS",
    "KernelBackend",
    "run_with_backend",
]


def saved_storages(fn: Callable[[], object]) -> tuple[object, dict[int, int]]:
    """``fn()``'s result and the storages autograd keeps from it to backward, unique by address:
    {address: bytes} (what a kernel's "saves no stacked copy" claim is checked on)."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept
