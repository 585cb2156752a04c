"""Core attention fwd+bwd: megatron-core's local ``DotProductAttention`` vs ours (``--use-flash-attn``,
portable backend), causal, batch 1, 16 heads of 128, in one run on the same module and inputs.

Time: median of ``--repeats`` forward+backward passes. Memory: peak bytes allocated during one
forward+backward (torch.profiler with ``profile_memory``: every tensor created and destroyed in
the pass, summed in time order; not RSS). The inputs exist before the pass and are not counted;
megatron's score buffer (``GlobalMemoryBuffer``, which it keeps between calls) is re-created for
the profiled pass so it is counted. Targets (checked here, at s = 4096): >= 10x less peak
attention memory, >= 2x faster in fp32.

On a GPU (``--device cuda``) the anchors are torch's own SDPA kernels on the same q, k, v (as
``[b, n, s, d]``, ``is_causal=True``), each forced with ``torch.nn.attention.sdpa_kernel``: flash,
cuDNN, memory-efficient and math (``sdpa_<backend>_ms``; a backend that refuses the shape or dtype
says so in its column, e.g. flash has no fp32). Ours is SDPA too on CUDA (kernels/flash_attention.py,
the portable backend) with torch's own choice of kernel, behind megatron's layout.

With ``--attention-dropout P`` both arms train with megatron's attention dropout (its default is
0.1) and the record is ``attention-dropout``: on a CPU host torch's flash kernel takes no dropout, so
ours runs the blocked kernel (kernels/blocked_attention.py), megatron's its own baddbmm, dropout and
bmm. The targets above are for the no-dropout record only.

    python benchmarks/attention.py [--quick] [--repeats N] [--device cuda] [--json out.json]
    python benchmarks/attention.py --attention-dropout 0.1 --lengths 1024 2048
"""

from __future__ import annotations

import common  # benchmarks/ is the script directory (as in fused_ops_swiglu.py)
import torch

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, gpt_config, init_parallel

MiB = 2**20
HEADS, HEAD_DIM = 16, 128
TARGET_SEQ, TARGET_MEMORY, TARGET_SPEEDUP = 4096, 10.0, 2.0


def _module(dtype: torch.dtype, dropout: float = 0.0):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = gpt_config(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        attention_dropout=dropout,
        bf16=dtype == torch.bfloat16,
    )
    return DotProductAttention(config, 1, AttnMaskType.causal, "self").train()


def _fresh_megatron_buffer() -> None:
    """Drop megatron's cached score buffer so the profiled pass allocates (and counts) it."""
    from megatron.core import parallel_state

    parallel_state._GLOBAL_MEMORY_BUFFER = None
    parallel_state._set_global_memory_buffer()


def _step(module, q, k, v, grad):
    def run():
        for t in (q, k, v):
            t.grad = None
        module(q, k, v, None).backward(grad)

    return run


SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")


def _sdpa_step(backend: str, q, k, v, grad):
    """torch's SDPA with one kernel forced, on views of the same q, k, v as ``[b, n, s, d]``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    grad_bnsd = grad.view(grad.shape[0], grad.shape[1], HEADS, HEAD_DIM).permute(1, 2, 0, 3)

    def run():
        for t in (q, k, v):
            t.grad = None
        with sdpa_kernel([kernel]):
            out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        out.backward(grad_bnsd)

    return run


def _sdpa_anchors(q, k, v, grad, repeats: int) -> dict:
    """Each SDPA kernel's ms (on an accelerator), or why it did not run."""
    if not common.on_accelerator():
        return {}
    columns = {}
    for backend in SDPA_BACKENDS:
        step = _sdpa_step(backend, q, k, v, grad)
        refused = common.anchor_fails(step)
        columns[f"sdpa_{backend}_ms"] = (
            refused.replace("failed: ", "refused: ")[:60]
            if refused
            else common.median_seconds(step, repeats, label=f"sdpa_{backend}", inner=common.calls_per_sample()) * 1e3
        )
    return columns


