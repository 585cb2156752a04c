"""Grouped GEMM for MoE experts: ``gmm(a, b, batch_sizes, trans_b=False)``.

The op megatron-core's ``GroupedMLP`` calls as ``grouped_gemm.ops.gmm`` (the CUDA-only
``grouped_gemm`` package): ``a`` is ``[tokens, K]`` with the tokens of expert 0 first, then
expert 1, ...; ``b`` is ``[E, K, N]`` (``[E, N, K]`` with ``trans_b``); ``batch_sizes`` holds
the per-expert token COUNTS (a CPU int64 tensor in megatron). Row block ``e`` of the
``[tokens, N]`` result is ``a_e @ b_e`` (``a_e @ b_e^T`` with ``trans_b``).

Backends (``mindspeed_like.kernels.backend.backend_for``):

- ``npu``: ``torch_npu.npu_grouped_matmul`` per notes/torch-npu-ops.md: one input and one
  weight tensor, ``group_list`` the CUMULATIVE counts (int64, ``group_list_type=0``),
  ``group_type=0`` (grouped along the tokens), one output (``split_item=2``). torch_npu has no
  autograd for it, so the backward is ours: dA is the same call with the weight transposed,
  dB is ``group_type=2`` (grouped along the reduced token dimension, ``split_item=3``, one
  stacked ``[E, K, N]`` result). At most 1024 groups.
- ``portable``: one output allocation, each expert writes its row block (no ``cat``, no
  per-expert outputs kept). Two engines behind the same autograd Function:

  * ``torch._grouped_mm`` (probed on torch 2.13.0+cpu: it exists and runs on CPU for fp32 and
    bf16, forward and the 2-D x 2-D weight-gradient form, zero-token groups included, but only
    when every row stride is a multiple of 16 bytes, i.e. K and N multiples of 4 (fp32) or 8
    (bf16); otherwise "strides should be multiple of 16 bytes"). Used when that holds.
  * a per-expert loop of ``torch.mm(..., out=slice)`` into the one buffer otherwise (odd sizes,
    fp16, older torch). Zero-token experts get zero weight-gradient slices.

  bf16/fp16 on a CPU whose bf16 GEMM is slower than fp32 (no bf16 dot-product instructions, e.g.
  AVX2-only hosts, or torch/oneDNN held below them; decided by :mod:`mindspeed_like.kernels.host_gemm`'s
  one-time speed probe, not /proc/cpuinfo's flags): the inputs are upcast to fp32, the GEMM runs in fp32 and
  the result is rounded once to the input dtype (:func:`fp32_compute`). The bf16 kernels there
  also multiply exactly and accumulate in fp32, only in another order, so the results agree
  within fp32 rounding (a bf16 output differs by one ulp where the fp32 sum sits at a rounding
  boundary); the fp32 GEMM is 10-50x faster there (measured on this host's AVX2 CPU: the
  fc1 input gradient [1024, 1408] x [8, 1408, 256] 8.6 s bf16 -> 0.17 s fp32 under load 60; the
  bf16 kernels' per-expert ``mm`` was 84-89% of a moe-preset training step's self time).

  With ``accumulate_into`` (megatron's gradient-accumulation-fusion semantics) the weight
  gradient is added per expert straight into the parameter's fp32 ``main_grad`` instead of
  materialising a separate ``[E, K, N]`` gradient.
  bf16/fp16 on a CPU with bf16 units: each expert's row count is rounded up to a bounded set of
  sizes with zero rows (:mod:`mindspeed_like.kernels.row_buckets`: oneDNN keeps state for every
  GEMM shape it sees, and MoE's token counts are new every step); the results are bitwise the
  unpadded GEMM's.
- ``reference``: plain eager per-expert matmuls and a ``cat`` under autograd (the oracle).

``gmm_experts(a, weights, batch_sizes, trans_b)``: the same op over a list of per-expert 2-D
weights (TE's ``GroupedLinear`` layout: one parameter per expert), bitwise
``gmm(a, torch.stack(weights), ...)`` but without a stacked copy kept to backward: autograd saves
``a`` and the weights themselves; the loop reads each weight directly, and where a kernel takes one
``[E, ...]`` tensor (``torch._grouped_mm``, ``npu_grouped_matmul``) a stack is made for that call
only, holding the experts with rows (the other slots are never read; keeping them keeps the group
count, which torch's CUDA kernel uses to pick its tile, so the numbers are the whole stack's). An
expert without rows costs no GEMM and gets an exact zero gradient. Measured (tests/kernels): the
stacked path kept ``E x N x K`` bytes more per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindspeed_like.kernels.backend import backend_for
from mindspeed_like.kernels.host_gemm import fp32_compute, low_precision_gemm_is_slow
from mindspeed_like.kernels.row_buckets import row_buckets

MAX_NPU_GROUPS = 1024
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


def counts_of(batch_sizes: torch.Tensor | Sequence[int]) -> list[int]:
    """Per-expert token counts as Python ints (megatron passes a CPU int64 tensor)."""
    if isinstance(batch_sizes, torch.Tensor):
        if batch_sizes.dim() != 1 or batch_sizes.is_floating_point() or batch_sizes.is_complex():
            raise ValueError(
                f"gmm: batch_sizes must be a 1-D integer tensor of per-expert token counts, got "
                f"shape {tuple(batch_sizes.shape)} dtype {batch_sizes.dtype}"
            )
        return [int(c) for c in batch_sizes.tolist()]
    return [int(c) for c in batch_sizes]


def check_gmm_args(a: torch.Tensor, b: torch.Tensor, counts: list[int], trans_b: bool) -> None:
    """Raise ValueError naming what is wrong with a ``gmm`` call and how to fix it."""
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"gmm: a must be [tokens, K] and b [experts, K, N] ([experts, N, K] with trans_b); got a "
            f"{tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if a.dtype != b.dtype:
        raise ValueError(f"gmm: a and b must share a dtype, got {a.dtype} and {b.dtype}; cast one of them")
    k = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != k:
        raise ValueError(
            f"gmm: a's last dim {a.shape[1]} does not match b's reduced dim {k} (b {tuple(b.shape)}, "
            f"trans_b={trans_b}); pass trans_b={not trans_b} if b is stored the other way round"
        )
    if len(counts) != b.shape[0]:
        raise ValueError(f"gmm: {len(counts)} batch sizes for {b.shape[0]} experts; give one count per expert")
    if any(c < 0 for c in counts) or sum(counts) != a.shape[0]:
        raise ValueError(
            f"gmm: batch_sizes must be non-negative per-expert token counts summing to a's {a.shape[0]} rows, "
            f"got sum {sum(counts)} (min {min(counts, default=0)})"
        )


def cpu_has_bf16_gemm() -> bool:
    """Whether torch's bf16 GEMM is the fast one in this process: :mod:`mindspeed_like.kernels.host_gemm`'s
    one-time probe (the GEMM speed this process really gets, so it honours ``ONEDNN_MAX_CPU_ISA`` /
    ``ATEN_CPU_CAPABILITY``; /proc/cpuinfo's flags do not). Asked by plan and compare's record; the
    kernel decides per tensor with :func:`fp32_compute`, the same probe's per-dtype answer."""
    return not low_precision_gemm_is_slow(torch.bfloat16)


def _mat(b_e: torch.Tensor, trans_b: bool) -> torch.Tensor:
    return b_e.t() if trans_b else b_e


# ``b`` below is either one ``[E, K, N]`` tensor (``gmm``) or the experts' own 2-D weights in a list
# (``gmm_experts``): ``b[e]`` is expert e's matrix either way. A list is stacked only where one tensor
# is needed (torch._grouped_mm, npu_grouped_matmul), transiently (:func:`_stacked`).
_uninitialized = torch.empty  # the transient stack's allocation (tests fill it to prove slots unread)


def _upcast(b, counts: list[int]):
    """``b`` in fp32 (:func:`fp32_compute`): a list's experts with rows only (the others are never read)."""
    if isinstance(b, torch.Tensor):
        return b.float()
    return [w.float() if c else w for w, c in zip(b, counts)]


def _stacked(b, counts: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``b`` as one ``[E, ...]`` tensor: itself, or a new one holding the experts with rows, for this
    call only. The slots of experts without rows are left unwritten: no GEMM reads them (zero rows),
    and keeping every expert's slot keeps the group count, so the kernel (whose tile choice reads the
    mean rows per group on CUDA) runs exactly as on the whole stack."""
    if isinstance(b, torch.Tensor):
        return b
    first = b[0]
    out = _uninitialized((len(b), *first.shape), dtype=dtype, device=first.device)
    for e, (w, count) in enumerate(zip(b, counts)):
        if count:
            out[e].copy_(w)
    return out


def _grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm's CPU/CUDA kernels need fp32/bf16 and 16-byte aligned row strides."""
    return all(_grouped_mm_fits(t) and t.data_ptr() % 16 == 0 for t in tensors)


def _grouped_mm_fits(t: torch.Tensor) -> bool:
    """:func:`_grouped_mm_ok` but for the data's address: a new stack of ``t``-like matrices (aligned)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if t.dtype not in _GROUPED_MM_DTYPES or t.device.type not in ("cpu", "cuda"):
        return False
    return not any((s * t.element_size()) % 16 for s in t.shape[-2:])


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


# ------------------------------------------------------------------ portable engines


def _forward_portable(a, b, counts, trans_b, engine):
    if fp32_compute(a):
        return _forward_portable(a.float(), _upcast(b, counts), counts, trans_b, engine).to(a.dtype)
    if (buckets := row_buckets(a, counts)) is not None:
        return buckets.unpad(_forward_portable(buckets.pad(a), b, buckets.padded, trans_b, engine))
    if engine == "grouped_mm":
        b = _stacked(b, counts, a.dtype)
        return torch._grouped_mm(a, b.transpose(1, 2) if trans_b else b, offs=_offsets(counts, a.device))
    n = b[0].shape[0] if trans_b else b[0].shape[1]
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            torch.mm(a[start : start + count], _mat(b[e], trans_b), out=out[start : start + count])
        start += count
    return out


def _grad_a_portable(grad, b, counts, trans_b, engine):
    if fp32_compute(grad):
        return _grad_a_portable(grad.float(), _upcast(b, counts), counts, trans_b, engine).to(grad.dtype)
    if (buckets := row_buckets(grad, counts)) is not None:
        return buckets.unpad(_grad_a_portable(buckets.pad(grad), b, buckets.padded, trans_b, engine))
    if engine == "grouped_mm":
        b = _stacked(b, counts, grad.dtype)
        return torch._grouped_mm(grad, b if trans_b else b.transpose(1, 2), offs=_offsets(counts, grad.device))
    k = b[0].shape[1] if trans_b else b[0].shape[0]
    grad_a = torch.empty(grad.shape[0], k, dtype=grad.dtype, device=grad.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            # dA_e = dY_e @ B_e^T  (B_e^T = b[e] itself when b is stored transposed)
            torch.mm(grad[start : start + count], b[e] if trans_b else b[e].t(), out=grad_a[start : start + count])
        start += count
    return grad_a


def _grad_b_portable(a, grad, counts, trans_b, engine):
    """dB_e = A_e^T dY_e ([K, N]), or its transpose dY_e^T A_e for a transposed b."""
    if fp32_compute(a):
        return _grad_b_portable(a.float(), grad.float(), counts, trans_b, engine).to(a.dtype)
    if (buckets := row_buckets(a, counts)) is not None:  # zero rows add exact zeros to dB
        return _grad_b_portable(buckets.pad(a), buckets.pad(grad), buckets.padded, trans_b, engine)
    if engine == "grouped_mm":
        offs = _offsets(counts, a.device)
        if trans_b:
            return torch._grouped_mm(grad.t(), a, offs=offs)
        return torch._grouped_mm(a.t(), grad, offs=offs)
    k, n = a.shape[1], grad.shape[1]
    grad_b = torch.empty((len(counts), n, k) if trans_b else (len(counts), k, n), dtype=a.dtype, device=a.device)
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        if count:
            if trans_b:
                torch.mm(grad[rows].t(), a[rows], out=grad_b[e])
            else:
                torch.mm(a[rows].t(), grad[rows], out=grad_b[e])
        else:
            grad_b[e].zero_()
        start += count
    return grad_b


def _accumulate_grad_b(main_grad, a, grad, counts, trans_b):
    """main_grad[e] += dB_e, per expert. Same dtype (fp32): one ``addmm_`` straight into
    main_grad. Lower-precision inputs (bf16/fp16): dB_e by the input dtype's GEMM (fp32
    accumulation inside; upcasting the inputs to run an fp32 GEMM measured 2-4x slower on CPU),
    then added to main_grad: the numbers megatron's unfused path gives (its DDP hook adds the
    bf16 weight gradient to main_grad), with a one-expert temporary instead of a fresh [E, K, N]."""
    if (buckets := row_buckets(a, counts)) is not None and not fp32_compute(a):
        a, grad, counts = buckets.pad(a), buckets.pad(grad), buckets.padded
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        if count:
            x, g = a[rows], grad[rows]
            left, right = (g.t(), x) if trans_b else (x.t(), g)
            if a.dtype == main_grad.dtype:
                main_grad[e].addmm_(left, right)
            elif fp32_compute(a):  # the bf16 weight gradient from an fp32 GEMM (module docstring)
                main_grad[e].add_(torch.mm(left.float(), right.float()).to(a.dtype))
            else:
                main_grad[e].add_(torch.mm(left, right))
        start += count


class _PortableGmm(torch.autograd.Function):
    """Saves ``a`` and ``b`` (what the per-expert linear layers of SequentialMLP save too)."""

    @staticmethod
    def forward(ctx, a, b, counts, trans_b, engine, accumulate_into):
        ctx.save_for_backward(a, b)
        ctx.counts, ctx.trans_b, ctx.engine, ctx.accumulate_into = counts, trans_b, engine, accumulate_into
        return _forward_portable(a, b, counts, trans_b, engine)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        engine = ctx.engine if _grouped_mm_ok(grad) else "loop"
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _grad_a_portable(grad, b, ctx.counts, ctx.trans_b, engine)
        if ctx.needs_input_grad[1]:
            if ctx.accumulate_into is not None:
                grad_b = _fused_accumulation(ctx.accumulate_into, b, a, grad, ctx.counts, ctx.trans_b)
            else:
                grad_b = _grad_b_portable(a, grad, ctx.counts, ctx.trans_b, engine)
        return grad_a, grad_b, None, None, None, None


def _fused_accumulation(param, b, a, grad, counts, trans_b, grad_b=None):
    """Megatron's gradient-accumulation-fusion contract (``LinearWithGradAccumulation...``):
    the weight gradient goes into ``param.main_grad``, ``grad_added_to_main_grad`` tells DDP's
    hook not to add ``param.grad`` again, and a dummy gradient of the weight's shape is returned
    (zeros under ``zero_out_wgrad``) so the hook still fires on the main thread."""
    main_grad = param.main_grad.view(b.shape)
    if grad_b is None:
        _accumulate_grad_b(main_grad, a, grad, counts, trans_b)
    else:
        main_grad.add_(grad_b)
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        maker = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
        return maker(b.shape, dtype=b.dtype, device=b.device)
    return None


# ------------------------------------------------------------------ npu


def _npu_group_list(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device)


def _npu_forward(a, b, group_list, trans_b):
    from mindspeed_like.kernels.backends.npu import torch_npu

    weight = b.transpose(1, 2) if trans_b else b
    (out,) = torch_npu().npu_grouped_matmul(
        [a], [weight], bias=None, group_list=group_list, split_item=2, group_type=0, group_list_type=0
    )
    return out


def _npu_grad_a(grad, b, group_list, trans_b):
    from mindspeed_like.kernels.backends.npu import torch_npu

    weight_t = b if trans_b else b.transpose(1, 2)  # [E, N, K]
    (grad_a,) = torch_npu().npu_grouped_matmul(
        [grad], [weight_t], bias=None, group_list=group_list, split_item=2, group_type=0, group_list_type=0
    )
    return grad_a


def _npu_grad_b(a, grad, group_list, trans_b):
    from mindspeed_like.kernels.backends.npu import torch_npu

    x, y = (grad, a) if trans_b else (a, grad)  # dB = x^T y per group of tokens
    (grad_b,) = torch_npu().npu_grouped_matmul(
        [x.t()], [y], bias=None, group_list=group_list, split_item=3, group_type=2, group_list_type=0
    )
    return grad_b


class _NpuGmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, counts, trans_b, accumulate_into):
        group_list = _npu_group_list(counts, a.device)
        ctx.save_for_backward(a, b, group_list)
        ctx.counts, ctx.trans_b, ctx.accumulate_into = counts, trans_b, accumulate_into
        return _npu_forward(a, b, group_list, trans_b)

    @staticmethod
    def backward(ctx, grad):
        a, b, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _npu_grad_a(grad, b, group_list, ctx.trans_b)
        if ctx.needs_input_grad[1]:
            grad_b = _npu_grad_b(a, grad, group_list, ctx.trans_b)
            if ctx.accumulate_into is not None:
                grad_b = _fused_accumulation(ctx.accumulate_into, b, a, grad, ctx.counts, ctx.trans_b, grad_b)
        return grad_a, grad_b, None, None, None


# ------------------------------------------------------------------ the experts' own weights


class _ExpertsGmm(torch.autograd.Function):
    """``gmm`` over the experts' own 2-D weights (``weights[e]`` is ``b[e]``), keeping no stack of them:
    it saves ``a`` and the weights themselves (parameters: alive anyway), stacks (torch._grouped_mm,
    npu_grouped_matmul) or loops over the experts with rows inside forward and backward only, and gives
    each weight its slice of the same weight-gradient computation as ``gmm`` (zeros for an expert
    without rows). Results are bitwise ``gmm(a, torch.stack(weights), ...)``'s: the same kernels on
    the same operands."""

    @staticmethod
    def forward(ctx, a, counts, trans_b, engine, *weights):
        ctx.save_for_backward(a, *weights)
        ctx.counts, ctx.trans_b, ctx.engine = counts, trans_b, engine
        if engine == "npu":
            group_list = _npu_group_list(counts, a.device)
            return _npu_forward(a, _stacked(list(weights), counts, a.dtype), group_list, trans_b)
        return _forward_portable(a, list(weights), counts, trans_b, engine)

    @staticmethod
    def backward(ctx, grad):
        a, *weights = ctx.saved_tensors
        counts, trans_b = ctx.counts, ctx.trans_b
        grad = grad.contiguous()
        grad_a = grad_b = None
        if ctx.engine == "npu":
            group_list = _npu_group_list(counts, a.device)
            if ctx.needs_input_grad[0]:
                grad_a = _npu_grad_a(grad, _stacked(weights, counts, grad.dtype), group_list, trans_b)
            if any(ctx.needs_input_grad[4:]):
                grad_b = _npu_grad_b(a, grad, group_list, trans_b)
        else:
            engine = ctx.engine if _grouped_mm_ok(grad) else "loop"
            if ctx.needs_input_grad[0]:
                grad_a = _grad_a_portable(grad, weights, counts, trans_b, engine)
            if any(ctx.needs_input_grad[4:]):
                grad_b = _grad_b_portable(a, grad, counts, trans_b, engine)
        grads_b = [None] * len(weights) if grad_b is None else list(grad_b.unbind(0))
        return grad_a, None, None, None, *grads_b


# ------------------------------------------------------------------ entry points


def gmm_reference(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """The oracle: eager per-expert matmuls and a ``cat``, autograd through them."""
    counts = counts_of(batch_sizes)
    check_gmm_args(a, b, counts, trans_b)
    pieces = torch.split(a, counts, dim=0)
    return torch.cat([p @ _mat(b[e], trans_b) for e, p in enumerate(pieces)], dim=0)


def main_grad_owner(b: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter whose ``main_grad`` receives ``b``'s gradient: ``b`` itself, or the
    parameter ``b`` is a full view of (megatron passes ``weight.view(E, K, N)``)."""
    owner = b if hasattr(b, "main_grad") else getattr(b, "_base", None)
    if owner is None or getattr(owner, "main_grad", None) is None:
        return None
    if owner.numel() != b.numel() or owner.main_grad.numel() != b.numel() or not b.is_contiguous():
        return None
    return owner


