"""Context parallelism without TransformerEngine: per-rank memory at CP = 1, 2, 4 for the same total
sequence, the longest sequence a rank trains within a fixed memory budget, ring overlap on a
simulated link, and ring vs Ulysses vs all-gather-KV step time. Every CP size runs in its own
processes (CP ranks; one thread each); figures are rank 0's.

Model: megatron-core's local-spec GPT (2 layers, hidden 256, 4 heads, RoPE, fp32) with our flash
attention at CP=1 (megatron's own attention keeps an s x s matrix per head: CP's gain would be
exaggerated against it). Memory: bytes saved for backward in one forward (``SavedBytesMeter``)
and the peak resident memory a forward+backward adds (the process's peak RSS minus its RSS before
the step, after a warm-up step; each figure in fresh processes: torch's profiler memory timeline
rejects some of these graphs).
Targets: saved bytes <= 0.55x at CP=2 and <= 0.3x at CP=4; >= 3.5x longer sequence at CP=4;
>= 60% of the ring's send/recv time hidden behind block attention.

    python benchmarks/context_parallel.py [--quick] [--seq N] [--budget-mib M] [--json out.json]
"""

from __future__ import annotations

import statistics
import time

import common  # benchmarks/ is the script directory
import torch

import mindspeed_like
from mindspeed_like.testing import SavedBytesMeter, destroy_parallel, init_parallel, run_distributed, tiny_gpt

MiB = 2**20
MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, wrap_float16=False)


def _model_and_batch(cp: int, seq: int, algo: str):
    from mindspeed_like.testing.training import batch_on_this_cp_rank

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", use_flash_attn=True, context_parallel_algo=algo)
    init_parallel(seed=0, context_parallel_size=cp)
    model = tiny_gpt(context_parallel_size=cp, seq_length=seq, **MODEL)
    gen = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, 256, (1, seq), generator=gen)
    batch = {"tokens": tokens, "labels": tokens, "position_ids": torch.arange(seq).unsqueeze(0)}
    batch = batch_on_this_cp_rank(batch) if cp > 1 else batch
    return model, batch


def _step(model, batch):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        loss.backward()

    return step


def _rss_peak_bytes(step) -> int:
    """Resident bytes the step adds at its peak (the warm-up step already set the high-water
    mark of everything that stays; large tensors are mmapped and given back when freed)."""
    import resource

    import psutil

    before = psutil.Process().memory_info().rss
    step()
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)


def memory(cp: int, seq: int, algo: str = "megatron_cp_algo") -> dict:
    model, batch = _model_and_batch(cp, seq, algo)
    step = _step(model, batch)
    step()
    with SavedBytesMeter() as meter:
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
    del loss
    figures = dict(cp=cp, seq=seq, saved_MiB=meter.bytes / MiB, peak_MiB=_rss_peak_bytes(step) / MiB)
    destroy_parallel()
    mindspeed_like.reset()
    return figures


def longest(cp: int, budget_mib: float, start: int, limit: int) -> dict:
    """The longest power-of-two multiple of ``start`` whose saved-for-backward bytes per rank fit
    the budget (each length measured in fresh processes)."""
    fits, seq = 0, start
    while seq <= limit:
        if _on(cp, memory, seq)["saved_MiB"] > budget_mib:
            break
        fits, seq = seq, seq * 2
    return dict(cp=cp, budget_MiB=budget_mib, longest_seq=fits)


