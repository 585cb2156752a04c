"""One 4-byte storage for a bf16 weight and its exact fp32 master.

A bf16 value is the high half of an fp32 bit pattern. For an fp32 master ``m`` let
``b = bf16(m)`` (PyTorch's cast: round to nearest, ties to even) and ``d = m - (b << 16)``,
the signed difference of the bit patterns read as integers. For finite ``m``, ``d`` lies in
``[-32768, +32768]``; ``-32768 .. 32767`` fit an int16 "residual" exactly. ``+32768`` (a tie
rounded *down* onto an even ``b``) does not fit: no 16-bit field can hold all 65,537 preimages
of an even bf16 value. Those rare elements (about 1 in 131,072 for well-mixed low bits) are
*ties*, kept beside the buffer (its ``side``; :mod:`mindspeed_like.kernels.bf16_ties`): a
sorted index table on the host, a bitmask (0.125 B/element) on CUDA; their residual is stored
as 0. Decoding is ``m = (b << 16) + r (+ 32768 for a tie)``: exact for every
finite value, including subnormals, +-0 and values that round up into the next binade or to
+-inf. NaN masters decode to a NaN (the bf16 NaN widened; the payload is not kept) and
+-inf round-trip exactly.

Layouts of one parameter's buffer ``buf`` (int16, ``2 * n`` elements, little endian):

- *split* (between optimizer steps): ``buf[:n]`` are the bf16 weights (the model's param is
  a contiguous bf16 view of it), ``buf[n:]`` the residuals.
- *fp32* (during the optimizer step): ``buf`` viewed as fp32 is the exact master (each
  element's low half is its residual slot, its high half its bf16 slot).

:func:`to_fp32` / :func:`to_split` convert in place. Moving between the two layouts is a
perfect shuffle of the int16 halves; it is done by recursive halving (swap / rotate the two
middle quarters, recurse) with every copy chunked, so the transient workspace is
``O(chunk)`` elements regardless of the parameter's size (measured by
``benchmarks/param_memory.py``), at the cost of ``log2(n / chunk)`` passes over the data.

Backends: ``portable`` (the in-place chunked code with the index table; plain integer tensor
ops, so it runs on any device, an NPU included: there is no torch_npu op for this, so ``npu``
uses the same code), ``cuda`` (the same layouts with the bitmask, decoded and encoded by one
Triton kernel each: no host sync; chunks of :data:`CUDA_CHUNK`, optimizer-step batches of
:data:`CUDA_BATCH`) and ``reference``
(:func:`split_reference` / :func:`join_reference`, whole-tensor out-of-place math: the oracle
of the tests). :func:`new_ties`, :func:`chunk_for` and :func:`batch_for` pick by the buffer's
device.
"""

from __future__ import annotations

import sys

import torch

from mindspeed_like.kernels.backend import backend_for
from mindspeed_like.kernels.bf16_ties import TIE, BitTies, SparseTies, Ties, new_ties

DEFAULT_CHUNK = 1 << 18  # elements; ~8 MB peak workspace (int64 temporaries of one chunk)
CUDA_CHUNK = 1 << 22
"""Elements per chunk of the layout moves on CUDA (the DistributedOptimizer's scratch build and
split, checkpoint copies, the in-place shuffle): kernel launches of 16 MiB-per-array ranges; the
eager paths' int32/int64 temporaries of one chunk stay near 100 MiB."""
CUDA_BATCH = 1 << 25
"""Elements per batch of the Float16 optimizer step on CUDA (``features/reuse_fp32_param/
chunked_step.py``): a 128 MiB fp32 workspace, plus torch's foreach temporaries of one batch. A CPU
batch (:data:`DEFAULT_CHUNK`) is sized for its caches; on a GPU each batch costs a Python call of
torch's Adam and a dozen launches, and 2**18-element batches made the step launch-bound
(``testing/optimizer_step_check.py`` times 2**23..2**26)."""

if sys.byteorder != "little":  # pragma: no cover - every supported accelerator host is little endian
    raise ImportError("mindspeed_like.kernels.bf16_residual assumes a little-endian host")


def chunk_for(buf: torch.Tensor) -> int:
    """Elements per chunk of the layout moves for a buffer on this device (its backend)."""
    return CUDA_CHUNK if backend_for(buf) == "cuda" else DEFAULT_CHUNK


