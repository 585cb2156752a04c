"""kernels/host_gemm.py: bf16/fp16 CPU GEMMs in fp32, rounded once, as a torch.library override.

Every op the override takes (functional, ``out=`` and in-place forms of mm/addmm/bmm/baddbmm, and
SDPA's CPU flash-attention backward) is checked against a float64 reference within the dtype's
tolerance and, for the GEMMs, bitwise against "fp32 GEMM of the upcast inputs, rounded once" (the
numerics the module docstring claims). The fp32 path is forced (``MINDSPEED_LIKE_CPU_GEMM=fp32``)
so the tests check the same thing on every host; the probe itself is checked on the real host and,
in a subprocess, held to AVX2."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mindspeed_like.kernels import host_gemm as hg
from mindspeed_like.testing.parity import tolerance

LOW = [torch.bfloat16, torch.float16]


def _tol(dtype: torch.dtype) -> dict:
    t = tolerance(torch.bfloat16)  # fp16 (10 mantissa bits) is within bf16's bounds
    return {"rtol": t.rtol, "atol": t.atol}


@pytest.fixture
def forced(monkeypatch):
    """The override installed with the fp32 path forced; uninstalled and the probe forgotten after."""
    monkeypatch.setenv(hg.ENV, "fp32")
    hg.probe.cache_clear()
    hg.install()
    yield
    hg.uninstall()
    monkeypatch.delenv(hg.ENV)
    hg.probe.cache_clear()


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _cases(dtype):
    """(name, call, fp32 rounded-once expectation, float64 reference) for each op form; odd sizes."""
    a, b = _rand(37, 53, dtype=dtype, seed=1), _rand(53, 29, dtype=dtype, seed=2)
    c = _rand(37, 29, dtype=dtype, seed=3)
    ba, bb = _rand(3, 17, 41, dtype=dtype, seed=4), _rand(3, 41, 23, dtype=dtype, seed=5)
    bc = _rand(3, 17, 23, dtype=dtype, seed=6)
    f, d = (lambda t: t.float()), (lambda t: t.double())

    def out_mm():
        out = torch.empty(37, 29, dtype=dtype)
        torch.mm(a, b, out=out)
        return out

    def out_baddbmm():
        out = torch.empty(3, 17, 23, dtype=dtype)
        torch.baddbmm(bc, ba, bb, beta=0.5, alpha=2.0, out=out)
        return out

    return [
        ("mm", lambda: torch.mm(a, b), (f(a) @ f(b)), d(a) @ d(b)),
        ("matmul", lambda: a @ b, (f(a) @ f(b)), d(a) @ d(b)),
        (
            "addmm",
            lambda: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
            torch.addmm(f(c), f(a), f(b), beta=0.5, alpha=2.0),
            0.5 * d(c) + 2.0 * (d(a) @ d(b)),
        ),
        (
            "addmm_",
            lambda: c.clone().addmm_(a, b),
            torch.addmm(f(c), f(a), f(b)),
            d(c) + d(a) @ d(b),
        ),
        ("mm.out", out_mm, f(a) @ f(b), d(a) @ d(b)),
        ("bmm", lambda: torch.bmm(ba, bb), torch.bmm(f(ba), f(bb)), d(ba) @ d(bb)),
        (
            "baddbmm",
            lambda: torch.baddbmm(bc, ba, bb, beta=0.0, alpha=0.25),
            torch.baddbmm(f(bc), f(ba), f(bb), beta=0.0, alpha=0.25),
            0.25 * (d(ba) @ d(bb)),
        ),
        (
            "baddbmm_",
            lambda: bc.clone().baddbmm_(ba, bb),
            torch.baddbmm(f(bc), f(ba), f(bb)),
            d(bc) + d(ba) @ d(bb),
        ),
        (
            "baddbmm.out",
            out_baddbmm,
            torch.baddbmm(f(bc), f(ba), f(bb), beta=0.5, alpha=2.0),
            0.5 * d(bc) + 2.0 * (d(ba) @ d(bb)),
        ),
    ]


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_each_gemm_form_is_the_fp32_gemm_rounded_once(forced, dtype):
    for name, call, fp32, ref64 in _cases(dtype):
        out = call()
        assert out.dtype == dtype, name
        assert torch.equal(out, fp32.to(dtype)), f"{name}: not the fp32 GEMM rounded once"
        torch.testing.assert_close(out.double(), ref64, **_tol(dtype), msg=name)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_agrees_with_torchs_own_low_precision_kernel(dtype):
    """Without the override (torch's kernel) and with it: both within the tolerance of float64, and
    they differ at most by the ulps of a rounding boundary (the fp32 sums agree to fp32 rounding)."""
    a, b = _rand(64, 256, dtype=dtype, seed=7), _rand(256, 48, dtype=dtype, seed=8)
    native = torch.mm(a, b)
    os.environ[hg.ENV] = "fp32"
    hg.probe.cache_clear()
    try:
        hg.install()
        ours = torch.mm(a, b)
    finally:
        hg.uninstall()
        del os.environ[hg.ENV]
        hg.probe.cache_clear()
    ref = a.double() @ b.double()
    torch.testing.assert_close(ours.double(), ref, **_tol(dtype))
    torch.testing.assert_close(native.double(), ref, **_tol(dtype))
    eps = torch.finfo(dtype).eps
    ulps = ((ours.double() - native.double()).abs() / (ref.abs() * eps).clamp_min(eps)).max().item()
    assert ulps <= 2.0, f"ours and torch's {dtype} kernel differ by {ulps:.2f} ulp"
    assert torch.equal(torch.mm(a, b), native), "uninstalled: torch's own kernel is back"


def test_linear_and_its_gradients_run_through_the_override(forced):
    """What a megatron linear layer does: F.linear / matmul forward, both gradients by autograd."""
    x = _rand(4, 19, 64, dtype=torch.bfloat16, seed=9).requires_grad_()
    w = _rand(32, 64, dtype=torch.bfloat16, seed=10).requires_grad_()
    bias = _rand(32, dtype=torch.bfloat16, seed=11).requires_grad_()
    y = F.linear(x, w, bias)
    grad = _rand(4, 19, 32, dtype=torch.bfloat16, seed=12)
    y.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    y64 = F.linear(x64, w64, b64)
    y64.backward(grad.double())
    for ours, ref in ((y, y64), (x.grad, x64.grad), (w.grad, w64.grad), (bias.grad, b64.grad)):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.double(), ref.detach(), **_tol(torch.bfloat16))
    # the weight gradient is exactly the fp32 GEMM over all tokens, rounded once
    g2, x2 = grad.reshape(-1, 32).float(), x.detach().reshape(-1, 64).float()
    assert torch.equal(w.grad, (g2.t() @ x2).bfloat16())


def test_flash_attention_backward_in_fp32(forced):
    """SDPA's CPU flash backward in bf16: the gradients of the fp32 kernel rounded, near float64."""
    q, k, v = (_rand(1, 2, 97, 32, dtype=torch.bfloat16, seed=s).requires_grad_() for s in (13, 14, 15))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = _rand(*out.shape, dtype=torch.bfloat16, seed=16)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q64, k64, v64, is_causal=True).backward(grad.double())
    for ours, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.double(), ref, **_tol(torch.bfloat16))