def gmm(
    a: torch.Tensor,
    b: torch.Tensor,
    batch_sizes: torch.Tensor | Sequence[int],
    trans_b: bool = False,
    *,
    accumulate_into: torch.nn.Parameter | None = None,
    engine: str | None = None,
) -> torch.Tensor:
    """Grouped matmul ``[a_0 @ b_0; a_1 @ b_1; ...]`` with autograd (see the module docstring).

    accumulate_into: a parameter with ``main_grad`` (see :func:`main_grad_owner`); ``b``'s
        weight gradient is then added into ``main_grad`` (megatron's gradient accumulation
        fusion) and a dummy gradient is returned for ``b``.
    engine: portable only; ``"grouped_mm"`` or ``"loop"`` to force one (benchmarks, tests);
        default: ``grouped_mm`` where torch supports the shapes, else ``loop``.
    """
    counts = counts_of(batch_sizes)
    check_gmm_args(a, b, counts, trans_b)
    backend = backend_for(a)
    if backend == "reference":
        return gmm_reference(a, b, counts, trans_b)
    if backend == "npu":
        if len(counts) > MAX_NPU_GROUPS:
            raise ValueError(f"gmm: npu_grouped_matmul takes at most {MAX_NPU_GROUPS} groups, got {len(counts)}")
        return _NpuGmm.apply(a, b, counts, trans_b, accumulate_into)
    if engine is None:
        engine = "grouped_mm" if _grouped_mm_ok(a, b) else "loop"
    elif engine not in ("grouped_mm", "loop"):
        raise ValueError(f"gmm: unknown engine {engine!r}; choose 'grouped_mm' or 'loop'")
    elif engine == "grouped_mm" and not _grouped_mm_ok(a, b):
        raise ValueError("gmm: torch._grouped_mm does not support these tensors (fp32/bf16, 16-byte row strides)")
    return _PortableGmm.apply(a, b, counts, trans_b, engine, accumulate_into)


