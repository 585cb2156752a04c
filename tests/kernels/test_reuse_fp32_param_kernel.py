"""The bf16 + residual conversion kernel (``mindspeed_like.kernels.bf16_residual``) on crafted
bit patterns: exactness is bitwise, so every comparison here is ``torch.equal`` on integer
views (no tolerance: a single flipped bit is a failure).

Crafted patterns: every one of the 65,536 low halves under high halves that are even and odd,
positive and negative, +-0, subnormal, the largest finite values (which round up to +-inf),
values just below a binade boundary (which round up into the next binade), +-inf and NaN.
The whole fp32 space (2^32 patterns) runs as a slow test.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.kernels import bf16_residual as K
from mindspeed_like.kernels.bf16_ties import unpack
from mindspeed_like.testing.bf16_patterns import hard_masters
from mindspeed_like.testing.workspace import peak_extra_bytes

HIGH_HALVES = [
    0x0000,  # +0 / positive subnormals
    0x0001,  # odd, subnormal
    0x007F,  # largest subnormal high half: rounds up to the smallest normal
    0x0080,  # smallest normal
    0x3F7F,  # just below 1.0: rounds up into the next binade
    0x3F80,  # 1.0 (even)
    0x3F81,  # odd
    0x7F7F,  # largest finite high half: rounds up to +inf
    0x8000,  # -0 / negative subnormals
    0x8001,  # negative odd subnormal
    0xBF7F,  # just above -1.0 in magnitude order: rounds to -1.0
    0xBF80,  # -1.0
    0xC2AB,  # negative odd
    0xFF7F,  # most negative finite: rounds to -inf
]


def _patterns(highs: list[int]) -> torch.Tensor:
    """fp32 tensor of every (high, low) combination for the given high halves."""
    low = torch.arange(65536, dtype=torch.int64)
    return _as_fp32(torch.cat([(h << 16) + low for h in highs]))


def _as_fp32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns (int64) -> fp32 with those bits."""
    return (words - (words >= 1 << 31).to(torch.int64) * (1 << 32)).to(torch.int32).view(torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.fixture(scope="module")
def crafted() -> torch.Tensor:
    return _patterns(HIGH_HALVES)


def test_reference_bf16_is_torchs_cast_and_join_is_exact(crafted):
    b, r, side = K.split_reference(crafted)
    assert torch.equal(_bits(b), _bits(crafted.to(torch.bfloat16)))  # the model weight megatron would hold
    assert torch.equal(_bits(K.join_reference(b, r, side)), _bits(crafted))


def test_ties_go_to_even_and_only_round_down_ties_use_the_side_table(crafted):
    words = crafted.view(torch.int32)
    b, r, side = K.split_reference(crafted)
    low = words & 0xFFFF
    high = (words >> 16) & 0xFFFF
    ties = low == 0x8000
    even = (high & 1) == 0
    # every tie: bf16 is even (RNE); an even high half stays (d = +32768: side table),
    # an odd one rounds up (d = -32768: fits the int16 residual)
    assert torch.all((_bits(b)[ties] & 1) == 0)
    expected_side = torch.nonzero(ties & even).flatten()
    assert torch.equal(side, expected_side)
    assert len(side) == sum(1 for h in HIGH_HALVES if h % 2 == 0)  # one round-down tie per even high half
    assert torch.all(r[ties & ~even] == -32768)


def test_special_values():
    values = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, 1.0 + 2**-8],
        dtype=torch.float32,
    )
    b, r, side = K.split_reference(values)
    assert torch.equal(_bits(K.join_reference(b, r, side)), _bits(values))  # +-0 keep their sign, +-inf exact
    assert torch.isinf(b[6:8].float()).all()  # the largest finite values round to +-inf ...
    assert torch.equal(_bits(K.join_reference(b, r, side))[6:8], _bits(values)[6:8])  # ... and come back exact


def test_nan_stays_nan():
    values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32)
    values.view(torch.int32)[0] = 0x7FC00001  # quiet NaN with payload
    values.view(torch.int32)[1] = -0x00000001  # 0xFFFFFFFF: negative NaN
    b, r, side = K.split_reference(values)
    back = K.join_reference(b, r, side)
    assert torch.isnan(back[:2]).all() and torch.isnan(b[:2].float()).all()
    assert back[2] == 3.0
    buf = values.clone().view(torch.int16)
    side = K.SparseTies(buf.device)
    K.to_split(buf, side, chunk=2)
    K.to_fp32(buf, side, chunk=2)
    assert torch.isnan(buf.view(torch.float32)[:2]).all() and buf.view(torch.float32)[2] == 3.0


def _new_side(kind: str, n: int) -> K.Ties:
    return K.SparseTies(torch.device("cpu")) if kind == "sparse" else K.BitTies(n, torch.device("cpu"))


