"""bf16/fp16 GEMMs in fp32 on a CPU whose low-precision GEMM is slow: one host-level mechanism.

Why: torch's CPU bf16 GEMM is fast only where oneDNN can use bf16 dot-product units (AVX512-BF16,
AMX). Elsewhere (AVX2-only hosts, or an AVX-512-BF16 host held to AVX2 by ``ONEDNN_MAX_CPU_ISA``)
ATen falls back to a scalar loop: measured on this host held to AVX2, a bf16 512^3 matmul runs at
2.0 GFLOP/s against fp32's 116-130 GFLOP/s, and SDPA's CPU flash-attention backward at 10x its fp32
time. Every linear layer of a bf16 training step then runs ~60x slower than it could.

What: :func:`install` overrides the aten GEMM ops at the ``ADInplaceOrView`` dispatch key (below
autograd, above the CPU kernels; a ``torch.library.Library`` held here, so :func:`uninstall`
deregisters it and torch's own kernels are back). For CPU tensors whose operands are all bf16 (or
all fp16) the op runs in fp32 on upcast inputs and the result is rounded once to the input dtype;
every other call goes on to torch's own kernel unchanged (``redispatch``). Ops covered:
``mm``, ``addmm``, ``bmm``, ``baddbmm`` (functional, ``out=`` and in-place forms, what
``nn.functional.linear``, ``matmul`` and their autograd formulas decompose to on a CPU; checked with
torch.profiler on a megatron-core bf16 GPT step: ``aten::mm`` for every linear layer and its weight
and input gradients, ``baddbmm``/``bmm`` for megatron's unfused attention, ``addmm_`` for a
gradient accumulated in place) and SDPA's CPU flash-attention backward
(``_scaled_dot_product_flash_attention_for_cpu_backward``, at ``AutogradCPU``: autograd's
not-implemented fallback hands it on past ``ADInplaceOrView``; its forward is as fast in bf16 as in
fp32 and is left alone).

Numerics: a bf16 (or fp16) number is exact in fp32, so each product is exact; torch's own bf16
kernels also accumulate in fp32 and round the sum once, only in another order. The result agrees
with torch's bf16 kernel within fp32 rounding of the sum (a bf16 output differs by one ulp where
the fp32 sum sits at a rounding boundary). ``addmm``/``baddbmm``'s ``beta * self`` is added in fp32
before the one rounding, as the bf16 kernels do. The flash-attention backward's gradients come
from the fp32 kernel (torch's bf16 kernel rounds the probabilities to bf16 before two of its
GEMMs; the fp32 one does not): closer to the float64 reference, not bitwise torch's bf16 result.

Why ``ADInplaceOrView`` and not the ``CPU`` key: a kernel registered at ``CPU`` replaces torch's
kernel for every dtype, and the fp32 GEMM it needs would then reach itself; one key above, the
override can hand every call it does not take to torch's kernel with ``redispatch``. The key is not
per backend, so non-CPU tensors are handed on at once (one Python call, ~2 us). For the ``out=`` and
in-place forms the override also does what torch's ``ADInplaceOrView`` kernel does: it bumps the
written tensor's version counter (autograd's check of tensors modified in place). Not reached:
calls inside ``torch.inference_mode`` (the key is skipped there; torch's kernels run).

When: :func:`low_precision_gemm_is_slow` decides, once per process and dtype, from a probe of the
GEMM speed this process really gets (~10 ms): a 128^3 GEMM in the low-precision dtype against the
fp32 path (upcast, fp32 GEMM, round). It measures what runs, so it honours ``ONEDNN_MAX_CPU_ISA``
and ``ATEN_CPU_CAPABILITY``, which /proc/cpuinfo's flags do not (they still say ``avx512_bf16``
under ``ONEDNN_MAX_CPU_ISA=AVX2``). ``MINDSPEED_LIKE_CPU_GEMM=fp32|native`` fixes the decision
(tests, or a host whose probe is disturbed by load).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

LOW = (torch.bfloat16, torch.float16)
PROBE_SIZE = 128
FASTER = 1.2  # the fp32 path must beat the low-precision GEMM by this factor (no flip-flop on noise)
ENV = "MINDSPEED_LIKE_CPU_GEMM"


@dataclass(frozen=True)
class GemmProbe:
    """One dtype's probe: GFLOP/s of the low-precision GEMM and of the fp32 path (upcast + round)."""

    dtype: str
    low_gflops: float
    fp32_path_gflops: float
    forced: str | None = None

    @property
    def fp32_faster(self) -> bool:
        if self.forced is not None:
            return self.forced == "fp32"
        return self.fp32_path_gflops > FASTER * self.low_gflops

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fp32_faster": self.fp32_faster}

    def describe(self) -> str:
        if self.forced is not None:
            return f"{self.dtype} GEMM {'in fp32' if self.fp32_faster else 'native'} ({ENV}={self.forced})"
        return (
            f"{self.dtype} GEMM {self.low_gflops:.1f} GFLOP/s vs fp32 {self.fp32_path_gflops:.1f} GFLOP/s "
            f"(probe {PROBE_SIZE}^3, one thread's view of this host)"
        )


