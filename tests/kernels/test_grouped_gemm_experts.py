"""``gmm_experts``: the grouped GEMM over the experts' own weights (one 2-D parameter per expert, as
TE's ``GroupedLinear`` holds them), keeping no stacked copy of them for backward.

- against a float64 reference per expert (forward, dA, every expert's dW), tolerances as in
  test_grouped_gemm_kernel.py: fp32 rtol 1e-5, atol 1e-5 * sqrt(K); bf16 rtol 2e-2, atol 2e-2 * sqrt(K);
- bitwise against what the modules did before: ``gmm(a, torch.stack(weights), ...)`` (fp32 and bf16,
  both portable engines, the bf16 kernels and the fp32-compute path, the npu emulator, counts as a
  list or a tensor, experts without rows);
- what autograd keeps: ``a`` and the weights themselves, no new tensor of the weights' size;
- experts without rows: no GEMM, an exact zero gradient, their slot of a transient stack never read.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from mindspeed_like.kernels import grouped_gemm as gg
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.kernels.grouped_gemm import gmm, gmm_experts
from mindspeed_like.testing.npu_emulator import emulated_torch_npu
from mindspeed_like.testing.parity import saved_storages

DTYPES = [torch.float32, torch.bfloat16]
# (name, counts, K, N): zero-row experts, one expert with all rows (moe-alltoall-overlap's per-chunk
# call), a single expert, odd sizes (the per-expert loop), 16-byte aligned sizes (torch._grouped_mm)
COUNTS = [
    ("imbalanced_zeros", [7, 0, 19, 0, 1, 33, 0, 4], 32, 48),
    ("one_chunk", [0, 0, 40, 0], 16, 24),
    ("single_expert", [21], 8, 16),
    ("odd_sizes", [3, 0, 5, 11], 13, 7),
    ("no_rows", [0, 0, 0], 8, 16),
]
ENGINES = [("portable", None), ("portable", "loop"), ("reference", None), ("npu", None)]


def _tol(dtype, k):
    base = 1e-5 if dtype == torch.float32 else 2e-2
    return dict(rtol=base, atol=base * math.sqrt(max(k, 1)))


def _inputs(counts, k, n, dtype, trans_b, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(counts), k, generator=gen).to(dtype)
    shape = (n, k) if trans_b else (k, n)
    weights = [torch.randn(shape, generator=gen).to(dtype) for _ in counts]
    grad = torch.randn(sum(counts), n, generator=gen).to(dtype)
    return a, weights, grad


def _leaves(a, weights):
    return a.clone().requires_grad_(True), [torch.nn.Parameter(w.clone()) for w in weights]


def _reference64(a, weights, counts, grad, trans_b):
    """Per-expert float64 math, written independently of the kernel module."""
    out = torch.zeros(a.shape[0], grad.shape[1], dtype=torch.float64)
    da = torch.zeros(a.shape, dtype=torch.float64)
    dws = []
    start = 0
    for w, count in zip(weights, counts):
        rows = slice(start, start + count)
        w64 = w.double().t() if trans_b else w.double()  # [K, N]
        out[rows] = a[rows].double() @ w64
        da[rows] = grad[rows].double() @ w64.t()
        dw = a[rows].double().t() @ grad[rows].double()
        dws.append(dw.t() if trans_b else dw)
        start += count
    return out, da, dws


@pytest.mark.parametrize("backend,engine", ENGINES, ids=[f"{b}-{e or 'auto'}" for b, e in ENGINES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("case", COUNTS, ids=[c[0] for c in COUNTS])
def test_gmm_experts_matches_float64_and_the_stacked_gmm_bitwise(backend, engine, dtype, trans_b, case):
    name, counts, k, n = case
    a0, w0, grad = _inputs(counts, k, n, dtype, trans_b, zlib.crc32(repr((backend, dtype, trans_b, name)).encode()))
    with emulated_torch_npu(), force_backend(backend):
        a, weights = _leaves(a0, w0)
        out = gmm_experts(a, weights, torch.tensor(counts), trans_b, engine=engine)
        out.backward(grad)
        a_old, w_old = _leaves(a0, w0)  # what the modules ran before: a stacked copy of the weights
        out_old = gmm(a_old, torch.stack(w_old), counts, trans_b, engine=engine)
        out_old.backward(grad)
    ref, da, dws = _reference64(a0, w0, counts, grad, trans_b)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, **_tol(dtype, k))
    torch.testing.assert_close(a.grad.double(), da, **_tol(dtype, n))
    for w, dw, count in zip(weights, dws, counts):
        torch.testing.assert_close(w.grad.double(), dw, **_tol(dtype, count))
        if count == 0:
            assert torch.count_nonzero(w.grad) == 0  # exactly zero
    assert torch.equal(out, out_old) and torch.equal(a.grad, a_old.grad)
    for w, old in zip(weights, w_old):
        assert torch.equal(w.grad, old.grad)


@pytest.fixture
def bf16_gemms(monkeypatch):
    """This process's bf16 GEMM decision forced (kernels/host_gemm.py's probe), forgotten afterwards."""
    from mindspeed_like.kernels import host_gemm

    def force(decision: str) -> None:
        monkeypatch.setenv(host_gemm.ENV, decision)
        host_gemm.probe.cache_clear()

    yield force
    monkeypatch.undo()
    host_gemm.probe.cache_clear()


@pytest.mark.parametrize("decision", ["native", "fp32"], ids=["bf16-kernels-row-buckets", "fp32-compute"])
@pytest.mark.parametrize("engine", [None, "loop"], ids=["auto", "loop"])
def test_bf16_host_paths_are_bitwise_the_stacked_gmm(bf16_gemms, decision, engine):
    """bf16 on a host with bf16 units (rows padded to buckets) and without (GEMMs in fp32): the same
    numbers as the stacked path, both forced whatever this host has."""
    bf16_gemms(decision)
    counts, k, n = [37, 0, 130, 5, 20], 32, 48
    a0, w0, grad = _inputs(counts, k, n, torch.bfloat16, True, 3)
    a, weights = _leaves(a0, w0)
    gmm_experts(a, weights, counts, True, engine=engine).backward(grad)
    a_old, w_old = _leaves(a0, w0)
    gmm(a_old, torch.stack(w_old), counts, True, engine=engine).backward(grad)
    assert torch.equal(a.grad, a_old.grad)
    for w, old in zip(weights, w_old):
        assert torch.equal(w.grad, old.grad)


@pytest.mark.parametrize("engine", ["grouped_mm", "loop"])
def test_keeps_only_the_rows_and_the_weights_themselves(engine):
    """The saved set is ``a`` and the parameters' own storages; the stacked path keeps a new
    [E, N, K] tensor besides (E x N x K x 4 bytes here)."""
    counts, k, n = [0, 0, 40, 0], 16, 24
    a0, w0, grad = _inputs(counts, k, n, torch.float32, True, 7)
    a, weights = _leaves(a0, w0)
    own = {w.untyped_storage().data_ptr() for w in weights} | {a.untyped_storage().data_ptr()}
    out, kept = saved_storages(lambda: gmm_experts(a, weights, counts, True, engine=engine))
    assert set(kept) <= own and a.untyped_storage().data_ptr() in kept
    out.backward(grad)
    a_old, w_old = _leaves(a0, w0)
    old_own = {w.untyped_storage().data_ptr() for w in w_old} | {a_old.untyped_storage().data_ptr()}
    _, kept_old = saved_storages(lambda: gmm(a_old, torch.stack(w_old), counts, True, engine=engine))
    assert sum(b for p, b in kept_old.items() if p not in old_own) == len(counts) * n * k * 4


def test_experts_without_rows_cost_no_gemm_and_their_slots_are_not_read(monkeypatch):
    """One expert's rows (moe-alltoall-overlap's per-chunk call): the loop runs that expert's GEMMs
    only; torch._grouped_mm gets every expert's slot (the group count of the whole stack), the
    others left unwritten: filled with NaN here, the results are still finite and bitwise."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                self.calls += 1
            return func(*args, **(kwargs or {}))

    counts, k, n = [0, 0, 40, 0], 16, 24
    a0, w0, grad = _inputs(counts, k, n, torch.float32, True, 9)
    a, weights = _leaves(a0, w0)
    with Mms() as mms:
        gmm_experts(a, weights, counts, True, engine="loop").backward(grad)
    assert mms.calls == 3  # forward, dA, dW of expert 2
    assert all(torch.count_nonzero(w.grad) == 0 for e, w in enumerate(weights) if e != 2)

    monkeypatch.setattr(gg, "_uninitialized", lambda *s, **kw: torch.full(*s, float("nan"), **kw))
    a, weights = _leaves(a0, w0)
    out = gmm_experts(a, weights, counts, True, engine="grouped_mm")
    out.backward(grad)
    a_old, w_old = _leaves(a0, w0)
    out_old = gmm(a_old, torch.stack(w_old), counts, True, engine="grouped_mm")
    out_old.backward(grad)
    assert torch.isfinite(out).all() and torch.isfinite(a.grad).all()
    assert torch.equal(out, out_old) and torch.equal(a.grad, a_old.grad)