def _tie_flags(side: K.Ties, n: int) -> torch.Tensor:
    """Which elements are ties (bool), from either representation."""
    if isinstance(side, K.SparseTies):
        flags = torch.zeros(n, dtype=torch.bool)
        flags[side.indices] = True
        return flags
    return unpack(side.bits, 0, n).bool()


@pytest.mark.parametrize("kind", ["sparse", "bits"])
@pytest.mark.parametrize("chunk", [1, 3, 64, 4096, K.DEFAULT_CHUNK])
def test_in_place_layouts_match_reference(crafted, chunk, kind):
    # odd lengths exercise the rotations, tiny chunks the recursion
    small = chunk <= 64
    sizes = [1, 2, 3, 7, 100, 255] + [1001] * (chunk >= 3) + [4099] * (chunk >= 64)  # chunk 1: deep recursion
    for n in sizes if small else [crafted.numel(), crafted.numel() - 5]:
        master = crafted[:n]
        if small:
            master = crafted[torch.randperm(crafted.numel(), generator=torch.Generator().manual_seed(n))[:n]]
        buf = master.clone().view(torch.int16)
        side = _new_side(kind, n)
        K.to_split(buf, side, chunk)
        b, r, ref_side = K.split_reference(master)
        nan = torch.isnan(master)
        assert torch.equal(buf[:n][~nan], _bits(b)[~nan]), (n, chunk)  # split layout: contiguous bf16 weights ...
        assert torch.isnan(buf[:n][nan].view(torch.bfloat16).float()).all()
        assert torch.equal(buf[n:], r), (n, chunk)  # ... then residuals
        assert torch.equal(_tie_flags(side, n).nonzero().flatten(), ref_side)
        copy = K.master_copy(buf, side, master.shape, chunk)
        assert torch.equal(_bits(copy)[~nan], _bits(master)[~nan]) and torch.isnan(copy[nan]).all()
        K.to_fp32(buf, side, chunk)
        back = buf.view(torch.float32)
        assert torch.equal(_bits(back)[~nan], _bits(master)[~nan]), (n, chunk)
        assert torch.isnan(back[nan]).all()


def test_views_share_one_storage():
    weight = torch.randn(5, 7).to(torch.bfloat16)
    buf = K.new_buffer(weight)
    view = K.bf16_view(buf, weight.shape)
    master = K.fp32_view(buf, weight.shape)
    assert view.is_contiguous() and view.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
    assert buf.untyped_storage().nbytes() == 4 * weight.numel()
    assert torch.equal(_bits(view), _bits(weight))
    K.to_fp32(buf, K.SparseTies(buf.device))
    assert torch.equal(master, weight.float())  # a fresh buffer's master is the bf16 weight exactly


def test_bad_buffers_are_rejected():
    with pytest.raises(ValueError, match="int16 buffer of even length"):
        K.to_split(torch.zeros(3, dtype=torch.int16), K.SparseTies(torch.device("cpu")))
    with pytest.raises(TypeError, match="bf16"):
        K.new_buffer(torch.zeros(3))
    with pytest.raises(TypeError, match="fp32"):
        K.split_reference(torch.zeros(3, dtype=torch.float64))


def test_workspace_is_bounded_by_the_chunk():
    """Peak extra bytes allocated by an in-place conversion (profiler memory events) stay
    O(chunk), independent of the buffer's size."""
    chunk = 1 << 10
    peaks = []
    for n in (1 << 12, 1 << 16):
        buf = torch.randn(n).view(torch.int16)
        side = K.SparseTies(buf.device)
        K.to_split(buf, side, chunk)
        peaks.append(peak_extra_bytes(lambda buf=buf, side=side: K.to_fp32(buf, side, chunk)))
        peaks.append(peak_extra_bytes(lambda buf=buf, side=side: K.to_split(buf, side, chunk)))
    # int64 temporaries of one chunk (~26 B/element of a chunk), never a buffer-sized copy
    # (the 2^16-element buffer is 256 KiB; 32 B * 1024 = 32 KiB)
    assert max(peaks) <= 32 * chunk, peaks
    assert 0 < min(peaks)


@pytest.mark.slow
def test_every_fp32_pattern_round_trips():
    """All 2^32 bit patterns in 2^24-element slices: bf16 equals torch's cast, join is exact
    (NaNs: stay NaN)."""
    step = 1 << 24
    base = torch.arange(step, dtype=torch.int64)
    for start in range(0, 1 << 32, step):
        master = _as_fp32(base + start)
        b, r, side = K.split_reference(master)
        assert torch.equal(_bits(b), _bits(master.to(torch.bfloat16)))
        back = K.join_reference(b, r, side)
        nan = torch.isnan(master)
        assert torch.equal(_bits(back)[~nan], _bits(master)[~nan])
        assert torch.isnan(back[nan]).all()


# ---------------------------------------------------------------- the tie bitmask (cuda backend)


