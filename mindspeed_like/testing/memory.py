"""Exact byte counting: storages deduplicated by data pointer (never RSS)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _storage(tensor: torch.Tensor):
    return tensor.untyped_storage()


def param_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _storage(tensor)
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


class SavedBytesMeter:
    """Counts the bytes autograd saves for backward inside the ``with`` block.

    Saved tensors are deduplicated by the data pointer of their storage (a tensor saved by
    several ops, or views of one buffer, count once). ``bytes`` is the total of the storage
    sizes as they were when saved; ``current_bytes()`` re-reads the sizes now, because a
    feature may resize a storage after saving it (e.g. freeing an activation output until
    recompute refills it). The meter holds the saved storages (not their tensors) until it is dropped.

        with SavedBytesMeter() as meter:
            loss = model(...)
        print(meter.bytes, meter.count)
    """

    def __init__(self) -> None:
        self._sizes: dict[int, int] = {}  # data_ptr -> nbytes at save time
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._ctx = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        ptr = storage.data_ptr()
        if ptr not in self._sizes or storage.nbytes() > self._sizes[ptr]:
            self._sizes[ptr] = storage.nbytes()
            self._storages[ptr] = storage
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedBytesMeter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._ctx is not None
        self._ctx.__exit__(*exc)
        self._ctx = None

    @property
    def bytes(self) -> int:
        """Bytes of distinct storages saved for backward, sized when saved."""
        return sum(self._sizes.values())

    @property
    def count(self) -> int:
        """Number of distinct storages saved."""
        return len(self._sizes)

    def current_bytes(self) -> int:
        """Bytes of the saved storages as they are now (after any resize)."""
        return sum(s.nbytes() for s in self._storages.values())

    def storage_sizes(self) -> dict[int, int]:
        """data_ptr -> bytes at save time."""
        return dict(self._sizes)