def timing(cp: int, seq: int, algo: str, repeats: int, bandwidth: float | None) -> dict:
    from mindspeed_like.testing.simulated_link import simulated_link

    model, batch = _model_and_batch(cp, seq, algo)
    step = _step(model, batch)
    step()
    if bandwidth is None:
        times = common.timed(step, repeats)
        seconds = statistics.median(times)
        figures = dict(cp=cp, algo=algo, seq=seq, step_ms=seconds * 1e3, samples={"step": times})
    else:
        with simulated_link(bandwidth) as stats:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            seconds = sum(times) / repeats
        hidden = 1 - stats.blocked_seconds / stats.transfer_seconds if stats.transfer_seconds else 0.0
        figures = dict(
            cp=cp,
            algo=algo,
            seq=seq,
            step_ms=seconds * 1e3,
            link_ms=stats.transfer_seconds / repeats * 1e3,
            exposed_ms=stats.blocked_seconds / repeats * 1e3,
            hidden_share=hidden,
            samples={"step_with_link": times},  # each step's seconds, for the record (not printed)
        )
    destroy_parallel()
    mindspeed_like.reset()
    return figures


def _on(cp: int, fn, *args):
    """``fn(cp, *args)`` on rank 0 of ``cp`` fresh processes (CP=1 too: the same conditions)."""
    return run_distributed(fn, cp, cp, *args, timeout=7200)[0]


def main() -> None:
    parser = common.parser(
        __doc__.splitlines()[0],
        devices=("cpu",),
        why=(
            "its CP ranks are CPU processes over gloo; on GPUs context parallelism needs one device per"
            " CP rank, not measured on a one-GPU machine"
        ),
    )
    parser.add_argument(
        "--seq", type=common.positive_int, default=8192, help="total sequence for the memory table (default 8192)"
    )
    parser.add_argument(
        "--budget-mib", type=common.above(0), default=256.0, help="per-rank saved-for-backward budget (default 256 MiB)"
    )
    parser.add_argument("--bandwidth-gbs", type=common.above(0), default=0.5, help="simulated link, GB/s (default 0.5)")
    args = parser.parse_args()
    seq = 2048 if args.quick else args.seq
    sizes = (1, 2) if args.quick else (1, 2, 4)

    table = common.Results("context_parallel memory (same total sequence)")
    for cp in sizes:
        table.add(**_on(cp, memory, seq))
    base = table.rows[0]
    for row in table.rows:
        row["saved_ratio"] = row["saved_MiB"] / base["saved_MiB"]
        row["peak_ratio"] = row["peak_MiB"] / base["peak_MiB"]
    table.print_table()

    reach = common.Results("context_parallel longest sequence within the budget")
    limit = 8192 if args.quick else 65536
    for cp in sizes:
        reach.add(**longest(cp, args.budget_mib, 1024, limit))
    for row in reach.rows:
        row["vs_cp1"] = row["longest_seq"] / max(reach.rows[0]["longest_seq"], 1)
    reach.print_table()

    speed = common.Results("context_parallel step time, CP=2")
    for algo in ("megatron_cp_algo", "ulysses_cp_algo", "kvallgather_cp_algo"):
        speed.add(**_on(2, timing, seq, algo, args.repeats, None))
    speed.add(**_on(2, timing, seq, "megatron_cp_algo", args.repeats, args.bandwidth_gbs * 1e9))
    speed.print_table(["cp", "algo", "seq", "step_ms", "link_ms", "exposed_ms", "hidden_share"])

    lines = []
    for row in table.rows[1:]:
        target = 0.55 if row["cp"] == 2 else 0.3
        met = row["saved_ratio"] <= target
        verdict = "met" if met else "missed"
        lines.append(f"CP={row['cp']}: saved {row['saved_ratio']:.2f}x of CP=1 (target <= {target}): {verdict}")
    if len(reach.rows) > 2:
        ratio = reach.rows[2]["vs_cp1"]
        verdict = "met" if ratio >= 3.5 else "missed"
        lines.append(f"CP=4: {ratio:.1f}x longer sequence in {args.budget_mib:g} MiB (target >= 3.5x): {verdict}")
    hidden = speed.rows[-1]["hidden_share"]
    lines.append(
        f"ring overlap: {hidden:.0%} of the link time hidden (target >= 60%): {'met' if hidden >= 0.6 else 'missed'}"
    )
    for line in lines:
        print(line)
    table.write_json(args.json, longest=reach.rows, speed=speed.rows, targets=lines)


if __name__ == "__main__":
    main()
