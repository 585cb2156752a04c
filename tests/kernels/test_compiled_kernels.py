"""The compiled portable backend (mindspeed_like/kernels/compiled.py).

Default lane (TorchDynamo disabled, as ``make test`` runs): the custom ops pass
``torch.library.opcheck`` (schema, fake kernels, autograd registration) and the fallback to the
eager kernels is said once. Compile lane (``make test-compile``): compiled equals the eager
portable kernel (fp32 within 1e-6, bf16 within one bf16 ulp of the result's scale: the compiled
code computes in fp32 and rounds once, the eager kernel rounds between ops), and a GPT trains 10
steps with varying batch sizes without recompiling.
"""

from __future__ import annotations

import logging

import pytest
import torch

import mindspeed_like
from mindspeed_like.kernels import compiled
from mindspeed_like.kernels import rmsnorm as rmsnorm_kernel
from mindspeed_like.kernels import rope as rope_kernel
from mindspeed_like.kernels import swiglu as swiglu_kernel


@pytest.fixture(autouse=True)
def _mode_back():
    yield
    compiled.set_mode(None)
    mindspeed_like.reset()
    compiled._compiled.clear()
    # dynamo's per-function recompile limit (8) spans tests: every dtype/shape variant here counts
    torch._dynamo.reset()


