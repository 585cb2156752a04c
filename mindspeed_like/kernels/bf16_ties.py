"""Where the ties of a shared bf16/fp32 buffer are kept: an index table (host) or a bitmask (CUDA).

For an fp32 master ``m`` with bf16 weight ``b = bf16(m)`` (round to nearest, ties to even) the
residual ``d = m - (b << 16)`` (bit patterns read as integers) lies in ``[-32768, +32768]``; all
but ``d = +32768`` fit the int16 residual slot (:mod:`mindspeed_like.kernels.bf16_residual`).
``d = +32768``, a tie rounded *down* onto an even ``b`` (about 1 element in 131,072), is a *tie*:
its residual is stored as 0 and the tie is recorded here. Some storage beyond 16 bits per
element is unavoidable for exactness (an even bf16 value has 65,537 fp32 preimages); the two
representations spend it differently:

- :class:`SparseTies` (the ``portable`` backend: cpu, npu): the sorted flat indices of the
  ties, ~8 bytes per 131,072 elements. Reading a range's ties takes a ``searchsorted`` and a
  ``.tolist()``, recording them a ``nonzero()``: host syncs, free on a CPU (the data is there),
  a pipeline stall each on a GPU (the first CUDA run's optimizer step was thousands of them).
- :class:`BitTies` (the ``cuda`` backend): one bit per element, bit ``k % 8`` of byte
  ``k // 8`` (uint8, ``ceil(n / 8)`` bytes: 0.125 B/param, 1/32 of the 4-byte shared storage).
  Decoding is ``m = (b << 16) + r + 32768 * bit``, encoding computes the bit: elementwise,
  fixed shapes, no host sync. On CUDA tensors each is one Triton kernel
  (``backends/cuda_bf16_residual.py``); elsewhere (the ``cuda`` backend forced on CPU tensors,
  or where Triton is unavailable or failed its check) eager torch ops with the same integer math.

Both take ranges of the buffer (or bucket shard) they belong to: ``decode(weights, residual,
start, out, scale=None)`` writes the exact masters of elements ``[start, start + len)`` (times
``scale``, one fp32 multiply, when given: AdamW's decoupled weight decay folded into the decode,
the very multiply ``torch.optim.AdamW`` makes, ``x * float32(scale)`` correctly rounded);
``encode(master, weights, residual, start)`` writes the bf16 bits and residuals and records the
range's ties; ``commit()`` makes recorded ties current (the index table merges them; the bitmask
was written in place), so decoding and encoding several ranges of one buffer in one pass is
safe. ``out`` may overlap the inputs and ``master`` the outputs (each element reads before it
writes): the in-place layouts and the DistributedOptimizer's scratch rely on it.

Rounding of BitTies' encode is integer math on the bit pattern, ``(u + 0x7FFF + lsb) >> 16`` on
the non-NaN patterns (what ``c10::BFloat16``'s round-to-nearest-even computes, and so PyTorch's
cast on every device): the same bits from the Triton kernel, the eager ops and megatron's copy
into its bf16 params. A NaN master's weight is the master's high half with the quiet bit set (a
NaN of the same sign; PyTorch's casts give 0x7FC0 on a CPU and 0x7FFF on CUDA); its residual is
0, so it decodes to a NaN. SparseTies keeps PyTorch's cast (its NaNs are the device's).
"""

from __future__ import annotations

import logging

import torch

from mindspeed_like.kernels.backend import backend_for

TIE = 32768  # d = +32768 does not fit an int16 residual: recorded as a tie
_log = logging.getLogger("mindspeed_like")


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32)


# ---------------------------------------------------------------- the index table (host)