def batch_for(buf: torch.Tensor) -> int:
    """Elements per batch of the optimizer step for a buffer on this device (its backend)."""
    return CUDA_BATCH if backend_for(buf) == "cuda" else DEFAULT_CHUNK


# ---------------------------------------------------------------- reference (out of place)


def split_reference(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 weight, int16 residual, side-table flat indices), whole tensor."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_reference needs an fp32 tensor, got {master.dtype}")
    flat = master.reshape(-1)
    bf16 = flat.to(torch.bfloat16)
    d = flat.view(torch.int32).to(torch.int64) - (bf16.view(torch.int16).to(torch.int64) << 16)
    d = d.masked_fill(torch.isnan(flat), 0)
    tie = d == TIE
    side = tie.nonzero().flatten()
    residual = d.masked_fill(tie, 0).to(torch.int16)
    return bf16.view(master.shape), residual.view(master.shape), side


def join_reference(bf16: torch.Tensor, residual: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_reference`: the exact fp32 master."""
    m = (bf16.reshape(-1).view(torch.int16).to(torch.int64) << 16) + residual.reshape(-1).to(torch.int64)
    m[side] += TIE
    return m.to(torch.int32).view(torch.float32).view(bf16.shape)


# ---------------------------------------------------------------- encode / decode (in place, chunked)


def _encode_range(buf: torch.Tensor, start: int, stop: int, side: Ties) -> None:
    """fp32 elements ``[start, stop)`` of ``buf`` -> (residual, bf16) pairs in place; records the ties."""
    words = buf[2 * start : 2 * stop]
    pairs = words.view(-1, 2)
    side.encode(words.view(torch.float32), pairs[:, 1], pairs[:, 0], start)  # low half: residual


def _decode_range(buf: torch.Tensor, start: int, stop: int, side: Ties) -> None:
    """(residual, bf16) pairs of elements ``[start, stop)`` -> the exact fp32 master, in place."""
    words = buf[2 * start : 2 * stop]
    pairs = words.view(-1, 2)
    side.decode(pairs[:, 1], pairs[:, 0], start, words.view(torch.float32))


# ---------------------------------------------------------------- layout moves (in place, chunked)


def _swap_blocks(x: torch.Tensor, a: int, b: int, length: int, chunk: int) -> None:
    for s in range(0, length, chunk):
        c = min(chunk, length - s)
        tmp = x[a + s : a + s + c].clone()
        x[a + s : a + s + c] = x[b + s : b + s + c]
        x[b + s : b + s + c] = tmp


def _reverse(x: torch.Tensor, lo: int, hi: int, chunk: int) -> None:
    while hi - lo >= 2:
        m = min(chunk, (hi - lo) // 2)
        front = x[lo : lo + m].flip(0)
        x[lo : lo + m] = x[hi - m : hi].flip(0)
        x[hi - m : hi] = front
        lo += m
        hi -= m


def _rotate(x: torch.Tensor, lo: int, mid: int, hi: int, chunk: int) -> None:
    """``x[lo:hi] = [A | B]`` with ``A = x[lo:mid]`` becomes ``[B | A]``."""
    if mid - lo == hi - mid:
        _swap_blocks(x, lo, mid, mid - lo, chunk)
        return
    _reverse(x, lo, mid, chunk)
    _reverse(x, mid, hi, chunk)
    _reverse(x, lo, hi, chunk)


def _interleave(x: torch.Tensor, lo: int, n: int, chunk: int) -> None:
    """``x[lo:lo+2n] = [b(n) | r(n)]`` -> ``[r0 b0 r1 b1 ...]``."""
    if n <= chunk:
        seg = x[lo : lo + 2 * n]
        tmp = seg.clone()
        pairs = seg.view(n, 2)
        pairs[:, 0] = tmp[n:]
        pairs[:, 1] = tmp[:n]
        return
    k = n // 2  # [b[:k] | b[k:] | r[:k] | r[k:]] -> [b[:k] | r[:k] | b[k:] | r[k:]]
    _rotate(x, lo + k, lo + n, lo + n + k, chunk)
    _interleave(x, lo, k, chunk)
    _interleave(x, lo + 2 * k, n - k, chunk)


def _deinterleave(x: torch.Tensor, lo: int, n: int, chunk: int) -> None:
    """Inverse of :func:`_interleave`."""
    if n <= chunk:
        seg = x[lo : lo + 2 * n]
        tmp = seg.clone().view(n, 2)
        seg[:n] = tmp[:, 1]
        seg[n:] = tmp[:, 0]
        return
    k = n // 2
    _deinterleave(x, lo, k, chunk)
    _deinterleave(x, lo + 2 * k, n - k, chunk)
    _rotate(x, lo + k, lo + 2 * k, lo + n + k, chunk)


# ---------------------------------------------------------------- public in-place API


def _check_buf(buf: torch.Tensor) -> int:
    if buf.dtype != torch.int16 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() % 2:
        raise ValueError(f"expected a contiguous 1-D int16 buffer of even length, got {buf.dtype} {tuple(buf.shape)}")
    return buf.numel() // 2


def to_fp32(buf: torch.Tensor, side: Ties, chunk: int = DEFAULT_CHUNK) -> None:
    """Split layout -> the exact fp32 master, in place (``buf.view(torch.float32)``)."""
    n = _check_buf(buf)
    _interleave(buf, 0, n, chunk)
    for start in range(0, n, chunk):
        _decode_range(buf, start, min(n, start + chunk), side)


def to_split(buf: torch.Tensor, side: Ties, chunk: int = DEFAULT_CHUNK) -> None:
    """fp32 master -> split layout (bf16 weights then residuals), in place; ``side`` gets the ties."""
    n = _check_buf(buf)
    side.clear()
    for start in range(0, n, chunk):
        _encode_range(buf, start, min(n, start + chunk), side)
    side.commit()
    _deinterleave(buf, 0, n, chunk)


def new_buffer(weight: torch.Tensor) -> torch.Tensor:
    """A split-layout buffer for bf16 ``weight`` whose master is exactly ``weight`` (residuals 0)."""
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"new_buffer needs a bf16 tensor, got {weight.dtype}")
    n = weight.numel()
    buf = torch.zeros(2 * n, dtype=torch.int16, device=weight.device)
    buf[:n].copy_(weight.detach().reshape(-1).view(torch.int16))
    return buf


def bf16_view(buf: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The model weight: a contiguous bf16 view of the buffer's first half."""
    return buf[: buf.numel() // 2].view(torch.bfloat16).view(shape)


def fp32_view(buf: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The master: the whole buffer as fp32 (meaningful only in the fp32 layout)."""
    return buf.view(torch.float32).view(shape)


def decode_split(
    buf: torch.Tensor, start: int, stop: int, side: Ties, out: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """The exact masters of elements ``[start, stop)`` of a split-layout buffer into fp32 ``out``
    (times ``scale``, one fp32 multiply, when given)."""
    n = buf.numel() // 2
    return side.decode(buf[start:stop], buf[n + start : n + stop], start, out, scale)


def encode_split(buf: torch.Tensor, start: int, stop: int, master: torch.Tensor, side: Ties) -> None:
    """fp32 ``master`` -> bf16 weights and residuals of elements ``[start, stop)`` of a split-layout
    buffer; ``side`` records the range's ties (current after ``side.commit()``)."""
    n = buf.numel() // 2
    side.encode(master, buf[start:stop], buf[n + start : n + stop], start)


def master_copy(buf: torch.Tensor, side: Ties, shape: torch.Size, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """A new fp32 tensor equal to the master of a split-layout buffer (for checkpoints)."""
    n = _check_buf(buf)
    out = torch.empty(n, dtype=torch.float32, device=buf.device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        decode_split(buf, start, stop, side, out[start:stop])
    return out.view(shape)


__all__ = [
    "CUDA_BATCH",
    "CUDA_CHUNK",
    "DEFAULT_CHUNK",
    "TIE",
    "BitTies",
    "SparseTies",
    "Ties",
    "batch_for",
    "bf16_view",
    "chunk_for",
    "decode_split",
    "encode_split",
    "fp32_view",
    "join_reference",
    "master_copy",
    "new_buffer",
    "new_ties",
    "split_reference",
    "to_fp32",
    "to_split",
]
