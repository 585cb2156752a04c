"""The ``cuda`` backend of the bf16/fp32 tie bitmask (``kernels/bf16_ties.py``): one Triton kernel
to decode a range of a shared buffer into exact fp32 masters, one to encode them back.

Why hand-written Triton: the eager bitmask ops are ~10 elementwise kernels per range moving
about 5x the bytes; each of these reads and writes every element once. Integer ops only (the
rounding is the same ``(u + 0x7FFF + lsb) >> 16`` on the bit pattern as the eager ops), so the
results are bitwise the eager ops' by construction; ``bf16_ties`` still checks that once per
device on crafted patterns before the first use and runs the eager ops, saying why, on any
error or difference. No data-dependent shape, no host sync: a launch is asynchronous and its
grid comes from the tensors' sizes. ``n`` and the bit offset are not specialized, so a kernel
compiles once per pointer alignment class, not per size.

With ``TRITON_INTERPRET=1`` set before triton is imported they run on CPU tensors in Triton's
interpreter (how ``tests/kernels`` checks them on a host without a GPU).
Ranges: ``weights``/``residual``/``out``/``master`` are contiguous and do not overlap each other
(``bf16_ties`` stages through a copy where they would); ``bits`` is the whole bitmask and
``start`` the range's first bit; bits of the first and last bytes outside the range are kept.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every CUDA build of torch ships triton
    triton = None

DECODE_BLOCK = 1024  # elements per program
ENCODE_ROWS = 128  # bytes of the bitmask (8 elements each) per program


def unavailable() -> str | None:
    """Why the kernels cannot run here, or None."""
    return "triton is not installed" if triton is None else None


if triton is not None:

    @triton.jit(do_not_specialize=["n", "start"])
    def _decode_kernel(w_ptr, r_ptr, bits_ptr, out_ptr, n, start, scale, SCALED: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        w = tl.load(w_ptr + offs, mask=live, other=0).to(tl.int32)
        r = tl.load(r_ptr + offs, mask=live, other=0).to(tl.int32)
        k = offs + start
        byte = tl.load(bits_ptr + k // 8, mask=live, other=0).to(tl.int32)
        tie = (byte >> (k % 8).to(tl.int32)) & 1
        m = ((w << 16) + r + (tie << 15)).to(tl.float32, bitcast=True)
        if SCALED:  # one fp32 multiply, as torch's AdamW makes it (its weight decay)
            m = m * scale
        tl.store(out_ptr + offs, m, mask=live)

    @triton.jit(do_not_specialize=["n", "start", "nbytes"])
    def _encode_kernel(m_ptr, w_ptr, r_ptr, bits_ptr, n, start, nbytes, ROWS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * ROWS + tl.arange(0, ROWS)  # bytes of the range's window of the bitmask
        cols = tl.arange(0, 8)
        elem = rows[:, None] * 8 + cols[None, :] - start % 8  # element index within the range
        live = (elem >= 0) & (elem < n)
        u = tl.load(m_ptr + elem, mask=live, other=0)  # the fp32 bit patterns as int32
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        safe = tl.where(nan, 0, u)
        b = (safe + 0x7FFF + ((safe >> 16) & 1)) >> 16  # no overflow: see bf16_ties.split_bits
        d = safe - (b << 16)
        tie = d == 32768
        d = tl.where(tie, 0, d)
        b = tl.where(nan, (u >> 16) | 0x40, b)
        tl.store(w_ptr + elem, b.to(tl.int16), mask=live)
        tl.store(r_ptr + elem, d.to(tl.int16), mask=live)
        flags = tl.sum(tl.where(live & tie, 1, 0) << cols[None, :], axis=1)
        keep = tl.sum(tl.where(live, 0, 1) << cols[None, :], axis=1)  # bits of other ranges
        in_window = rows < nbytes
        old = tl.load(bits_ptr + rows, mask=in_window & (keep != 0), other=0).to(tl.int32)
        tl.store(bits_ptr + rows, ((old & keep) | flags).to(tl.uint8), mask=in_window)


def decode(
    weights: torch.Tensor,
    residual: torch.Tensor,
    bits: torch.Tensor,
    start: int,
    out: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact fp32 masters of a range into ``out``: ``(b << 16) + r + (bit << 15)``, times ``scale``
    (an fp32 multiply; Triton passes a Python float as fp32, rounded as torch's scalar is) if given."""
    n = weights.numel()
    if n:
        grid = (triton.cdiv(n, DECODE_BLOCK),)
        scaled = scale is not None
        _decode_kernel[grid](
            weights, residual, bits, out, n, start, scale if scaled else 1.0, SCALED=scaled, BLOCK=DECODE_BLOCK
        )
    return out


def encode(master: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, bits: torch.Tensor, start: int) -> None:
    """bf16 bits, residuals and tie bits of a range of fp32 masters."""
    n = master.numel()
    if n:
        first = start // 8
        nbytes = (start + n + 7) // 8 - first
        grid = (triton.cdiv(nbytes, ENCODE_ROWS),)
        window = bits[first:]
        _encode_kernel[grid](master.view(torch.int32), weights, residual, window, n, start, nbytes, ROWS=ENCODE_ROWS)