def test_frozen_weights_and_rows_without_grad():
    counts = [3, 0, 5]
    a0, w0, grad = _inputs(counts, 8, 4, torch.float32, False, 1)
    weights = [w.clone() for w in w0]  # frozen experts: only dA
    a = a0.clone().requires_grad_(True)
    gmm_experts(a, weights, counts).backward(grad)
    a_old = a0.clone().requires_grad_(True)
    gmm(a_old, torch.stack(w0), counts).backward(grad)
    assert torch.equal(a.grad, a_old.grad)
    _, params = _leaves(a0, w0)
    gmm_experts(a0, params, counts).backward(grad)  # rows without grad: only dW
    assert all(p.grad is not None for p in params)


@pytest.mark.parametrize(
    "weights,counts,match",
    [
        ([], [], "no weights"),
        ([torch.randn(8, 3), torch.randn(8, 4)], [2, 2], "must match weight 0"),
        ([torch.randn(8, 3), torch.randn(8, 3).double()], [2, 2], "must match weight 0"),
        ([torch.randn(2, 8, 3)], [4], "2-D tensor"),
        ([torch.randn(8, 3), torch.randn(8, 3)], [2, 1], "summing to"),
        ([torch.randn(8, 3)], [2, 2], "one count per expert"),
        ([torch.randn(3, 8), torch.randn(3, 8)], [2, 2], "trans_b=True"),
    ],
)
def test_bad_input_explains(weights, counts, match):
    with pytest.raises(ValueError, match=match):
        gmm_experts(torch.randn(4, 8), weights, counts)