def _best_seconds(first, second, repeats: int = 7) -> tuple[float, float]:
    """The best time of each of two calls, measured alternately (a burst of load hits both)."""
    first(), second()  # warm-up: oneDNN builds its kernel for the shape, BLAS sets up
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return max(best[0], 1e-9), max(best[1], 1e-9)


@functools.cache
def probe(dtype: torch.dtype = torch.bfloat16) -> GemmProbe:
    """The one-time GEMM speed probe for ``dtype`` in this process (see the module docstring)."""
    name = str(dtype).removeprefix("torch.")
    forced = os.environ.get(ENV, "").strip().lower() or None
    if forced is not None:
        if forced not in ("fp32", "native"):
            raise ValueError(f"{ENV}={forced!r}: use 'fp32' (compute low-precision GEMMs in fp32) or 'native'")
        return GemmProbe(name, 0.0, 0.0, forced)
    n = PROBE_SIZE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    try:
        # one thread: the kernels' per-core speed, without the OpenMP team's waits on a loaded host
        torch.set_num_threads(1)
        with _bypassed():
            low, up = _best_seconds(lambda: torch.mm(a, b), lambda: torch.mm(a.float(), b.float()).to(dtype))
    finally:
        torch.set_num_threads(threads)
    flops = 2.0 * n**3 / 1e9
    return GemmProbe(name, flops / low, flops / up)


def pin_decision() -> str:
    """Make this process's decision every child's (``MINDSPEED_LIKE_CPU_GEMM`` in the environment,
    unless set already): a run of several processes (compare's arms and repeats) takes one decision,
    not one per process that a loaded host could flip. Returns the value."""
    if not os.environ.get(ENV):
        os.environ[ENV] = "fp32" if probe(torch.bfloat16).fp32_faster else "native"
    return os.environ[ENV]


