"""SwiGLU fwd+bwd: megatron's eager GLU (``MLP.forward``'s inline ``silu(a) * b``, the path
without ``bias_activation_fusion``) and megatron's ``bias_swiglu_impl`` vs ours (portable backend).

``bias_swiglu_impl`` is megatron's ``jit_fuser`` (``torch.compile``) function: compiled unless
``TORCHDYNAMO_DISABLE`` is set, like ours (``--portable-kernels auto``: compiled where the host
can; the bias case runs the eager kernel). ``ours_eager_ms`` is ours with ``--portable-kernels
eager``. Run without TORCHDYNAMO_DISABLE to compare the compiled paths.

Time: median of ``--repeats`` fwd+bwd runs, same inputs, same process, after ``WARMUP`` runs
(the process's first compile leaves Inductor's compile workers busy for a few calls: measured
280 ms then 100 ms calls after a 57 ms one, so one warm-up run is not enough). Saved: bytes autograd
keeps for backward (saved-tensor hooks, storages counted once).

On a GPU (``--device cuda``) Liger-Kernel's Triton ``silu(a) * b`` is the anchor of the rows
without bias (it has none): ``liger_ms``, ``vs_liger`` = Liger's time / ours (>= 1: ours at least
as fast), on two ``[tokens, ffn]`` tensors holding the same values as ours' ``[tokens, 2 * ffn]``
input (its column says why where it cannot run: benchmarks/liger_anchor.py); a larger shape is
added there (4 x 4096 tokens, Llama-8B's ffn 14336).

    python benchmarks/fused_ops_swiglu.py [--quick] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import statistics

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import liger_anchor
import torch
import torch.nn.functional as F

from mindspeed_like.kernels import compiled
from mindspeed_like.kernels.swiglu import swiglu
from mindspeed_like.testing import SavedBytesMeter

MiB = 2**20
WARMUP = 4


def megatron_inline(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Exactly MLP.forward's non-fused gated branch (megatron-core 0.16)."""
    if bias is not None:
        x = x + bias
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


def megatron_fused(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    return bias_swiglu_impl(x, bias)


def ours(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    with common.users_backend():
        return swiglu(x, bias)


def _fwd_bwd(fn, x, bias, grad):
    def step():
        x.grad = None
        if bias is not None:
            bias.grad = None
        fn(x, bias).backward(grad)

    return step


def _saved_mib(fn, x, bias) -> float:
    with SavedBytesMeter() as meter:
        out = fn(x, bias)
    del out
    return meter.bytes / MiB


def _liger(x: torch.Tensor, grad: torch.Tensor):
    """Liger's step on the two halves of ``x`` as separate tensors (its backward writes the input
    gradients into their storage: they are its own copies)."""
    ffn = x.shape[-1] // 2
    a, b = (x.detach()[:, half].clone().requires_grad_() for half in (slice(0, ffn), slice(ffn, None)))

    def step():
        a.grad = b.grad = None
        liger_anchor.silu_mul(a, b).backward(grad)

    return step


def _shapes(quick: bool) -> list[tuple[int, int]]:
    if quick:
        return [(1024, 1024)]
    return [(4096, 4096), (16384, 14336)] if common.on_accelerator() else [(4096, 4096)]


def run(args, results: common.Results) -> None:
    torch.manual_seed(0)
    device = common.device()
    inner = common.calls_per_sample()
    dtypes = [torch.float32, torch.bfloat16]
    for (tokens, ffn), dtype in ((shape, dtype) for shape in _shapes(args.quick) for dtype in dtypes):
        if tokens * ffn > 4096 * 4096 and dtype == torch.float32:
            continue  # the large shape: bf16, as trained
        for with_bias in (False, True):
            x = torch.randn(tokens, 2 * ffn, dtype=dtype, device=device, requires_grad=True)
            bias = torch.randn(2 * ffn, dtype=dtype, device=device, requires_grad=True) if with_bias else None
            grad = torch.randn(tokens, ffn, dtype=dtype, device=device)
            ours_t = common.timed(_fwd_bwd(ours, x, bias, grad), args.repeats, WARMUP, inner=inner)
            ours_s = statistics.median(ours_t)
            ours_mib = _saved_mib(ours, x, bias)
            compiled.set_mode("eager")
            eager_t = common.timed(_fwd_bwd(ours, x, bias, grad), args.repeats, WARMUP, inner=inner)
            eager_s = statistics.median(eager_t)
            compiled.set_mode(None)
            anchor: dict = {"missing": "no bias in Liger's op"} if with_bias else {}
            if not with_bias:
                anchor["missing"] = liger_anchor.unavailable(device) or common.anchor_fails(_liger(x, grad))
                if anchor["missing"] is None:
                    anchor["times"] = common.timed(_liger(x, grad), args.repeats, WARMUP, inner=inner)
            liger_times = anchor.get("times")
            liger_ms = None if liger_times is None else statistics.median(liger_times) * 1e3
            for label, baseline in (("inline", megatron_inline), ("bias_swiglu_impl", megatron_fused)):
                base_t = common.timed(_fwd_bwd(baseline, x, bias, grad), args.repeats, WARMUP, inner=inner)
                base_s = statistics.median(base_t)
                samples = {"megatron": base_t, "ours": ours_t, "ours_eager": eager_t}
                if liger_times is not None:
                    samples["liger"] = liger_times
                results.add(
                    samples=samples,
                    op=f"swiglu{'+bias' if with_bias else ''} vs {label}",
                    dtype=str(dtype).replace("torch.", ""),
                    shape=f"{tokens}x{2 * ffn}",
                    megatron_ms=base_s * 1e3,
                    ours_ms=ours_s * 1e3,
                    ours_eager_ms=eager_s * 1e3,
                    speedup=base_s / ours_s,
                    **common.anchor_columns("liger", liger_ms, ours_s * 1e3, anchor.get("missing")),
                    megatron_saved_MiB=_saved_mib(baseline, x, bias),
                    ours_saved_MiB=ours_mib,
                )


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    results = common.Results("fused_ops_swiglu")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