def _inputs(dtype, rows=6, hidden=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 2 * hidden, generator=g).to(dtype)
    return x, torch.randn(rows, hidden, generator=g).to(dtype), (torch.rand(hidden, generator=g) + 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_pass_opcheck(dtype):
    x, grad, gamma = _inputs(dtype)
    torch.library.opcheck(compiled.swiglu, (x.requires_grad_(),))
    torch.library.opcheck(compiled.swiglu_backward, (grad, x.detach()))
    bias = torch.randn(x.shape[-1]).to(dtype)
    torch.library.opcheck(compiled.swiglu_bias, (x, bias.requires_grad_()))
    torch.library.opcheck(compiled.swiglu_bias_backward, (grad, x.detach(), bias.detach()))
    xr = torch.randn(6, 16).to(dtype).requires_grad_()
    torch.library.opcheck(compiled.rms_norm, (xr, gamma.requires_grad_(), 1e-5))
    _, rstd = compiled.rms_norm(xr.detach(), gamma.detach(), 1e-5)
    torch.library.opcheck(compiled.rms_norm_backward, (torch.randn(6, 16).to(dtype), xr.detach(), gamma.detach(), rstd))
    t, cos, sin = (
        torch.randn(5, 2, 3, 8).to(dtype),
        torch.randn(5, 1, 1, 6).to(dtype),
        torch.randn(5, 1, 1, 6).to(dtype),
    )
    for interleave in (False, True):  # rot_dim 6 < head dim 8: the pass-through channels too
        torch.library.opcheck(compiled.rope, (t.clone().requires_grad_(), cos, sin, interleave))
        torch.library.opcheck(compiled.rope_backward, (t, cos, sin, interleave))


def test_fallback_is_said_once_without_dynamo(monkeypatch, caplog):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    compiled._state["said"].clear()
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        for _ in range(3):
            swiglu_kernel.swiglu(x)
    lines = [r for r in caplog.records if "compiled portable kernels unavailable" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "TORCHDYNAMO_DISABLE" in lines[0].getMessage()
    compiled._state["said"].clear()
    mindspeed_like.configure(portable_kernels="compiled")  # asked for explicitly: a warning
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        swiglu_kernel.swiglu(x)
    assert caplog.records[-1].levelno == logging.WARNING


def test_eager_mode_never_calls_the_custom_ops(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    mindspeed_like.configure(portable_kernels="eager")
    assert not compiled.active(torch.randn(2))


# ---------------------------------------------------------------- compile lane


def _with_grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out) * 0.5 + torch.arange(out.numel()).view(out.shape).to(out.dtype) / out.numel())
    return out.detach(), [t.grad for t in leaves]


def _compiled_and_eager(fn, *inputs):
    compiled.set_mode("compiled")
    compiled._compiled.clear()
    ours = _with_grads(fn, *inputs)
    assert compiled._compiled and all(  # the compiled bodies ran (a compile failure would fall back to eager)
        body is not getattr(compiled, f"{name}_math") for (name, _device), body in compiled._compiled.items()
    ), compiled._compiled
    compiled.set_mode("eager")
    eager = _with_grads(fn, *inputs)
    return ours, eager


def _close(a, b, dtype):
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_swiglu_equals_eager(dtype, monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(3, 5, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    (out, (dx,)), (ref, (ref_dx,)) = _compiled_and_eager(swiglu_kernel.swiglu, x)
    _close(out, ref, dtype)
    _close(dx, ref_dx, dtype)
    (out, (dx, db)), (ref, (ref_dx, ref_db)) = _compiled_and_eager(swiglu_kernel.swiglu, x, bias)
    _close(out, ref, dtype)
    _close(dx, ref_dx, dtype)
    # The bias gradient sums dx's 15 rows. In bf16 each summand may differ by one bf16 ulp (2^-8
    # relative) between the two and the running sum rounds at every add in eager, so the bound
    # scales with the sum of |dx| per column, not with |db| (which can cancel towards zero).
    if dtype == torch.float32:
        torch.testing.assert_close(db, ref_db, rtol=1e-5, atol=1e-4)
    else:
        magnitude = ref_dx.float().abs().reshape(-1, ref_dx.shape[-1]).sum(0)
        bound = 2**-7 * magnitude + 2**-8 * ref_db.float().abs()
        excess = (db.float() - ref_db.float()).abs() - bound
        assert excess.max() <= 0, f"bias grad off by more than the bf16 bound at {excess.argmax()}"


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_compiled_rmsnorm_equals_eager(dtype, zero_centered, monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    x, w = torch.randn(3, 5, 64).to(dtype), (torch.rand(64) * 0.2).to(dtype)

    def fn(x, w):
        return rmsnorm_kernel.rms_norm(x, w, 1e-5, zero_centered)

    (out, (dx, dw)), (ref, (ref_dx, ref_dw)) = _compiled_and_eager(fn, x, w)
    _close(out, ref, dtype)
    _close(dx, ref_dx, dtype)
    torch.testing.assert_close(dw.float(), ref_dw.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)


@pytest.mark.compile
def test_compiled_rmsnorm_saves_what_the_portable_kernel_saves(monkeypatch):
    """A strided input (q sliced from the QKV projection under qk-layernorm: its heads are not
    adjacent) is saved as the view it is, not the [rows, hidden] copy the kernel works on, and the
    weight's fp32 upcast is not saved: x's storage and the fp32 rstd, as the eager kernel keeps."""
    from mindspeed_like.testing.memory import SavedBytesMeter

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    s, b, heads, d = 12, 2, 4, 32
    qkv = torch.randn(s, b, (heads + 2) * d, dtype=torch.bfloat16, requires_grad=True)
    q = qkv[..., : heads * d].view(s, b, heads, d)  # megatron's split of one query group
    w = torch.ones(d, dtype=torch.bfloat16, requires_grad=True)
    saved = {}
    for mode in ("compiled", "eager"):
        compiled.set_mode(mode)
        with SavedBytesMeter() as meter:
            out = rmsnorm_kernel.rms_norm(q, w, 1e-5)
        saved[mode] = meter.current_bytes(exclude=[w])
        out.float().sum().backward()
    assert compiled._compiled, "the compiled body did not run"
    rstd = s * b * heads * 4
    assert saved["compiled"] == saved["eager"] == qkv.untyped_storage().nbytes() + rstd


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("rot_dim", [64, 32], ids=["full", "rotary_percent=0.5"])
def test_compiled_rope_equals_eager(dtype, mode, rot_dim, monkeypatch):
    """The custom op at full and partial rotation against the eager Function; apply_rope routes
    partial rotation to it and keeps full rotation eager (the measured rule, kernels/rope.py)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    t, freqs = torch.randn(7, 2, 3, 64).to(dtype), torch.rand(7, 1, 1, rot_dim) * 10
    cos, sin = rope_kernel.cos_sin(freqs, dtype)
    signed = rope_kernel._signed_sin(sin, mode)
    compiled.set_mode("compiled")
    compiled._compiled.clear()
    out, (dx,) = _with_grads(lambda x: compiled.rope(x, cos, signed, mode == "interleave"), t)
    assert compiled._compiled[("rope", "cpu")] is not compiled.rope_math  # compiled, not the eager fallback
    ref, (ref_dx,) = _with_grads(lambda x: rope_kernel._PortableRope.apply(x, cos, sin, mode), t)
    _close(out, ref, dtype)
    _close(dx, ref_dx, dtype)
    compiled._compiled.clear()
    rope_kernel.apply_rope(t, freqs, mode=mode, backend="portable")
    assert (("rope", "cpu") in compiled._compiled) == (rot_dim < t.shape[-1])


@pytest.mark.compile
def test_gpt_with_varying_batch_sizes_compiles_once(monkeypatch):
    """10 GPT steps (fused SwiGLU, RMSNorm and RoPE through the compiled ops) at micro-batch sizes 1-4
    and two sequence lengths: no recompilation after the first two steps (torch.compile
    specializes a size-1 dimension, so batch 1 then 2 compile twice, as any dynamic compile does)."""
    import torch._dynamo

    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    compiled._compiled.clear()
    mindspeed_like.configure(
        device="cpu",
        use_fused_swiglu=True,
        use_fused_rmsnorm=True,
        use_fused_rotary_pos_emb=True,
        portable_kernels="compiled",
    )
    init_parallel(seed=1)
    try:
        model = tiny_gpt(seq_length=32, rotary_percent=0.5)  # partial rotation: the compiled RoPE
        graphs = []
        for batch, seq in [(1, 32), (2, 32), (3, 16), (4, 32), (2, 16)] * 2:
            tokens = torch.randint(0, 256, (batch, seq))
            position_ids = torch.arange(seq).expand(batch, seq)
            model(tokens, position_ids, None, labels=tokens).float().mean().backward()
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        assert graphs[0] > 0 and graphs[1] == graphs[-1], f"unique compiled graphs after each step: {graphs}"
        for name in ("swiglu", "swiglu_backward", "rms_norm", "rms_norm_backward", "rope", "rope_backward"):
            assert (name, "cpu") in compiled._compiled
            assert compiled._compiled[(name, "cpu")] is not getattr(compiled, f"{name}_math")
    finally:
        destroy_parallel()


STALE_CACHE_RUN = """
import json, torch
from mindspeed_like.kernels import compiled
compiled.set_mode("compiled")
g = torch.Generator().manual_seed(0)
x, gamma = torch.randn(512, 128, generator=g).bfloat16(), torch.rand(128, generator=g) + 0.5
y, rstd = compiled.rms_norm(x, gamma, 1e-5)
ref_y, ref_rstd = compiled.rms_norm_math(x, gamma, 1e-5)
print("RESULT " + json.dumps(dict(capability=torch.backends.cpu.get_cpu_capability(),
    options=compiled.cpu_compile_options(), rstd=(rstd - ref_rstd).abs().max().item(),
    y=(y.float() - ref_y.float()).abs().max().item())))
"""


@pytest.mark.compile
@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="needs a host whose native capability is AVX-512 to compile at two ISAs",
)
def test_one_inductor_cache_for_two_isas_keeps_the_compiled_rmsnorm_right(tmp_path):
    """torch 2.13's FX graph cache key leaves the ISA out: a graph generated at AVX-512 (32 bf16
    lanes) was reused under ATEN_CPU_CAPABILITY=avx2 (16) and half the rows' rstd were the raw sum
    of squares (NaN losses in the CPU-ISA lane). Our compiles name the width: each ISA its own
    entry, right at both, in either order."""
    import json
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    base.update(TORCHDYNAMO_DISABLE="0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1")
    held = dict(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    seen = []
    for extra in ({}, held, {}):  # native fills the cache, avx2 reads it, native again
        done = subprocess.run(
            [sys.executable, "-c", STALE_CACHE_RUN], env={**base, **extra}, capture_output=True, text=True, timeout=600
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-3000:]
        seen.append(json.loads(lines[0][7:]))
    assert [s["capability"] for s in seen] == [seen[0]["capability"], "AVX2", seen[0]["capability"]], seen
    assert seen[0]["options"] != seen[1]["options"], seen  # two widths: two cache entries
    for s in seen:
        assert s["rstd"] <= 1e-6 and s["y"] <= 2**-7 * 8, s  # one bf16 ulp at |y| < 8
