"""Host round-trips of a GPU run, counted on a CPU-only torch (inside :func:`~.fake_cuda.fake_cuda`).

A CUDA step is as fast as its kernels only while the host never waits for the GPU. Every operation
below makes the host wait on CUDA: it needs a GPU tensor's values (or its output's size, which
depends on them) on the host before Python can go on. Counting them per step on a CPU is how
`make test` keeps a path honest without a GPU: the first H100 run of the MoE preset was slower
than megatron's own path, and a path that adds round-trips is slower on every GPU.

    with fake_cuda(), count_host_round_trips() as trips:
        train_steps(...)
    trips.total, trips.by_kind          # e.g. {"item": 6, "nonzero": 4, "to-host": 2}

The kinds (each one operation on a tensor on the fake GPU, as torch's dispatcher sees it):

- ``item``: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, an
  ``if`` on a tensor), ``aten.is_nonzero``, ``aten.equal``;
- ``to-host``: a copy from the GPU to the host (``.cpu()``, ``.to("cpu")``, ``.tolist()``,
  ``host.copy_(gpu)``);
- ``nonzero``: ``nonzero`` / ``argwhere`` / one-argument ``where``;
- ``data-dependent-shape``: operations whose output size is read from the values (``masked_select``,
  ``unique*``, ``repeat_interleave`` without ``output_size``, ``bincount``, indexing or index-assigning
  with a boolean mask).

What it does not see: a sync inside a Python-implemented torch function run with the modes popped,
and ``torch.cuda.synchronize()`` / stream syncs (no data moves; fake_cuda answers them as no-ops).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

aten = torch.ops.aten

_ITEM = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
_NONZERO = {aten.nonzero.default, aten.argwhere.default}
_DATA_DEPENDENT = {
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


@dataclass
class HostRoundTrips:
    """The round-trips seen while the meter was active, by kind (module docstring)."""

    by_kind: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def snapshot(self) -> collections.Counter:
        return collections.Counter(self.by_kind)


_meters: list[HostRoundTrips] = []


@contextlib.contextmanager
def count_host_round_trips() -> Iterator[HostRoundTrips]:
    """Count the host round-trips of the GPU tensors of an enclosing :func:`fake_cuda` block."""
    meter = HostRoundTrips()
    _meters.append(meter)
    try:
        yield meter
    finally:
        _meters.remove(meter)


def _bool_index(args: tuple) -> bool:
    """Whether an index / index_put call (indices: its second argument) takes a boolean mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def round_trip_kind(
    func, args: tuple, kwargs: dict, on_gpu: Callable[[torch.Tensor], bool], to_host: bool
) -> str | None:
    """The kind of host round-trip ``func(*args, **kwargs)`` makes on a GPU, or None.

    ``on_gpu``: whether a tensor is on the (fake) GPU; ``to_host``: a ``_to_copy`` whose result goes
    to the host (Python moved it there)."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if func is aten._to_copy.default:
        return "to-host" if first is not None and on_gpu(first) and to_host else None
    if func is aten.copy_.default:  # copy_(dst, src): the host waits when the source is on the GPU
        src = args[1] if len(args) > 1 else kwargs.get("src")
        return "to-host" if not on_gpu(args[0]) and isinstance(src, torch.Tensor) and on_gpu(src) else None
    if first is None or not on_gpu(first):
        return None
    if func in _ITEM:
        return "item"
    if func in _NONZERO:
        return "nonzero"
    if func in _DATA_DEPENDENT:
        return "data-dependent-shape"
    if func is aten.repeat_interleave.Tensor or func is aten.repeat_interleave.self_Tensor:
        return None if kwargs.get("output_size") is not None else "data-dependent-shape"
    if func in _BOOL_INDEXED and _bool_index(args):
        return "data-dependent-shape"
    return None


def observe(func, args: tuple, kwargs: dict, on_gpu: Callable[[torch.Tensor], bool], to_host: bool) -> None:
    """Count ``func``'s round-trip in every active meter (called by fake_cuda's dispatch mode)."""
    if not _meters:
        return
    kind = round_trip_kind(func, args, kwargs, on_gpu, to_host)
    if kind is not None:
        count(kind)


def count(kind: str) -> None:
    """One round-trip of ``kind`` in every active meter."""
    for meter in _meters:
        meter.by_kind[kind] += 1
