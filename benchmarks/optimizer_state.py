"""Bytes of model state per parameter and optimizer step time: megatron's bf16 DistributedOptimizer
(fp32 grads, fp32 masters, fp32 moments) vs its precision-aware optimizer run by
``precision-aware-optimizer`` (bf16 / fp8 moments, bf16 main grads, int16 master remainders).

Measured, not computed: after real training steps (megatron's DDP + ``get_megatron_optimizer``),
the storages behind the DDP param and grad buffers, the optimizer's masters, remainders, moments
and block scales are deduplicated by data pointer and summed on rank 0
(``mindspeed_like.testing.param_bytes``), divided by the model's parameter count. Step time: the
median of ``optimizer.step()`` (reduce-scatter already done by ``finish_grad_sync``; includes the
param all-gather), every case in the same processes as megatron's own path.

    python benchmarks/optimizer_state.py [--quick] [--dp 1 2 4] [--json out.json]
    python benchmarks/optimizer_state.py --curve [--steps 300]   # loss curves per state dtype (DP=1)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import common  # benchmarks/ is the script directory
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
# (label, moments, main grads, remainders); moments None: megatron's default path
CASES = [
    ("megatron (fp32 grads, masters, moments)", None, "fp32", False),
    ("fp32 moments, fp32 grads", "fp32", "fp32", False),
    ("fp32 moments, bf16 grads, remainders", "fp32", "bf16", True),
    ("bf16 moments, fp32 grads", "bf16", "fp32", False),
    ("bf16 moments, bf16 grads, remainders", "bf16", "bf16", True),
    ("fp8 moments, fp32 grads", "fp8", "fp32", False),
    ("fp8 moments, bf16 grads, remainders", "fp8", "bf16", True),
]
TARGETS = {"bf16 moments, bf16 grads, remainders": 7.0, "fp8 moments, bf16 grads, remainders": 6.1}


def model_args(quick: bool) -> dict:
    if quick:
        return dict(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1024)
    return dict(num_layers=4, hidden_size=384, num_attention_heads=6, vocab_size=8192)


def optimizer_fields(moments: str | None, grads: str, remainders: bool) -> dict:
    fields = dict(optimizer="adam")
    if moments is not None:
        fields.update(
            use_precision_aware_optimizer=True,
            exp_avg_dtype=DTYPES[moments],
            exp_avg_sq_dtype=DTYPES[moments],
            main_grads_dtype=DTYPES[grads],
            store_param_remainders=remainders,
        )
    return fields


def state_tensors(model, opt) -> list[torch.Tensor]:
    """Everything that is model state on this rank: param/grad buffers, masters, moments, scales."""
    tensors = []
    for buffer in model.buffers + getattr(model, "expert_parallel_buffers", []):
        tensors += [buffer.param_data, buffer.grad_data]
    inner = opt.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            tensors.append(p)
            tensors += [t for t in inner.state[p].values() if torch.is_tensor(t)]
    for bucket in getattr(inner, "_buckets", {}).values():
        tensors += [s.scales for s in bucket.stores.values() if s.scales is not None]
    return tensors


def measure(quick: bool, steps: int) -> list[dict]:
    """One DP world (this process's): every case, in order, same model and data."""
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, param_bytes, tiny_gpt, train_steps

    rows = []
    for label, moments, grads, remainders in [CASES[0], *CASES]:  # the first run warms up (not reported)
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu")
        init_parallel(seed=1234)
        model = tiny_gpt(bf16=True, seq_length=64, **model_args(quick))
        numel = sum(p.numel() for p in model.parameters())
        box: dict = {}
        times: list[float] = []

        def on_optimizer(wrapped, opt, box=box, times=times):
            box.update(model=wrapped, opt=opt)
            step = opt.step

            def timed():
                start = time.perf_counter()
                out = step()
                times.append(time.perf_counter() - start)
                return out

            opt.step = timed

        train_steps(
            model,
            steps,
            optimizer=optimizer_fields(moments, grads, remainders),
            use_distributed_optimizer=True,
            grad_reduce_in_fp32=grads == "fp32",
            on_optimizer=on_optimizer,
            lr=1e-3,
        )
        nbytes = param_bytes(state_tensors(box["model"], box["opt"]))
        rows.append(
            dict(
                case=label,
                numel=numel,
                bytes_per_param=nbytes / numel,
                step_s=statistics.median(times[1:]),
                step_samples=times[1:],
            )
        )
        destroy_parallel()
    return rows[1:]


def curve(steps: int, quick: bool) -> dict[str, list[float]]:
    """DP=1 loss curves on real text (megatron-core's own sources, byte tokens) per state dtype."""
    import mindspeed_like
    from mindspeed_like.demo_data import megatron_source_bytes, sample_windows
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    tokens = megatron_source_bytes()
    gen = torch.Generator().manual_seed(1234)
    data = torch.stack([sample_windows(tokens, 8, 64, gen) for _ in range(steps)])
    out = {}
    for name, moments, grads, remainders in (
        ("fp32 states", "fp32", "fp32", False),
        ("bf16 moments+grads, remainders", "bf16", "bf16", True),
        ("fp16 moments+grads, remainders", "fp16", "bf16", True),
        ("fp8 moments+grads, remainders", "fp8", "bf16", True),
    ):
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu")
        init_parallel(seed=1234)
        model = tiny_gpt(bf16=True, seq_length=64, vocab_size=256, num_layers=2, hidden_size=128, num_attention_heads=4)
        out[name] = train_steps(
            model,
            steps,
            optimizer=optimizer_fields(moments, grads, remainders),
            use_distributed_optimizer=True,
            grad_reduce_in_fp32=grads == "fp32",
            micro_batch_size=8,
            data=data,
            lr=3e-3,
        )
        destroy_parallel()
    return out


def main() -> None:
    p = common.parser(
        __doc__.splitlines()[0],
        devices=("cpu",),
        why=(
            "bytes per parameter are exact storage sizes, the same on every device (its DP cases need a"
            " device per rank); the optimizer step's time on a GPU: benchmarks/optimizer_step.py"
        ),
    )
    p.add_argument("--dp", type=common.positive_int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--steps", type=common.positive_int, default=None, help="training steps per case (default 4; --curve: 300)"
    )
    p.add_argument("--curve", action="store_true", help="300-step loss curves per state dtype instead")
    args = p.parse_args()
    sys.path.insert(0, HERE)
    from mindspeed_like.testing import run_distributed

    if args.curve:
        if not args.record:
            common.rename("optimizer_state-curve" + ("-quick" if args.quick else ""))
        steps = args.steps or 300
        curves = curve(steps, args.quick)
        base = curves["fp32 states"]
        res = common.Results(f"loss curves, {steps} steps, DP=1, bf16 tiny GPT on megatron-core's sources")
        for name, losses in curves.items():
            tail = sum(losses[-20:]) / 20
            ref = sum(base[-20:]) / 20
            res.add(state=name, first=losses[0], final_mean20=tail, vs_fp32=tail / ref - 1)
        res.print_table()
        res.write_json(args.json, curves=curves)
        return
    steps = args.steps or 4
    res = common.Results("model state bytes/param and optimizer step time, bf16 GPT, DistributedOptimizer")
    for dp in args.dp:
        rows = run_distributed(measure, dp, args.quick, steps, timeout=3600)[0]
        base = rows[0]
        for row in rows:
            target = TARGETS.get(row["case"])
            res.add(
                samples={"optimizer_step": row["step_samples"]},
                DP=dp,
                case=row["case"],
                params=row["numel"],
                B_per_param=round(row["bytes_per_param"], 3),
                vs_megatron=row["bytes_per_param"] / base["bytes_per_param"],
                step_ms=1e3 * row["step_s"],
                step_vs_megatron=row["step_s"] / base["step_s"],
                target="" if target is None or dp != 2 else f"<= {target}",
            )
    res.print_table()
    res.write_json(args.json)


if __name__ == "__main__":
    main()
