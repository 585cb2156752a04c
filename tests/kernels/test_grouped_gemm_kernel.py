"""Grouped GEMM kernel (``mindspeed_like.kernels.grouped_gemm.gmm``): every backend vs a float64
reference per expert, forward and both gradients, and the torch_npu emulator's contract.

Tolerances (against float64 of the same inputs; inputs ~N(0,1), so a dot product of length K
has magnitude ~sqrt(K)):
- fp32: rtol 1e-5, atol 1e-5 * sqrt(K): one matmul, fp32 accumulation (2^-24 per step) over
  at most K (or the expert's token count, for dB) terms.
- bf16: rtol 2e-2, atol 2e-2 * sqrt(K): inputs are bf16 (exact in float64), products are
  accumulated in fp32 by the CPU kernels and rounded once to bf16 (2^-8 relative).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from mindspeed_like.kernels import grouped_gemm as gg
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.kernels.grouped_gemm import gmm, main_grad_owner
from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu

DTYPES = [torch.float32, torch.bfloat16]
# (name, counts, K, N): imbalanced with zero-token experts, all tokens on one expert, a single
# expert, odd sizes (not 16-byte aligned: the per-expert loop), and E = 128 Zipf-like.
COUNTS = [
    ("imbalanced_zeros", [7, 0, 19, 0, 1, 33, 0, 4], 32, 48),
    ("all_on_one", [0, 0, 40, 0], 16, 24),
    ("single_expert", [21], 8, 16),
    ("odd_sizes", [3, 0, 5, 11], 13, 7),
    ("e128", [int(300 / (i + 1)) % 9 for i in range(128)], 16, 8),
]
ENGINES = [("portable", None), ("portable", "loop"), ("reference", None), ("npu", None)]


def _tol(dtype, k):
    base = 1e-5 if dtype == torch.float32 else 2e-2
    return dict(rtol=base, atol=base * math.sqrt(k))


def _inputs(counts, k, n, dtype, trans_b, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(counts), k, generator=gen).to(dtype).requires_grad_(True)
    shape = (len(counts), n, k) if trans_b else (len(counts), k, n)
    b = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
    grad = torch.randn(sum(counts), n, generator=gen).to(dtype)
    return a, b, grad


def _reference64(a, b, counts, grad, trans_b):
    """Per-expert float64 math, written independently of the kernel module."""
    a64, b64, g64 = a.detach().double(), b.detach().double(), grad.double()
    out, da, db = (
        torch.zeros(a.shape[0], grad.shape[1], dtype=torch.float64),
        torch.zeros_like(a64),
        torch.zeros_like(b64),
    )
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        w = b64[e].t() if trans_b else b64[e]  # [K, N]
        out[rows] = a64[rows] @ w
        da[rows] = g64[rows] @ w.t()
        dw = a64[rows].t() @ g64[rows]  # [K, N]
        db[e] = dw.t() if trans_b else dw
        start += count
    return out, da, db


def _run(backend, engine, a, b, counts, grad, trans_b):
    with emulated_torch_npu() as npu, force_backend(backend):
        out = gmm(a, b, torch.tensor(counts), trans_b, engine=engine)
        out.backward(grad)
    assert npu.calls["npu_grouped_matmul"] == (3 if backend == "npu" else 0)  # forward, dA, dB
    return out


@pytest.mark.parametrize("backend,engine", ENGINES, ids=[f"{b}-{e or 'auto'}" for b, e in ENGINES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("case", COUNTS, ids=[c[0] for c in COUNTS])
def test_gmm_matches_float64(backend, engine, dtype, trans_b, case):
    name, counts, k, n = case
    a, b, grad = _inputs(
        counts, k, n, dtype, trans_b, zlib.crc32(repr((backend, engine, dtype, trans_b, name)).encode())
    )
    out = _run(backend, engine, a, b, counts, grad, trans_b)
    ref, da, db = _reference64(a, b, counts, grad, trans_b)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, **_tol(dtype, k))
    torch.testing.assert_close(a.grad.double(), da, **_tol(dtype, n))
    torch.testing.assert_close(b.grad.double(), db, **_tol(dtype, max(counts)))
    for e, count in enumerate(counts):
        if count == 0:  # zero-token experts: exactly zero weight gradient
            assert torch.count_nonzero(b.grad[e]) == 0


def test_portable_engine_choice():
    """torch._grouped_mm (probed to work on this torch for 16-byte aligned fp32/bf16 rows) is
    chosen where it applies; odd sizes and fp16 take the per-expert loop."""
    assert hasattr(torch, "_grouped_mm")
    aligned = torch.randn(8, 16), torch.randn(2, 16, 8)
    assert gg._grouped_mm_ok(*aligned)
    assert not gg._grouped_mm_ok(torch.randn(8, 13), torch.randn(2, 13, 8))
    assert not gg._grouped_mm_ok(torch.randn(8, 16).half(), torch.randn(2, 16, 8).half())
    with pytest.raises(ValueError, match="_grouped_mm does not support"):
        gmm(torch.randn(8, 13), torch.randn(2, 13, 8), [4, 4], engine="grouped_mm")
    a = torch.randn(8, 16).half()
    out = gmm(a, torch.randn(2, 16, 8).half(), [5, 3])  # fp16 works through the loop
    assert out.dtype == torch.float16 and out.shape == (8, 8)


def test_forward_allocates_only_the_output():
    """The portable loop writes every expert's rows into one buffer: no per-expert outputs, no cat."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.cat.default):
                self.bytes += out.nbytes
            return out

    a, b = torch.randn(96, 32), torch.randn(6, 32, 40)
    with Allocs() as allocs:
        gmm(a, b, [10, 0, 30, 6, 0, 50], engine="loop")
    assert allocs.bytes == 96 * 40 * 4


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.randn(4, 8), torch.randn(2, 8, 3), [2, 1]), "summing to"),
        ((torch.randn(4, 8), torch.randn(2, 8, 3), [5, -1]), "non-negative"),
        ((torch.randn(4, 8), torch.randn(2, 8, 3), [4]), "one count per expert"),
        ((torch.randn(4, 8), torch.randn(2, 3, 8), [2, 2]), "trans_b=True"),
        ((torch.randn(4, 8), torch.randn(2, 8, 3).double(), [2, 2]), "share a dtype"),
        ((torch.randn(4, 8), torch.randn(8, 3), [4]), r"\[experts, K, N\]"),
        ((torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([2.0, 2.0])), "integer tensor"),
    ],
)
def test_bad_input_explains(args, match):
    with pytest.raises(ValueError, match=match):
        gmm(*args)


