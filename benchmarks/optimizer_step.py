"""The bf16 optimizer step alone: megatron's own vs reuse-fp32-param's and the precision-aware
optimizer's, on the device (``--device``), with a bitwise check of what each step leaves.

The model is the llama preset's GPT (``--quick``: tiny; default: 8 layers, hidden 2048, ~350M
parameters, the size of the issue's compare run); megatron's DDP (fp32 main grads) and
``get_megatron_optimizer`` (Adam, lr 1e-4, weight decay 0.01, clip-grad 1.0: the grad-norm is part
of the step) build the optimizer as Megatron-LM does. Every case starts from the same weights (same
seed) and gets the same gradients (seeded, written into the DDP grad buffer), then ``--steps``
optimizer steps: the first ``WARMUP`` untimed, the rest timed one by one, the device synchronised
around each (``step_ms``: the median).

Cases (``optimizer``: megatron's class; ``vs`` the case it is compared with):

- ``Float16``: megatron's Float16OptimizerWithFloat16Params, then with ``--reuse-fp32-param``;
- ``DistributedOptimizer``: megatron's (fp32 masters and moments), then megatron's precision-aware
  optimizer run by ``precision-aware-optimizer`` with fp32 moments and main grads (the same math),
  and with bf16 moments, bf16 main grads and int16 master remainders (the memory mode: other
  numbers by design, no bitwise claim). reuse-fp32-param's DistributedOptimizer path needs DP >= 2
  (at DP=1 it keeps megatron's masters, and says so): benchmarks/param_memory.py measures it.

``bitwise``: after the same steps, the bf16 weights, Adam's moments and (Float16 optimizer) the
fp32 masters as megatron's state_dict writes them equal the compared case's bit for bit
(``yes``/``NO``; ``-`` where the case changes the numbers by design). ``step_vs`` = this case's
step time / the compared case's.

    python benchmarks/optimizer_step.py [--quick] [--device cuda] [--steps N]
"""

from __future__ import annotations

import gc
import statistics
import time

import common  # benchmarks/ is the script directory
import torch

WARMUP = 2
PRESET_SIZE = dict(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=64)
QUICK_SIZE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
# (case, megatron optimizer, feature flags, optimizer config fields, compared with, bitwise expected)
CASES = [
    ("megatron Float16", "Float16", {}, {}, None, None),
    ("reuse-fp32-param", "Float16", {"reuse_fp32_param": True}, {}, "megatron Float16", True),
    ("megatron DistributedOptimizer", "DistributedOptimizer", {}, {}, None, None),
    (
        "precision-aware fp32 moments",
        "DistributedOptimizer",
        {},
        dict(
            use_precision_aware_optimizer=True, exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32", main_grads_dtype="fp32"
        ),
        "megatron DistributedOptimizer",
        True,
    ),
    (
        "precision-aware bf16 moments, bf16 grads, remainders",
        "DistributedOptimizer",
        {},
        dict(
            use_precision_aware_optimizer=True,
            exp_avg_dtype="bf16",
            exp_avg_sq_dtype="bf16",
            main_grads_dtype="bf16",
            store_param_remainders=True,
        ),
        "megatron DistributedOptimizer",
        False,
    ),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _optimizer_config(distributed: bool, fields: dict):
    from megatron.core.optimizer import OptimizerConfig

    values = dict(lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
    values.update({k: DTYPES.get(v, v) if isinstance(v, str) else v for k, v in fields.items()})
    return OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=distributed, **values)


def _inner(opt) -> list:
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def _state(opt, model) -> dict[str, list[torch.Tensor]]:
    """What a step leaves, as bit patterns on the host: bf16 weights, fp32 masters (state_dict's),
    Adam's moments in parameter order."""
    weights = [p.detach().view(torch.int16).cpu() for p in model.parameters()]
    masters, moments = [], []
    for inner in _inner(opt):
        if hasattr(inner, "fp32_from_float16_groups"):
            state = inner.state_dict()
            masters += [p.detach().view(torch.int32).cpu() for g in state["fp32_from_fp16_params"] for p in g]
        torch_opt = getattr(inner, "optimizer", None)
        if torch_opt is not None:
            for group in torch_opt.param_groups:
                for p in group["params"]:
                    for key in ("exp_avg", "exp_avg_sq"):
                        value = torch_opt.state.get(p, {}).get(key)
                        if isinstance(value, torch.Tensor):
                            moments.append(value.detach().float().cpu())
    return {"weights": weights, "masters": masters, "moments": moments}


def _bitwise(a: dict, b: dict) -> bool:
    return all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in ("weights", "masters")
    ) and all(torch.equal(x, y) for x, y in zip(a["moments"], b["moments"]))


def run_case(size: dict, flags: dict, fields: dict, distributed: bool, steps: int) -> dict:
    """One case in this process: build, same grads, ``steps`` steps; its times and its state."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    import mindspeed_like
    from mindspeed_like.compare.presets import PRESETS
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt

    device = common.device()
    mindspeed_like.reset()
    common.configure(**flags)
    common.init_process_group()
    init_parallel(seed=1234)
    args = PRESETS["llama"].model_args(**size)
    # on an accelerator megatron initializes on the device (fast, seeded by its CUDA RNG tracker)
    model = tiny_gpt(bf16=True, use_cpu_initialization=device.type == "cpu", **args).to(device)
    grads_fp32 = fields.get("main_grads_dtype", "fp32") == "fp32"
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=grads_fp32, use_distributed_optimizer=distributed),
        module=model,
    )
    opt = get_megatron_optimizer(_optimizer_config(distributed, fields), [ddp])
    generator = torch.Generator().manual_seed(7)
    for param in ddp.parameters():  # the same gradients in every case, in the DDP grad buffer
        param.main_grad.copy_(torch.randn(param.shape, generator=generator).mul_(1e-2))
    times = []
    for step in range(steps):
        common.sync()
        start = time.perf_counter()
        opt.step()
        common.sync()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    state = _state(opt, ddp)
    numel = sum(p.numel() for p in model.parameters())
    del opt, ddp, model
    destroy_parallel()
    mindspeed_like.reset()
    gc.collect()
    if device.type != "cpu":
        getattr(torch, device.type).empty_cache()
    return {"times": times, "state": state, "numel": numel}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--steps",
        type=common.positive_int,
        default=None,
        help=f"optimizer steps per case ({WARMUP} untimed; default 12)",
    )
    args = p.parse_args()
    steps = max(args.steps or (4 if args.quick else 12), WARMUP + 1)
    size = QUICK_SIZE if args.quick else PRESET_SIZE
    results = common.Results("optimizer step (bf16, Adam, clip-grad 1.0), same weights and gradients")
    done: dict[tuple[str, str], dict] = {}
    for case, optimizer, flags, fields, versus, bitwise_expected in CASES:
        measured = run_case(size, flags, fields, optimizer == "DistributedOptimizer", steps)
        done[(case, optimizer)] = measured
        step_s = statistics.median(measured["times"])
        row = dict(optimizer=optimizer, case=case, params=measured["numel"], step_ms=step_s * 1e3)
        if versus is not None:
            base = done[(versus, optimizer)]
            row["vs"] = versus
            row["step_vs"] = step_s / statistics.median(base["times"])
            row["bitwise"] = (
                ("yes" if _bitwise(measured["state"], base["state"]) else "NO") if bitwise_expected else "-"
            )
        results.add(samples={"step": measured["times"]}, **row)
        print("measured:", {k: v for k, v in row.items()}, flush=True)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