def run(args, results: common.Results) -> None:
    mindspeed_like.reset()
    common.configure()
    common.init_process_group()
    init_parallel(seed=0)
    device = common.device()
    try:
        lengths = args.lengths or ((256, 512) if args.quick else (1024, 2048, 4096))
        for dtype in (torch.float32, torch.bfloat16):
            module = _module(dtype, args.attention_dropout).to(device)
            for s in lengths:
                gen = torch.Generator().manual_seed(s)
                q, k, v = (
                    torch.randn(s, 1, HEADS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_() for _ in "qkv"
                )
                grad = torch.randn(s, 1, HEADS * HEAD_DIM, generator=gen).to(device, dtype)
                step = _step(module, q, k, v, grad)
                figures = {}
                for name, on in (("megatron", False), ("ours", True)):
                    mindspeed_like.configure(use_flash_attn=on)
                    with common.users_backend():
                        seconds = common.median_seconds(step, args.repeats, label=name, inner=common.calls_per_sample())
                        if not on:
                            _fresh_megatron_buffer()
                        figures[name] = (seconds, common.peak_bytes(step))
                (base_s, base_b), (ours_s, ours_b) = figures["megatron"], figures["ours"]
                results.add(
                    s=s,
                    dtype=str(dtype).replace("torch.", ""),
                    megatron_ms=base_s * 1e3,
                    ours_ms=ours_s * 1e3,
                    speedup=base_s / ours_s,
                    megatron_peak_MiB=base_b / MiB,
                    ours_peak_MiB=ours_b / MiB,
                    memory_ratio=base_b / max(ours_b, 1),
                    # torch's SDPA anchors are the no-dropout record's (they run without dropout)
                    **(_sdpa_anchors(q, k, v, grad, args.repeats) if not args.attention_dropout else {}),
                )
                print("measured:", results.rows[-1], flush=True)  # long runs: progress before the table
    finally:
        mindspeed_like.configure(use_flash_attn=False)
        destroy_parallel()
        mindspeed_like.reset()


def check_targets(results: common.Results, dropout: float = 0.0) -> list[str]:
    if dropout:
        return [f"attention dropout {dropout:g}: the targets are the no-dropout record's (not checked here)"]
    lines = []
    for row in results.rows:
        if row["s"] != TARGET_SEQ:
            continue
        memory_ok = row["memory_ratio"] >= TARGET_MEMORY
        lines.append(
            f"s={row['s']} {row['dtype']}: peak attention memory {row['memory_ratio']:.1f}x less "
            f"(target >= {TARGET_MEMORY:g}x): {'met' if memory_ok else 'missed'}"
        )
        if row["dtype"] == "float32":
            speed_ok = row["speedup"] >= TARGET_SPEEDUP
            lines.append(
                f"s={row['s']} float32 causal: {row['speedup']:.2f}x faster (target >= {TARGET_SPEEDUP:g}x): "
                f"{'met' if speed_ok else 'missed'}"
            )
    return lines or [f"targets are checked at s={TARGET_SEQ} (not run with --quick)"]


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=common.positive_int, nargs="+", help="sequence lengths (default 1024 2048 4096)"
    )
    parser.add_argument(
        "--attention-dropout",
        type=float,
        default=0.0,
        help="megatron's attention dropout in both arms (record: attention-dropout); default 0",
    )
    args = parser.parse_args()
    if not 0.0 <= args.attention_dropout < 1.0:
        parser.error(f"--attention-dropout must be in [0, 1), got {args.attention_dropout}")
    if args.attention_dropout:
        common.rename("attention-dropout")
    results = common.Results("attention")
    run(args, results)
    results.print_table()
    for line in check_targets(results, args.attention_dropout):
        print(line)
    results.write_json(args.json)


if __name__ == "__main__":
    main()