def low_precision_gemm_is_slow(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a CPU GEMM in ``dtype`` (bf16/fp16) is faster computed in fp32 on this host."""
    return dtype in LOW and probe(dtype).fp32_faster


def fp32_compute(t: torch.Tensor) -> bool:
    """Whether a GEMM on ``t`` should run in fp32 on upcast inputs here (one decision per process)."""
    return t.device.type == "cpu" and t.dtype in LOW and low_precision_gemm_is_slow(t.dtype)


def host_isa() -> dict[str, Any]:
    """The capability torch and oneDNN run at in this process, and what the probe measured.

    ``aten_cpu_capability``: ATen's vectorised kernels (``ATEN_CPU_CAPABILITY`` caps it);
    ``onednn_max_cpu_isa``: the cap set on oneDNN (``ONEDNN_MAX_CPU_ISA``; unset: the CPU's best);
    ``bf16_gemm``: the probe (whether a bf16 GEMM is faster in fp32 here)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch
        capability = "unknown"
    return {
        "aten_cpu_capability": capability,
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "native",
        "bf16_gemm": probe(torch.bfloat16).as_dict(),
    }


# ---------------------------------------------------------------- the override ---------------------
_AFTER = torch._C._after_ADInplaceOrView_keyset
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_state = threading.local()
_library: torch.library.Library | None = None
_lock = threading.Lock()


class _bypassed:
    """Inside: the override hands every call on (the probe times torch's own kernels)."""

    def __enter__(self):
        self.before = getattr(_state, "bypass", False)
        _state.bypass = True

    def __exit__(self, *exc):
        _state.bypass = self.before


def _low_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The common bf16/fp16 dtype of CPU tensors whose GEMM should run in fp32; else None."""
    if getattr(_state, "bypass", False):
        return None
    first = tensors[0]
    dtype = first.dtype
    if dtype not in LOW:
        return None
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu":
            return None
    if not low_precision_gemm_is_slow(dtype):
        return None
    return dtype


def _written(target: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    if target.shape != result.shape:
        target.resize_(result.shape)
    target.copy_(result)
    torch.autograd.graph.increment_version(target)
    return target


def in_fp32(fp32_op, operands, kwargs: dict[str, Any], dtype: torch.dtype | None) -> Any:
    """One GEMM the override takes: ``fp32_op`` on the operands upcast to fp32, rounded once to
    ``dtype`` (None: left as computed, for a caller that writes it into its own tensor). Every
    taken call goes through this module attribute, so the feature's report patch (a counting
    wrapper) sees each one."""
    result = fp32_op(*[t.float() for t in operands], **kwargs)
    return result if dtype is None else result.to(dtype)


def _functional(op, fp32_op, operands):
    """mm / bmm: (self, mat2); addmm / baddbmm: (self, mat1, mat2, beta, alpha)."""

    def kernel(keyset, *args, **kwargs):
        dtype = _low_dtype(*args[:operands])
        if dtype is None:
            return op.redispatch(keyset & _AFTER, *args, **kwargs)
        return in_fp32(fp32_op, args[:operands], kwargs, dtype)

    return kernel


def _out_form(op, fp32_op, operands):
    def kernel(keyset, *args, out, **kwargs):
        dtype = _low_dtype(*args[:operands], out)
        if dtype is None:
            result = op.redispatch(keyset & _AFTER, *args, out=out, **kwargs)
            torch.autograd.graph.increment_version(out)
            return result
        return _written(out, in_fp32(fp32_op, args[:operands], kwargs, None))

    return kernel


def _inplace(op, fp32_op):
    def kernel(keyset, self, mat1, mat2, **kwargs):
        dtype = _low_dtype(self, mat1, mat2)
        if dtype is None:
            result = op.redispatch(keyset & _AFTER, self, mat1, mat2, **kwargs)
            torch.autograd.graph.increment_version(self)
            return result
        return _written(self, in_fp32(fp32_op, (self, mat1, mat2), kwargs, None))

    return kernel


def _flash_backward(op):
    """SDPA's CPU flash-attention backward in fp32 (its bf16 form is ~10x slower on such hosts)."""

    def kernel(keyset, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, **kwargs):
        dtype = _low_dtype(grad_out, query, key, value, out)
        mask = kwargs.get("attn_mask")
        if dtype is None or (mask is not None and mask.is_floating_point() and mask.dtype != dtype):
            return op.redispatch(
                keyset & _AFTER_AUTOGRAD, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, **kwargs
            )
        if mask is not None and mask.is_floating_point():
            kwargs = {**kwargs, "attn_mask": mask.float()}

        def backward(grad_out, query, key, value, out, **kwargs):
            return op(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, **kwargs)

        grads = in_fp32(backward, (grad_out, query, key, value, out), kwargs, None)
        return tuple(g.to(dtype) for g in grads)

    return kernel


def _kernels() -> dict[str, Any]:
    aten = torch.ops.aten
    table: dict[str, Any] = {
        "mm": _functional(aten.mm.default, torch.mm, 2),
        "bmm": _functional(aten.bmm.default, torch.bmm, 2),
        "addmm": _functional(aten.addmm.default, torch.addmm, 3),
        "baddbmm": _functional(aten.baddbmm.default, torch.baddbmm, 3),
        "mm.out": _out_form(aten.mm.out, torch.mm, 2),
        "bmm.out": _out_form(aten.bmm.out, torch.bmm, 2),
        "addmm.out": _out_form(aten.addmm.out, torch.addmm, 3),
        "baddbmm.out": _out_form(aten.baddbmm.out, torch.baddbmm, 3),
        "addmm_": _inplace(aten.addmm_.default, torch.addmm),
        "baddbmm_": _inplace(aten.baddbmm_.default, torch.baddbmm),
    }
    return table


def _autograd_kernels() -> dict[str, Any]:
    """Ops reached only below autograd's not-implemented fallback, which skips ``ADInplaceOrView``:
    registered at ``AutogradCPU`` instead (they have no derivative of their own to lose)."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if flash is None:
        return {}
    return {"_scaled_dot_product_flash_attention_for_cpu_backward": _flash_backward(flash.default)}


OPS = (*_kernels(), *_autograd_kernels())


def install() -> bool:
    """Register the override (idempotent). Returns whether it is installed now."""
    global _library
    with _lock:
        if _library is None:
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": ours, until uninstall() restores theirs
                warnings.simplefilter("ignore", UserWarning)
                for name, kernel in _kernels().items():
                    library.impl(name, kernel, "ADInplaceOrView", with_keyset=True)
                for name, kernel in _autograd_kernels().items():
                    library.impl(name, kernel, "AutogradCPU", with_keyset=True)
            _library = library
    return True


def uninstall() -> None:
    """Deregister the override: torch's own kernels (and version bumps) are back for every op."""
    global _library
    with _lock:
        if _library is not None:
            _library._destroy()
            _library = None


def installed() -> bool:
    return _library is not None