# ---------------------------------------------------------------- main_grad accumulation


@pytest.mark.parametrize("backend", ["portable", "npu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_accumulates_into_main_grad(backend, dtype):
    """megatron's gradient-accumulation-fusion contract, as DDP sets a parameter up: the weight
    gradient is ADDED to the fp32 main_grad, grad_added_to_main_grad is set, and DDP's hook then
    ignores the dummy .grad."""
    counts = [6, 0, 9]
    weight = torch.nn.Parameter(torch.randn(16, 3 * 8).to(dtype))  # GroupedMLP's flat weight1
    weight.main_grad = torch.randn(16, 3 * 8)  # previous micro-batches
    weight.grad_added_to_main_grad = False
    before = weight.main_grad.clone()
    a = torch.randn(15, 16).to(dtype).requires_grad_(True)
    grad = torch.randn(15, 8).to(dtype)
    b = weight.view(3, 16, 8)
    assert main_grad_owner(b) is weight
    with emulated_torch_npu(), force_backend(backend):
        gmm(a, b, counts, accumulate_into=weight).backward(grad)
    _, da, db = _reference64(a, b, counts, grad, False)
    torch.testing.assert_close(weight.main_grad.double(), before.double() + db.reshape(16, 24), **_tol(dtype, 9))
    torch.testing.assert_close(a.grad.double(), da, **_tol(dtype, 8))
    assert weight.grad_added_to_main_grad is True
    assert weight.grad is not None and weight.grad.shape == weight.shape  # the dummy DDP's hook skips


def test_main_grad_owner_needs_a_full_view():
    weight = torch.nn.Parameter(torch.randn(4, 6))
    assert main_grad_owner(weight.view(2, 4, 3)) is None  # no main_grad yet
    weight.main_grad = torch.zeros(4, 6)
    assert main_grad_owner(weight.view(2, 4, 3)) is weight
    assert main_grad_owner(weight[:2].view(1, 2, 6)) is None  # a partial view is not the parameter


# ---------------------------------------------------------------- the emulator's contract


def _record(npu):
    calls = []
    real = npu.npu_grouped_matmul

    def spy(*args, **kwargs):
        calls.append((tuple(args[0][0].shape), tuple(args[1][0].shape), dict(kwargs)))
        return real(*args, **kwargs)

    npu.npu_grouped_matmul = spy
    return calls


def test_npu_calls_follow_the_documented_form():
    counts = [3, 0, 5]
    a = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(3, 4, 6, requires_grad=True)
    with emulated_torch_npu() as npu, force_backend("npu"):
        calls = _record(npu)
        gmm(a, b, torch.tensor(counts)).backward(torch.randn(8, 6))
    (fwd_x, fwd_w, fwd), (dx_x, dx_w, dx), (dw_x, dw_w, dw) = calls
    for kwargs in (fwd, dx, dw):
        assert kwargs["group_list"].dtype == torch.int64
        assert kwargs["group_list"].tolist() == [3, 3, 8]  # cumulative, not the counts
        assert kwargs["group_list_type"] == 0 and kwargs["bias"] is None
    assert (fwd_x, fwd_w, fwd["group_type"], fwd["split_item"]) == ((8, 4), (3, 4, 6), 0, 2)
    assert (dx_x, dx_w, dx["group_type"]) == ((8, 6), (3, 6, 4), 0)  # dX via the transposed weights
    assert (dw_x, dw_w, dw["group_type"], dw["split_item"]) == ((4, 8), (8, 6), 2, 3)  # dW along K


def _good():
    return [torch.randn(8, 4)], [torch.randn(3, 4, 6)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(group_list=torch.tensor([3, 0, 5]), group_list_type=0, group_type=0, split_item=2),  # counts as cumsum
        dict(group_list=torch.tensor([3, 3, 8], dtype=torch.int32), group_list_type=0, group_type=0, split_item=2),
        dict(group_list=torch.tensor([3, 3, 7]), group_list_type=0, group_type=0, split_item=2),  # not ending at M
        dict(group_list=torch.tensor([3, 8]), group_list_type=0, group_type=0, split_item=2),  # 2 groups, 3 weights
        dict(group_list=torch.tensor([3, 3, 8]), group_list_type=0, group_type=1, split_item=2),  # group_type
        dict(group_list=torch.tensor([3, 3, 8]), group_list_type=0, group_type=0, split_item=0),  # many outputs
        dict(group_list=torch.tensor([3, 3, 8]), group_list_type=2, group_type=0, split_item=2),
        dict(group_list=torch.tensor([3, 3, 8]), group_list_type=0, group_type=0, split_item=2, bias=[torch.zeros(6)]),
        dict(group_list=torch.tensor([3, 3, 8]), group_list_type=0, group_type=0, split_item=2, transpose=True),
    ],
)
def test_emulator_rejects_wrong_calls(kwargs):
    x, w = _good()
    with emulated_torch_npu() as npu, pytest.raises(ContractError):
        npu.npu_grouped_matmul(x, w, **kwargs)


def test_emulator_rejects_wrong_structure():
    x, w = _good()
    ok = dict(group_list=torch.tensor([3, 3, 8]), group_list_type=0, group_type=0, split_item=2)
    with emulated_torch_npu() as npu:
        with pytest.raises(ContractError):
            npu.npu_grouped_matmul(x[0], w, **ok)  # not a list
        with pytest.raises(ContractError):
            npu.npu_grouped_matmul(x, [w[0].double()], **ok)  # dtype mismatch
        with pytest.raises(ContractError):  # group_type 2 must return one stacked tensor
            npu.npu_grouped_matmul([x[0].t()], [torch.randn(8, 6)], **{**ok, "group_type": 2})
        with pytest.raises(ContractError):  # too many groups
            npu.npu_grouped_matmul(
                [torch.randn(2, 4)],
                [torch.randn(1025, 4, 2)],
                group_list=torch.full((1025,), 2),
                group_type=0,
                split_item=2,
            )


def test_emulator_documented_calls_and_no_autograd():
    x, w = _good()
    x[0].requires_grad_(True)
    with emulated_torch_npu() as npu:
        (y,) = npu.npu_grouped_matmul(
            x, w, group_list=torch.tensor([3, 3, 8]), group_list_type=0, group_type=0, split_item=2
        )
        (y1,) = npu.npu_grouped_matmul(
            x, w, group_list=torch.tensor([3, 0, 5]), group_list_type=1, group_type=0, split_item=3
        )
        (dw,) = npu.npu_grouped_matmul(
            [x[0].t()], [torch.ones(8, 6)], group_list=torch.tensor([3, 3, 8]), group_type=2, split_item=3
        )
    torch.testing.assert_close(y, torch.cat([x[0][:3] @ w[0][0], x[0][3:] @ w[0][2]]))
    torch.testing.assert_close(y1, y)
    assert y.grad_fn is None  # torch_npu has no autograd for this op: the caller writes the backward
    assert dw.shape == (3, 4, 6) and torch.count_nonzero(dw[1]) == 0


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16-kernels", "fp32-compute"])
@pytest.mark.parametrize("engine", [None, "loop"], ids=["auto", "loop"])
def test_bf16_fp32_compute_path(bf16_gemms, fp32, engine):
    """bf16 on a CPU without bf16 dot-product units runs each GEMM in fp32 on the upcast inputs and
    rounds once: within the bf16 tolerance of float64 like torch's bf16 kernels, and each result
    is exactly the fp32 GEMM rounded to bf16 (forward, dA, dB). Both paths are forced here,
    whatever this host's CPU has."""
    bf16_gemms("fp32" if fp32 else "native")
    counts, k, n = [24, 0, 40, 8], 32, 48
    a, b, grad = _inputs(counts, k, n, torch.bfloat16, True, 11)
    assert gg.fp32_compute(a) is fp32 and not gg.fp32_compute(a.float())
    out = gmm(a, b, counts, trans_b=True, engine=engine)
    out.backward(grad)
    ref, da, db = _reference64(a, b, counts, grad, True)
    torch.testing.assert_close(out.double(), ref, **_tol(torch.bfloat16, k))
    torch.testing.assert_close(a.grad.double(), da, **_tol(torch.bfloat16, n))
    torch.testing.assert_close(b.grad.double(), db, **_tol(torch.bfloat16, max(counts)))
    if fp32:
        pieces = torch.split(a.detach().float(), counts)
        grads = torch.split(grad.float(), counts)
        w = b.detach().float()
        assert torch.equal(out, torch.cat([p @ w[e].t() for e, p in enumerate(pieces)]).bfloat16())
        assert torch.equal(a.grad, torch.cat([g @ w[e] for e, g in enumerate(grads)]).bfloat16())
        for e in range(len(counts)):
            assert torch.equal(b.grad[e], (grads[e].t() @ pieces[e]).bfloat16())


def test_cpu_bf16_gemm_is_the_host_gemm_probes_decision(monkeypatch):
    """One decision per process, the upcast-cpu-gemm feature's: the GEMM speed probe (what this
    process's torch/oneDNN really run, ONEDNN_MAX_CPU_ISA included), not /proc/cpuinfo's flags."""
    from mindspeed_like.kernels import host_gemm

    for value, has_units in (("fp32", False), ("native", True)):
        monkeypatch.setenv(host_gemm.ENV, value)
        host_gemm.probe.cache_clear()
        assert gg.cpu_has_bf16_gemm() is has_units
        assert gg.fp32_compute(torch.empty(2, dtype=torch.bfloat16)) is not has_units
    monkeypatch.undo()
    host_gemm.probe.cache_clear()
    assert gg.cpu_has_bf16_gemm() is not host_gemm.probe().fp32_faster


def test_row_buckets_are_few_idempotent_and_tight():
    """Counts up to 2,000 run at 57 sizes; a bucket is its own bucket; at most 12.5% extra rows
    above the 16-row floor."""
    from mindspeed_like.kernels.row_buckets import MIN_ROWS, bucket

    sizes = {bucket(c) for c in range(1, 2001)}
    assert len(sizes) == 57
    for c in range(0, 5000):
        b = bucket(c)
        assert b >= c and bucket(b) == b
        if c > MIN_ROWS:
            assert b <= c * 1.125


@pytest.fixture
def bf16_gemms(monkeypatch):
    """``bf16_gemms(decision)``: this process's bf16 GEMM decision forced (``native``: a host with
    bf16 units, ``fp32``: one without), as kernels/host_gemm.py's probe would give it (the same on
    every host, the CPU-ISA lane's included); the probe is forgotten again after the test."""
    from mindspeed_like.kernels import host_gemm

    def force(decision: str) -> None:
        monkeypatch.setenv(host_gemm.ENV, decision)
        host_gemm.probe.cache_clear()

    yield force
    monkeypatch.undo()
    host_gemm.probe.cache_clear()


def test_no_row_buckets_where_bf16_gemms_run_in_fp32(bf16_gemms):
    """On a host whose bf16 GEMMs run in fp32 (MKL's sgemm: no per-shape kernels) the rows are not
    padded: the padding would be copies and FLOPs for nothing. With bf16 units they are."""
    from mindspeed_like.kernels.row_buckets import row_buckets

    a = torch.zeros(30, 8, dtype=torch.bfloat16)
    for decision, padded in (("fp32", False), ("native", True)):
        bf16_gemms(decision)
        assert (row_buckets(a, [13, 17]) is not None) is padded, decision
    assert row_buckets(a.float(), [13, 17]) is None  # fp32 keeps no per-shape state anywhere


@pytest.mark.parametrize("engine", ["grouped_mm", "loop"])
@pytest.mark.parametrize("fused", [False, True], ids=["dB", "main_grad"])
def test_cpu_bf16_rows_padded_to_buckets_bitwise(monkeypatch, bf16_gemms, engine, fused):
    """On a CPU with bf16 units the GEMMs run at bucketed row counts (oneDNN keeps state per
    shape); forward, dA and dB (or the main_grad accumulation) are bitwise the unpadded GEMMs',
    and every GEMM's row count is a bucket."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mindspeed_like.kernels.row_buckets import bucket

    bf16_gemms("native")
    counts, k, n = [37, 0, 130, 5, 20], 32, 48  # 192 rows: 16-byte aligned for torch._grouped_mm
    a, b, grad = _inputs(counts, k, n, torch.bfloat16, True, 5)
    param = torch.nn.Parameter(b.detach().clone())
    param.main_grad = torch.zeros(b.shape, dtype=torch.float32)

    class TokenRows(TorchDispatchMode):
        """The token rows each GEMM runs at: torch._grouped_mm's group sizes (from its offsets), or
        an mm's token dimension (its rows, or its contraction when the tokens are reduced over: a
        transposed left operand, as dB takes it)."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func == torch.ops.aten._grouped_mm.default:
                offs = kwargs.get("offs", args[2] if len(args) > 2 else None).tolist()
                self.rows += [end - start for start, end in zip([0, *offs], offs) if end > start]
            elif func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                left = args[0]
                self.rows.append(left.shape[0] if left.stride(-1) == 1 else left.shape[1])
            return func(*args, **kwargs)

    def run(pad: bool):
        monkeypatch.setattr(gg, "row_buckets", row_buckets if pad else (lambda t, c: None))
        x, w = a.detach().clone().requires_grad_(), (param if fused else b.detach().clone().requires_grad_())
        param.main_grad.zero_()
        with TokenRows() as seen:
            out = gmm(x, w, counts, trans_b=True, engine=engine, accumulate_into=param if fused else None)
            out.backward(grad)
        return (out, x.grad, (param.main_grad.clone() if fused else w.grad)), seen.rows

    row_buckets = gg.row_buckets
    padded, padded_rows = run(True)
    plain, plain_rows = run(False)
    for got, want in zip(padded, plain):
        assert torch.equal(got, want)
    # every GEMM ran at a bucketed token count; unpadded, the experts' own counts (37, 130, 5, 20) show
    assert padded_rows and all(r == bucket(r) for r in padded_rows), padded_rows
    assert any(r != bucket(r) for r in plain_rows), plain_rows