def check_experts_args(a: torch.Tensor, weights: Sequence[torch.Tensor], counts: list[int], trans_b: bool) -> None:
    """Raise ValueError naming what is wrong with a ``gmm_experts`` call and how to fix it."""
    if not weights:
        raise ValueError("gmm_experts: no weights; pass one 2-D weight per expert")
    first = weights[0]
    for e, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"gmm_experts: weight {e} must be a 2-D tensor, got {getattr(w, 'shape', type(w))}")
        if w.shape != first.shape or w.dtype != first.dtype or w.device != first.device:
            raise ValueError(
                f"gmm_experts: every expert's weight must match weight 0 ({tuple(first.shape)}, {first.dtype}, "
                f"{first.device}); weight {e} is {tuple(w.shape)}, {w.dtype}, {w.device}"
            )
    check_gmm_args(a, first.expand(len(weights), *first.shape), counts, trans_b)


def gmm_experts(
    a: torch.Tensor,
    weights: Sequence[torch.Tensor],
    batch_sizes: torch.Tensor | Sequence[int],
    trans_b: bool = False,
    *,
    engine: str | None = None,
) -> torch.Tensor:
    """``gmm(a, torch.stack(weights), batch_sizes, trans_b)``, bitwise, without a stacked copy of the
    weights kept for backward (what a module holding one parameter per expert, as TE's
    ``GroupedLinear`` does, needs): autograd keeps ``a`` and the weights themselves; a stack is made
    for one kernel call at a time where the kernel takes one tensor, holding only the experts with
    rows. An expert without rows costs no GEMM and gets an exact zero gradient. ``engine`` as for
    :func:`gmm`."""
    counts = counts_of(batch_sizes)
    weights = list(weights)
    check_experts_args(a, weights, counts, trans_b)
    backend = backend_for(a)
    if backend == "reference":
        pieces = torch.split(a, counts, dim=0)
        return torch.cat([p @ _mat(weights[e], trans_b) for e, p in enumerate(pieces)], dim=0)
    if backend == "npu":
        if len(counts) > MAX_NPU_GROUPS:
            raise ValueError(f"gmm: npu_grouped_matmul takes at most {MAX_NPU_GROUPS} groups, got {len(counts)}")
        return _ExpertsGmm.apply(a, counts, trans_b, "npu", *weights)
    shape_ok = _grouped_mm_ok(a) and _grouped_mm_fits(weights[0])  # gmm's choice on a (new, aligned) stack
    if engine is None:
        engine = "grouped_mm" if shape_ok else "loop"
    elif engine not in ("grouped_mm", "loop"):
        raise ValueError(f"gmm: unknown engine {engine!r}; choose 'grouped_mm' or 'loop'")
    elif engine == "grouped_mm" and not shape_ok:
        raise ValueError("gmm: torch._grouped_mm does not support these tensors (fp32/bf16, 16-byte row strides)")
    return _ExpertsGmm.apply(a, counts, trans_b, engine, *weights)
