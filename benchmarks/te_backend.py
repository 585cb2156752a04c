"""te-backend: the TE-spec GPT (``get_gpt_layer_with_transformer_engine_spec``, on the te-backend)
against megatron's local-spec GPT, same weights (copied by checkpoint key), same batches, in the
same process: training tokens/s at ``--optimization-level`` 0 (megatron's own path on each spec)
and 1 (the features that keep megatron's numerics).

The TE spec fuses each input norm into the next column-parallel linear
(``TELayerNormColumnParallelLinear``); the target is that this costs nothing: TE-spec tokens/s
>= 0.97x the local spec's at level 1 (3%: the spread of repeated medians on this shared 2-core
host). torch.compile stays on unless TORCHDYNAMO_DISABLE is set (megatron's jit_fuser functions
compile, as in a user's run). Rounds alternate the two specs so machine noise hits both alike; the
first step of every round (optimizer build, compile) is not timed.

Both specs run the same aten ops with the same shapes, strides and dtypes at levels 0 and 1 (the
same flash kernel at level 1); the TE spec adds only its wrappers' Python calls (~25 per layer and
step). The default size is chosen to finish in about a minute on a 2-core CPU host: bf16 matmuls
there have no native kernel (AVX2: 1-20 GFLOP/s by operand layout against 30-65 in fp32), so the
earlier default (4 layers, hidden 512, seq 1024: ~190 GFLOP a step) took minutes per step and the
100 steps of a run hours. Here: 2 layers, hidden 256, seq 256, micro-batch 2, 3 timed steps per
round and spec (~60-70 ms a step idle); `make bench` runs 15 rounds (45 steps per spec and level).

On a GPU (``--device cuda``) the same comparison runs there; without TransformerEngine installed
the TE spec is the te-backend's, as on a CPU.

    python benchmarks/te_backend.py [--quick] [--repeats N] [--preset llama|moe] [--device cuda]
"""

from __future__ import annotations

import statistics
import time

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import torch

import mindspeed_like
from mindspeed_like.compare.presets import PRESETS
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps
from mindspeed_like.testing.checkpoint_keys import copy_weights
from mindspeed_like.testing.parity import SEED

TARGET = 0.97
SPECS = ("local", "transformer_engine")


def _models(preset: str, size: dict, bf16: bool) -> dict[str, torch.nn.Module]:
    args = PRESETS[preset].model_args(**size)
    args.update(bf16=bf16, moe_grouped_gemm=False)  # SequentialMLP on the local spec: the weights copy by key
    init_parallel(seed=SEED)
    local = tiny_gpt(wrap_float16=False, **args)
    init_parallel(seed=SEED)
    te = tiny_gpt(wrap_float16=False, transformer_impl="transformer_engine", **{**args, "moe_grouped_gemm": True})
    copy_weights(local, te)
    models = {"local": local, "transformer_engine": te}
    if bf16:
        from megatron.core.transformer.module import Float16Module

        models = {name: Float16Module(model.config, model) for name, model in models.items()}
    return {name: model.to(common.device()) for name, model in models.items()}


def _step_times(model: torch.nn.Module, steps: int, micro_batch_size: int) -> list[float]:
    stamps: list[float] = []
    train_steps(  # each step ends in the loss's .item(): the device is drained when its stamp is taken
        model,
        steps + 1,
        micro_batch_size=micro_batch_size,
        on_step=lambda *_: stamps.append(time.perf_counter()),
        device=common.device() if common.on_accelerator() else None,
    )
    return [b - a for a, b in zip(stamps, stamps[1:])]  # step 0 (optimizer build, compile) untimed


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("llama", "moe"), default="llama")
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1])
    args = p.parse_args()
    size = (
        dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128)
        if args.quick
        else dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256)
    )
    micro, steps = 2, 3
    results = common.Results("te_backend")
    for level in args.levels:
        mindspeed_like.reset()
        common.configure(optimization_level=level)
        common.init_process_group()
        models = _models(args.preset, size, bf16=True)
        samples: dict[str, list[float]] = {name: [] for name in SPECS}
        for _ in range(args.repeats):
            for name in SPECS:
                samples[name] += _step_times(models[name], steps, micro)
        destroy_parallel()
        tokens = micro * size["seq_length"]
        rate = {name: tokens / statistics.median(samples[name]) for name in SPECS}
        ratio = rate["transformer_engine"] / rate["local"]
        for name in SPECS:  # each timed step of both specs goes into the record
            common.add_samples(name, samples[name])
        results.add(
            preset=args.preset,
            level=level,
            local_tokens_per_s=round(rate["local"], 1),
            te_tokens_per_s=round(rate["transformer_engine"], 1),
            te_over_local=round(ratio, 3),
            target=f">= {TARGET}" if level >= 1 else "-",
            met=("yes" if ratio >= TARGET else "NO") if level >= 1 else "-",
            samples=len(samples["local"]),
        )
    mindspeed_like.reset()
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
