"""Exact byte counting: storages deduplicated by data pointer (never RSS)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _storage(tensor: torch.Tensor):
    return tensor.untyped_storage()


def _data_pointer(tensor: torch.Tensor) -> int | None:
    """Where a tensor's storage lives (a DTensor's: its local shard's); None for a storage freed in
    place (FSDP's resharded parameters hold none between their unit's forward and backward)."""
    from mindspeed_like.toolkit.dtensors import local_shard

    tensor = local_shard(tensor)
    try:
        return _storage(tensor).data_ptr()
    except RuntimeError:
        return None


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
        self._retired: list[tuple[int, torch.UntypedStorage]] = []  # (nbytes at save, storage)
        self._ctx = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        ptr = storage.data_ptr()
        known = self._storages.get(ptr)
        if known is not None and known._cdata != storage._cdata:
            # A storage saved earlier was resized (freed) since, and the allocator gave its
            # address to this new one: both are real, keep counting the old one aside.
            # (Held storages cannot be freed otherwise, so this happens only after a resize.)
            self._retired.append((self._sizes.pop(ptr), self._storages.pop(ptr)))
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
        return sum(self._sizes.values()) + sum(size for size, _ in self._retired)

    @property
    def count(self) -> int:
        """Number of distinct storages saved."""
        return len(self._sizes) + len(self._retired)

    def current_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the saved storages as they are now (after any resize).

        ``exclude``: tensors whose storages are not counted, e.g. the model's parameters
        (held for the whole run anyway, so not activation memory).
        """
        if getattr(self, "_released", False):
            raise RuntimeError("SavedBytesMeter.current_bytes() after release(): read it before releasing")
        skip = {pointer for t in exclude if t is not None and (pointer := _data_pointer(t)) is not None}
        held = sum(s.nbytes() for ptr, s in self._storages.items() if ptr not in skip)
        return held + sum(s.nbytes() for _, s in self._retired)

    def release(self) -> None:
        """Drop the meter's references to the saved storages (``bytes`` and ``count`` keep their
        values; ``current_bytes`` is then an error). Until then the meter holds every storage it
        saw, and autograd holds the meter (its pack hook) for as long as the graph lives, so a
        backward run before this frees no saved activation until it ends: its peak is the
        backward's temporaries on top of all the activations, which no user's run sees (measured on
        compare's probed step: every layer's activations alive at the last layer's backward)."""
        self._retired = [(size, None) for size, _ in self._retired]  # type: ignore[misc]
        self._storages = {}
        self._released = True

    def storage_sizes(self) -> dict[int, int]:
        """data_ptr -> bytes at save time."""
        return dict(self._sizes)
