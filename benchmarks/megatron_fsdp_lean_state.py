"""megatron-fsdp-lean-state's own cost: the training step and the optimizer step of compare's layout
(llama preset, Megatron-FSDP ``optim_grads_params``, bf16, DP=2 gloo ranks) at ``--optimization-level 2``
with and without this one feature (``--no-megatron-fsdp-lean-state``: every other level-2 feature is on in
both arms), in the same two processes, alternating.

Each repeat trains megatron's buffers (the feature off), then the lean ones (on), from the same seed on the
same batches: ``--warmup`` untimed steps, then ``--steps`` timed ones. Times, per step (rank 0's clock):

- ``step``: the whole training step (forward, backward, Megatron-FSDP's reduce-scatter, optimizer step);
- ``optimizer``: megatron's ``DistributedOptimizer.step`` (the gradient hand-over, grad norm and clipping,
  the Adam, megatron's main-to-model weight copy: the lean layout has no main weights to copy);
- ``adam``: the inner torch optimizer's ``step`` alone (torch's AdamW over the fp32 main-weight shard vs
  the precision-aware Adam over the bf16 shard + int16 remainders, bf16 moments);
- ``optimizer, again``: after the last step, megatron's optimizer step called ``--again`` more times on the
  last gradients (no forward or backward between): many short samples of the step alone.

Each repeat's arms run in turn (megatron first in odd repeats, lean first in even ones). ``ratio``: lean /
megatron of each repeat's medians, ``min_ratio``: of each repeat's fastest step (on a host loaded by others
a step's time is its own work plus whatever the scheduler adds; the fastest is the least disturbed); the table
shows the median over repeats and the load average the host saw. CPU figures are a proxy (2 gloo ranks on
one host, one thread each).

    python benchmarks/megatron_fsdp_lean_state.py [--quick] [--repeats 3] [--steps 4] [--warmup 2]
"""

from __future__ import annotations

import os
import statistics
import time

import common  # benchmarks/ is the script directory

SIZE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256)  # compare's defaults
MICRO_BATCH = 4  # compare's default --micro-batch-size
KINDS = ("step", "optimizer", "adam", "optimizer, again")