@pytest.mark.parametrize("n", [1, 7, 8, 1001, 4099])
def test_bit_ties_ranges_match_reference(n):
    """Encode and decode in ranges with unaligned starts (bits of a byte shared by two ranges are
    merged, never lost): weights are torch's cast, residuals and ties the reference's, decoding is
    exact; NaN stays NaN."""
    master = hard_masters(n, seed=n)
    b, r, ref_side = K.split_reference(master)
    nan = torch.isnan(master)
    buf = K.new_buffer(torch.zeros(n, dtype=torch.bfloat16))
    side = K.BitTies(n, buf.device)
    cuts = sorted({0, n, *torch.randint(0, n + 1, (5,), generator=torch.Generator().manual_seed(1)).tolist()})
    for a, z in zip(cuts, cuts[1:]):
        K.encode_split(buf, a, z, master[a:z], side)
    side.commit()
    assert torch.equal(buf[:n][~nan], _bits(b)[~nan])
    assert torch.isnan(buf[:n][nan].view(torch.bfloat16).float()).all()
    assert torch.equal(buf[n:], r)
    assert torch.equal(unpack(side.bits, 0, n).nonzero().flatten(), ref_side)
    assert side.count() == ref_side.numel() and side.nbytes() == (n + 7) // 8
    out = torch.full((n,), 7.0)
    for a, z in zip(cuts, cuts[1:]):
        K.decode_split(buf, a, z, side, out[a:z])
    assert torch.equal(_bits(out)[~nan], _bits(master)[~nan]) and torch.isnan(out[nan]).all()


def test_bit_ties_encode_is_safe_in_place():
    """``master`` overlapping the outputs (the in-place layouts, the DistributedOptimizer's scratch)
    reads every element before writing it."""
    n = 1000
    master = hard_masters(n, seed=3)
    words = master.clone().view(torch.int16)
    pairs = words.view(-1, 2)
    side = K.BitTies(n, words.device)
    side.encode(words.view(torch.float32), pairs[:, 1], pairs[:, 0], 0)
    b, r, ref_side = K.split_reference(master)
    nan = torch.isnan(master)
    assert torch.equal(pairs[:, 1][~nan], _bits(b)[~nan]) and torch.equal(pairs[:, 0], r)
    side.decode(pairs[:, 1], pairs[:, 0], 0, words.view(torch.float32))
    assert torch.equal(words.view(torch.int32)[~nan], _bits(master)[~nan])


def test_backend_picks_the_tie_record_and_chunk():
    from mindspeed_like.kernels.backend import force_backend

    buf = torch.zeros(16, dtype=torch.int16)
    assert isinstance(K.new_ties(8, buf), K.SparseTies) and K.chunk_for(buf) == K.DEFAULT_CHUNK
    assert K.batch_for(buf) == K.DEFAULT_CHUNK
    with force_backend("cuda"):
        assert isinstance(K.new_ties(8, buf), K.BitTies) and K.chunk_for(buf) == K.CUDA_CHUNK
        assert K.batch_for(buf) == K.CUDA_BATCH


def test_triton_kernels_match_the_eager_ops_and_the_reference():
    """The kernels the cuda backend runs, in Triton's interpreter on CPU tensors (a fresh process:
    the interpreter must be chosen before triton is imported): bitwise the eager bitmask ops on
    crafted patterns (aligned and unaligned ranges, bits merged into partly used bytes), and the
    reference on random data with every hard case. Script: ``bf16_ties_interpreted.py``."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = pathlib.Path(__file__).with_name("bf16_ties_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("interpreted kernels: bitwise the eager ops and the reference"), done.stdout


def test_kernel_check_falls_back_once_on_a_wrong_kernel(monkeypatch, caplog):
    """Before first use on a device the kernels are compared with the eager ops; a kernel that
    differs (or raises) is not used, said once, and the eager ops serve that device."""
    import logging

    from mindspeed_like.kernels import bf16_ties
    from mindspeed_like.kernels.backends import cuda_bf16_residual as cuda

    monkeypatch.setattr(cuda, "unavailable", lambda: None)
    monkeypatch.setattr(cuda, "decode", bf16_ties.decode_eager)
    monkeypatch.setattr(cuda, "encode", bf16_ties.encode_eager)
    device = torch.device("cpu")
    assert bf16_ties._kernels_work(device)  # the eager ops standing in: identical

    def off_by_one(master, weights, residual, bits, start):
        bf16_ties.encode_eager(master, weights, residual, bits, start)
        residual[-1] += 1

    monkeypatch.setattr(cuda, "encode", off_by_one)
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        assert not bf16_ties._kernels_work(device)
    assert "results differ" in caplog.text and "eager torch ops" in caplog.text
    monkeypatch.setattr(cuda, "decode", lambda *args: 1 / 0)
    assert not bf16_ties._kernels_work(device)
    assert "ZeroDivisionError" in caplog.text