class SparseTies:
    """Sorted int64 flat indices of the tie elements of one buffer (or bucket shard)."""

    kind = "sparse"

    def __init__(self, device: torch.device, indices: torch.Tensor | None = None) -> None:
        self.indices = torch.empty(0, dtype=torch.int64, device=device) if indices is None else indices
        self._recorded: list[tuple[int, int, torch.Tensor]] = []

    def nbytes(self) -> int:
        return self.indices.numel() * self.indices.element_size()

    def count(self) -> int:
        return int(self.indices.numel())

    def clear(self) -> None:
        self.indices = self.indices[:0]
        self._recorded = []

    def in_range(self, start: int, stop: int) -> torch.Tensor:
        """The tie indices in ``[start, stop)``, relative to ``start`` (a host sync)."""
        if not self.indices.numel():
            return self.indices
        bounds = torch.tensor([start, stop], device=self.indices.device)
        lo, hi = torch.searchsorted(self.indices, bounds).tolist()
        return self.indices[lo:hi] - start

    def decode(
        self, weights: torch.Tensor, residual: torch.Tensor, start: int, out: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        m = torch.bitwise_left_shift(_as_int32(weights), 16).add_(residual)  # (b << 16) + r modulo 2**32
        ties = self.in_range(start, start + weights.numel())
        if ties.numel():
            m[ties] += TIE
        out.view(torch.int32).copy_(m)
        return out if scale is None else out.mul_(scale)

    def encode(self, master: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, start: int) -> None:
        bf16 = master.to(torch.bfloat16).view(torch.int16)
        d = master.view(torch.int32) - torch.bitwise_left_shift(_as_int32(bf16), 16)
        d.masked_fill_(torch.isnan(master), 0)
        tie = d == TIE
        ties = tie.nonzero().flatten()
        if ties.numel():
            d.masked_fill_(tie, 0)
        weights.copy_(bf16)
        residual.copy_(d)
        self._recorded.append((start, start + master.numel(), ties.add_(start)))

    def commit(self) -> None:
        """The recorded ranges' ties replace the table's entries in those ranges."""
        if not self._recorded:
            return
        kept = torch.ones(self.indices.numel(), dtype=torch.bool, device=self.indices.device)
        if self.indices.numel():
            bounds = torch.tensor([x for a, b, _ in self._recorded for x in (a, b)], device=self.indices.device)
            edges = torch.searchsorted(self.indices, bounds).tolist()
            for lo, hi in zip(edges[0::2], edges[1::2]):
                kept[lo:hi] = False
        parts = [self.indices[kept], *(ties for _, _, ties in self._recorded)]
        self.indices = torch.cat(parts).sort().values
        self._recorded = []


# ---------------------------------------------------------------- the bitmask (cuda)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.int32, device=device)


def _window(bits: torch.Tensor, start: int, n: int) -> tuple[torch.Tensor, int]:
    """The bytes holding bits ``[start, start + n)`` and the first bit's position in them."""
    return bits[start // 8 : (start + n + 7) // 8], start % 8


def unpack(bits: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Bits ``[start, start + n)`` of a bitmask as int32 0/1 (eager)."""
    window, shift = _window(bits, start, n)
    flags = (_as_int32(window).unsqueeze(1) >> _shifts(bits.device)) & 1
    return flags.reshape(-1)[shift : shift + n]


def decode_eager(
    weights: torch.Tensor,
    residual: torch.Tensor,
    bits: torch.Tensor,
    start: int,
    out: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``m = (b << 16) + r + (bit << 15)`` in int32 (two's complement: the pattern modulo 2**32),
    times ``scale`` (fp32) when given."""
    m = torch.bitwise_left_shift(_as_int32(weights), 16).add_(residual)
    m.add_(unpack(bits, start, weights.numel()) << 15)
    out.view(torch.int32).copy_(m)
    return out if scale is None else out.mul_(scale)


def split_bits(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 bits as int32 in int16 range, residual as int32, tie flags as bool).

    int32 throughout without overflow: NaN lanes are zeroed first; for every other pattern ``u``
    (negative ones too, in two's complement) ``u + 0x7FFF + lsb`` stays in range and the
    arithmetic shift yields the rounded high half as a signed 16-bit value."""
    u = master.view(torch.int32)
    nan = torch.isnan(master)
    safe = u.masked_fill(nan, 0)
    b = (safe + 0x7FFF + ((safe >> 16) & 1)) >> 16
    d = safe - (b << 16)
    tie = d == TIE
    d.masked_fill_(tie, 0)
    b = torch.where(nan, (u >> 16) | 0x40, b)  # a quiet NaN with the master's sign
    return b, d, tie


def encode_eager(
    master: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, bits: torch.Tensor, start: int
) -> None:
    """The bf16 bits, residuals and tie bits of ``master``; bits outside the range are kept."""
    b, d, tie = split_bits(master)
    n = master.numel()
    window, shift = _window(bits, start, n)
    shifts = _shifts(bits.device)
    flags = ((_as_int32(window).unsqueeze(1) >> shifts) & 1).reshape(-1)
    flags[shift : shift + n] = tie.reshape(-1).to(torch.int32)
    packed = (flags.view(-1, 8) << shifts).sum(1)
    weights.copy_(b.view(weights.shape))
    residual.copy_(d.view(residual.shape))
    window.copy_(packed)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _fused(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels serve these tensors: contiguous, in CUDA memory (the storage's
    own device: ``testing/fake_cuda`` labels host memory "cuda"), kernels checked on the device."""
    if not tensors[0].is_cuda or not all(t.is_contiguous() for t in tensors):
        return False
    if tensors[0].untyped_storage().device.type != "cuda":
        return False
    device = tensors[0].device
    ok = _checked.get(device)
    if ok is None:
        ok = _checked[device] = _kernels_work(device)
    return ok


_checked: dict[torch.device, bool] = {}
HIGH_HALVES = (0x0000, 0x0001, 0x007F, 0x0080, 0x3F7F, 0x3F80, 0x3F81, 0x7F7F, 0x7F80, 0x7FC0)
HIGH_HALVES += tuple(h | 0x8000 for h in HIGH_HALVES)
"""High halves of the kernels' check: +-0 and subnormals, the smallest normal, values rounding up
into the next binade and to +-inf, +-1.0 (even) and its odd neighbour, +-inf and NaN."""


def crafted(device: torch.device) -> torch.Tensor:
    """fp32 patterns: every low half (ties to even and odd included) under :data:`HIGH_HALVES`."""
    low = torch.arange(65536, dtype=torch.int64, device=device)
    words = torch.cat([(h << 16) + low for h in HIGH_HALVES])
    return (words - (words >= 1 << 31).to(torch.int64) * (1 << 32)).to(torch.int32).view(torch.float32)


def _kernels_work(device: torch.device) -> bool:
    """Once per device: the Triton kernels against the eager ops on :func:`crafted` patterns, aligned
    and not (bits merged into partly used bytes). One host sync, at the first use; any error or
    difference: the eager ops from then on, said once."""
    try:
        from mindspeed_like.kernels.backends import cuda_bf16_residual as cuda

        why = cuda.unavailable() or _differs(cuda, crafted(device)[:-3])  # an odd length
    except Exception as error:  # a compiler or driver problem: the eager ops are the same math
        why = f"{type(error).__name__}: {error}"
    if why is not None:
        _log.warning(
            "mindspeed_like: the Triton kernels of the bf16/fp32 tie bitmask are not used on %s (%s); "
            "the same integer math runs as eager torch ops (bitwise the same results, slower)",
            device,
            why,
        )
    return why is None


def _differs(cuda, master: torch.Tensor) -> str | None:
    n = master.numel()
    results = []
    for encode, decode in ((encode_eager, decode_eager), (cuda.encode, cuda.decode)):
        w, r = (torch.empty(n, dtype=torch.int16, device=master.device) for _ in range(2))
        bits = torch.full(((n + 13) // 8,), 0xA5, dtype=torch.uint8, device=master.device)
        encode(master[:1000], w[:1000], r[:1000], bits, 3)  # an unaligned range first ...
        encode(master[1000:], w[1000:], r[1000:], bits, 1003)  # ... then the rest
        out, scaled = torch.empty_like(master), torch.empty_like(master)
        decode(w[5:], r[5:], bits, 8, out[5:])  # unaligned decode
        decode(w[:5], r[:5], bits, 3, out[:5])
        decode(w, r, bits, 3, scaled, 1 - 1e-4 * 0.1)  # AdamW's weight decay folded in
        results.append((w, r, bits, out.view(torch.int32), scaled.view(torch.int32)))
    if not all(torch.equal(a, b) for a, b in zip(*results)):
        return "their results differ from the eager ops' on crafted bit patterns"
    return None


class BitTies:
    """One bit per element (uint8, ``ceil(n / 8)`` bytes): sync-free ranges."""

    kind = "bits"

    def __init__(self, n: int, device: torch.device) -> None:
        self.bits = torch.zeros((n + 7) // 8, dtype=torch.uint8, device=device)

    def nbytes(self) -> int:
        return self.bits.numel()

    def count(self) -> int:
        """Number of ties (a host sync: tests and diagnostics only)."""
        return int(unpack(self.bits, 0, self.bits.numel() * 8).sum())

    def clear(self) -> None:
        self.bits.zero_()

    def commit(self) -> None:
        """Nothing to do: ``encode`` wrote the bits in place."""

    def decode(
        self, weights: torch.Tensor, residual: torch.Tensor, start: int, out: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        if _fused(weights, residual, out, self.bits):
            from mindspeed_like.kernels.backends import cuda_bf16_residual as cuda

            if _overlap(out, weights) or _overlap(out, residual):
                target = torch.empty_like(out)
                cuda.decode(weights, residual, self.bits, start, target, scale)
                return out.copy_(target)
            return cuda.decode(weights, residual, self.bits, start, out, scale)
        return decode_eager(weights, residual, self.bits, start, out, scale)

    def encode(self, master: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, start: int) -> None:
        if _fused(master, weights, residual, self.bits):
            from mindspeed_like.kernels.backends import cuda_bf16_residual as cuda

            if _overlap(master, weights) or _overlap(master, residual):
                master = master.clone()
            cuda.encode(master, weights, residual, self.bits, start)
            return
        encode_eager(master, weights, residual, self.bits, start)


Ties = SparseTies | BitTies


def new_ties(n: int, like: torch.Tensor) -> Ties:
    """Empty ties for a buffer of ``n`` elements on ``like``'s device, as its backend keeps them."""
    if backend_for(like) == "cuda":
        return BitTies(n, like.device)
    return SparseTies(like.device)