def _arm(lean: bool, size: dict, steps: int, warmup: int, micro_batch: int, again: int) -> dict:
    """One arm in this rank's process: seconds of each timed step, by kind, and the losses."""
    import mindspeed_like
    from mindspeed_like.compare.presets import PRESETS
    from mindspeed_like.runtime import enabled_feature_names
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
    from mindspeed_like.testing.training import train_steps

    config = mindspeed_like.configure(device="cpu", optimization_level=2, megatron_fsdp_lean_state=lean)
    assert ("megatron-fsdp-lean-state" in enabled_feature_names(config)) == lean
    init_parallel(seed=1234)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS if kind != "optimizer, again"}
    stamps: list[float] = []
    held: dict = {}

    def clocked(fn, kind):
        def run(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[kind].append(time.perf_counter() - begin)

        return run

    def on_optimizer(model, optimizer) -> None:
        held["optimizer"] = type(optimizer.optimizer).__name__
        held["step"] = optimizer.step
        optimizer.optimizer.step = clocked(optimizer.optimizer.step, "adam")
        optimizer.step = clocked(optimizer.step, "optimizer")
        stamps.append(time.perf_counter())

    def on_step(step: int, loss: float) -> None:
        stamps.append(time.perf_counter())

    try:
        args = dict(PRESETS["llama"].model_args(**size), bf16=True)
        model = tiny_gpt(**args)
        losses = train_steps(
            model,
            warmup + steps,
            lr=3e-3,
            micro_batch_size=micro_batch,
            seq_length=size["seq_length"],
            data_parallel="megatron_fsdp",
            ddp_options=dict(data_parallel_sharding_strategy="optim_grads_params"),
            on_optimizer=on_optimizer,
            on_step=on_step,
        )
        again_times, adam_steps = [], len(times["adam"])
        for _ in range(again):
            begin = time.perf_counter()
            held["step"]()
            again_times.append(time.perf_counter() - begin)
        del times["adam"][adam_steps:]  # the clocked Adam inside these calls is not a training step's
    finally:
        destroy_parallel()
    times["step"] = [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(
        optimizer_class=held["optimizer"],
        losses=losses,
        load=os.getloadavg()[0],
        **{kind: values[warmup:] for kind, values in times.items()},
        **{"optimizer, again": again_times},
    )


def _alternating(repeats: int, size: dict, steps: int, warmup: int, micro_batch: int, again: int) -> list[dict]:
    """megatron's buffers, then the lean ones, ``repeats`` times, in these processes."""
    arms = (("megatron", False), ("lean", True))
    return [
        {
            name: _arm(lean, size, steps, warmup, micro_batch, again)
            for name, lean in (arms if r % 2 == 0 else arms[::-1])
        }
        for r in range(repeats)
    ]


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0], devices=("cpu",), why="two gloo ranks on this host")
    p.set_defaults(repeats=3)
    p.add_argument("--steps", type=common.positive_int, default=8, help="timed steps per arm and repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--micro-batch-size", type=common.positive_int, default=MICRO_BATCH)
    p.add_argument("--again", type=int, default=20, help="optimizer steps timed again after the last step")
    common.add_model_size_options(p, SIZE)
    args = p.parse_args()
    size = common.model_size(args, SIZE)
    if args.quick:
        args.repeats, args.steps, args.warmup, args.again = 1, 2, 1, 3
    from mindspeed_like.megatron_version import megatron_core_version
    from mindspeed_like.testing import run_distributed

    load_before = os.getloadavg()[0]
    runs = run_distributed(
        _alternating, 2, args.repeats, size, args.steps, args.warmup, args.micro_batch_size, args.again, timeout=3600
    )[0]
    load_after = os.getloadavg()[0]
    results = common.Results("megatron_fsdp_lean_state")
    for kind in KINDS:
        medians = {arm: [statistics.median(run[arm][kind]) for run in runs] for arm in ("megatron", "lean")}
        ratios = [lean / megatron for megatron, lean in zip(medians["megatron"], medians["lean"])]
        fastest = {arm: [min(run[arm][kind]) for run in runs] for arm in ("megatron", "lean")}
        min_ratios = [lean / megatron for megatron, lean in zip(fastest["megatron"], fastest["lean"])]
        results.add(
            samples={f"{arm} r{i + 1}": run[arm][kind] for i, run in enumerate(runs) for arm in ("megatron", "lean")},
            kind=kind,
            megatron_ms=statistics.median(medians["megatron"]) * 1e3,
            lean_ms=statistics.median(medians["lean"]) * 1e3,
            ratio=statistics.median(ratios),
            ratio_per_repeat=[round(r, 3) for r in ratios],
            megatron_min_ms=statistics.median(fastest["megatron"]) * 1e3,
            lean_min_ms=statistics.median(fastest["lean"]) * 1e3,
            min_ratio=statistics.median(min_ratios),
            min_ratio_per_repeat=[round(r, 3) for r in min_ratios],
        )
    loads = [run[arm]["load"] for run in runs for arm in ("megatron", "lean")]
    losses = {arm: runs[0][arm]["losses"] for arm in ("megatron", "lean")}
    print(
        f"megatron-core {megatron_core_version()}, llama {size}, micro-batch {args.micro_batch_size}, DP 2 "
        f"optim_grads_params bf16, level 2 with / without megatron-fsdp-lean-state; {args.repeats} repeats x "
        f"{args.steps} timed steps; optimizers {runs[0]['megatron']['optimizer_class']} / "
        f"{runs[0]['lean']['optimizer_class']}"
    )
    print(
        f"load average (1 min): {load_before:.1f} at start, {load_after:.1f} at end, "
        f"arms {min(loads):.1f}-{max(loads):.1f}"
    )
    print(f"losses megatron {losses['megatron']}\n       lean     {losses['lean']}")
    results.print_table()
    common.write(
        args.json,
        megatron_core=str(megatron_core_version()),
        size=size,
        load_average={"start": load_before, "end": load_after, "arms": loads},
        losses=losses,
    )


if __name__ == "__main__":
    main()