def test_other_calls_are_handed_on_unchanged(forced):
    """fp32, fp64, mixed dtypes and meta tensors reach torch's own kernels: results bitwise."""
    a, b = _rand(33, 17, dtype=torch.float32, seed=17), _rand(17, 9, dtype=torch.float32, seed=18)
    expected = a.numpy() @ b.numpy()
    assert torch.allclose(torch.mm(a, b), torch.from_numpy(expected), rtol=1e-5, atol=1e-6)
    hg.uninstall()
    before = torch.mm(a, b), torch.mm(a.double(), b.double())
    hg.install()
    assert torch.equal(torch.mm(a, b), before[0]) and torch.equal(torch.mm(a.double(), b.double()), before[1])
    meta = torch.mm(
        torch.empty(3, 4, device="meta", dtype=torch.bfloat16), torch.empty(4, 5, device="meta", dtype=torch.bfloat16)
    )
    assert meta.shape == (3, 5) and meta.device.type == "meta"
    with pytest.raises(RuntimeError):  # torch's own error for a dtype mix, not ours
        torch.mm(a.bfloat16(), b)


def test_in_place_and_out_forms_bump_the_version_counter(forced):
    """The override stands in for torch's ADInplaceOrView kernel: autograd still sees the write."""
    for dtype in (torch.bfloat16, torch.float32):
        c = torch.zeros(4, 4, dtype=dtype)
        before = c._version
        c.addmm_(torch.ones(4, 2, dtype=dtype), torch.ones(2, 4, dtype=dtype))
        assert c._version > before and torch.equal(c, torch.full((4, 4), 2.0, dtype=dtype))
        out = torch.empty(4, 4, dtype=dtype)
        before = out._version
        torch.mm(torch.ones(4, 3, dtype=dtype), torch.ones(3, 4, dtype=dtype), out=out)
        assert out._version > before
    p = torch.ones(4, 4, dtype=torch.bfloat16, requires_grad=True)
    s = (p * 2).sigmoid()  # sigmoid saves its output for backward
    s.addmm_(torch.ones(4, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()


def test_install_is_idempotent_and_uninstall_restores(monkeypatch):
    monkeypatch.setenv(hg.ENV, "fp32")
    hg.probe.cache_clear()
    a, b = _rand(16, 300, dtype=torch.bfloat16, seed=19), _rand(300, 8, dtype=torch.bfloat16, seed=20)
    native = torch.mm(a, b)
    try:
        hg.install()
        hg.install()
        assert hg.installed()
        assert torch.equal(torch.mm(a, b), (a.float() @ b.float()).bfloat16())
    finally:
        hg.uninstall()
        hg.uninstall()
        hg.probe.cache_clear()
    assert not hg.installed() and torch.equal(torch.mm(a, b), native)


def test_forced_decisions_and_a_bad_value(monkeypatch):
    for value, slow in (("fp32", True), ("native", False), (" FP32 ", True)):
        monkeypatch.setenv(hg.ENV, value)
        hg.probe.cache_clear()
        assert hg.low_precision_gemm_is_slow(torch.bfloat16) is slow
        assert hg.fp32_compute(torch.empty(1, dtype=torch.bfloat16)) is slow
        assert not hg.fp32_compute(torch.empty(1)) and not hg.low_precision_gemm_is_slow(torch.float32)
    monkeypatch.setenv(hg.ENV, "fast")
    hg.probe.cache_clear()
    with pytest.raises(ValueError, match="MINDSPEED_LIKE_CPU_GEMM"):
        hg.probe()
    monkeypatch.delenv(hg.ENV)
    hg.probe.cache_clear()


def test_pin_decision_hands_one_decision_to_children(monkeypatch):
    monkeypatch.setenv(hg.ENV, "")  # unset for the probe; monkeypatch restores the original after
    hg.probe.cache_clear()
    measured = hg.probe()
    value = hg.pin_decision()
    assert os.environ[hg.ENV] == value == ("fp32" if measured.fp32_faster else "native")
    hg.probe.cache_clear()


PROBE = """
import json, torch
from mindspeed_like.kernels import host_gemm
print("PROBE " + json.dumps(host_gemm.host_isa()))
"""


def _probe_in(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != hg.ENV}
    env.update(env_extra, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    import json

    return json.loads(lines[0][6:])


def test_probe_measures_the_real_host():
    """The probe's figures are real (positive GFLOP/s) and its decision follows them."""
    hg.probe.cache_clear()
    p = hg.probe(torch.bfloat16)
    assert p.forced is None and p.low_gflops > 0 and p.fp32_path_gflops > 0
    assert p.fp32_faster == (p.fp32_path_gflops > hg.FASTER * p.low_gflops)
    hg.probe.cache_clear()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 ISA")
def test_probe_held_to_avx2_says_fp32():
    """Held to AVX2 torch has no fast bf16 GEMM on any x86 CPU (oneDNN is not used; ATen's loop is
    ~30x slower than fp32): the probe says so, whatever /proc/cpuinfo's flags say."""
    held = _probe_in({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"})
    assert held["onednn_max_cpu_isa"] == "AVX2" and held["aten_cpu_capability"] == "AVX2"
    assert held["bf16_gemm"]["fp32_faster"], held
