"""Bytes held by model params + fp32 master params (+ residuals and side tables) per parameter,
megatron's bf16 mixed precision vs ``--reuse-fp32-param``, for a GPT of ~100M parameters on CPU.

Measured, not computed: after one real training step (megatron's DDP and
``get_megatron_optimizer``), the storages behind every model param, every master param and
the feature's side tables are deduplicated by data pointer and summed
(``mindspeed_like.testing.param_bytes``). Also measured: the peak transient workspace of the
in-place conversions around one step (PyTorch profiler allocation events,
``mindspeed_like.testing.workspace``) and the median time of ``optimizer.step()``.

Cases: Float16OptimizerWithFloat16Params (DP=1, DP=2) and DistributedOptimizer (DP=2), flag
off and on in the same process. DP=2 runs in two gloo processes.

    python benchmarks/param_memory.py [--quick] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import gc
import statistics

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import torch

MiB = 2**20
TARGET = 4.0  # B/param: the physical floor for an exact fp32 master


def model_args(quick: bool) -> dict:
    if quick:  # ~9M params
        return dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=8192)
    # 8 x 9.4M (attention 4h^2 + gated MLP 3*h*ffn) + 2 x 16384 x 768 (untied embedding/output) = 101M
    return dict(num_layers=8, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, vocab_size=16384)


def _held_tensors(opt) -> list[torch.Tensor]:
    """Model params + master params (DistributedOptimizer: this rank's master shards)."""
    tensors: list[torch.Tensor] = []
    for inner in getattr(opt, "chained_optimizers", [opt]):
        model_groups = getattr(inner, "float16_groups", None) or inner.model_float16_groups
        main_groups = getattr(inner, "fp32_from_float16_groups", None) or inner.shard_fp32_from_float16_groups
        tensors += [p for g in model_groups for p in g] + [p for g in main_groups for p in g if p is not None]
    return tensors


def _extra_bytes(opt) -> int:
    """The feature's own tensors outside the param storages (side tables, residual buffers)."""
    from mindspeed_like.features.reuse_fp32_param import state_of

    total = 0
    for inner in getattr(opt, "chained_optimizers", [opt]):
        state = state_of(inner)
        if state is not None:
            total += state.extra_bytes()
    return total


def _conversion_workspace(opt) -> int:
    from mindspeed_like.features.reuse_fp32_param import state_of
    from mindspeed_like.testing.workspace import peak_extra_bytes

    peak = 0
    for inner in getattr(opt, "chained_optimizers", [opt]):
        state = state_of(inner)
        if state is not None:
            peak = max(peak, peak_extra_bytes(lambda state=state: (state.to_fp32(), state.to_split())))
    return peak


def measure(flag: bool, distributed: bool, quick: bool, repeats: int) -> dict:
    """One case in this process (DP = the world size): bytes per param and step time."""
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, param_bytes, tiny_gpt, train_steps

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", reuse_fp32_param=flag)
    init_parallel(seed=1234)
    box: dict = {}
    model = tiny_gpt(bf16=True, seq_length=32, **model_args(quick))
    train_steps(
        model,
        1,
        micro_batch_size=1,
        use_distributed_optimizer=distributed,
        on_optimizer=lambda m, o: box.update(opt=o),
    )
    opt = box["opt"]
    numel = sum(p.numel() for p in model.parameters())  # every param of the model, all bf16
    tensors = _held_tensors(opt)
    held = param_bytes(tensors) + _extra_bytes(opt)
    workspace = _conversion_workspace(opt) if flag else 0
    step_times = common.timed(opt.step, repeats, warmup=0)  # grads kept from the last step
    box.clear()
    del opt, tensors, model
    gc.collect()
    destroy_parallel()
    mindspeed_like.reset()
    return dict(
        numel=numel, bytes=held, workspace=workspace, step_s=statistics.median(step_times), step_times=step_times
    )


def _both(distributed: bool, quick: bool, repeats: int) -> dict:
    return {flag: measure(flag, distributed, quick, repeats) for flag in (False, True)}


def run(args, results: common.Results) -> None:
    from mindspeed_like.testing import run_distributed

    cases = [("Float16Optimizer", False, 1), ("Float16Optimizer", False, 2), ("DistributedOptimizer", True, 2)]
    for name, distributed, dp in cases:
        if dp == 1:
            both = _both(distributed, args.quick, args.repeats)
        else:
            both = run_distributed(_both, dp, distributed, args.quick, args.repeats, timeout=3600)[0]
        base, ours = both[False], both[True]
        n = base["numel"]
        row = dict(
            optimizer=name,
            DP=dp,
            params_M=n / 1e6,
            megatron_B_per_param=base["bytes"] / n,
            ours_B_per_param=ours["bytes"] / n,
            saved_MiB=(base["bytes"] - ours["bytes"]) / MiB,
            workspace_MiB=ours["workspace"] / MiB,
            step_ratio=ours["step_s"] / base["step_s"],
        )
        if name == "Float16Optimizer":
            row["target"] = f"<= {TARGET:.2f}: " + ("met" if row["ours_B_per_param"] <= TARGET + 1e-3 else "missed")
        else:
            row["target"] = f"saves {2 / dp:.2f} B/param: " + (
                "met" if row["megatron_B_per_param"] - row["ours_B_per_param"] >= 2 / dp - 1e-3 else "missed"
            )
        results.add(samples={"megatron_step": base["step_times"], "ours_step": ours["step_times"]}, **row)


def main() -> None:
    args = common.parser(
        __doc__.splitlines()[0],
        devices=("cpu",),
        why=(
            "bytes per parameter are exact storage sizes, the same on every device (its DP=2 cases need"
            " a device per rank); the optimizer step's time on a GPU: benchmarks/optimizer_step.py"
        ),
    ).parse_args()
    results = common.Results("param_memory")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
