"""Training runs for the precision-aware-optimizer tests (module level: spawned gloo processes
import them). Each returns plain data: per-step losses, and for DP ranks the bytes of model state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mindspeed_like.testing.parity import SEED

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


def optimizer_fields(
    moments: str | None, *, grads: str = "fp32", remainders: bool = False, **extra: Any
) -> dict[str, Any]:
    """OptimizerConfig fields: ``moments=None`` is megatron's default path (no precision-aware)."""
    fields: dict[str, Any] = dict(optimizer="adam", **extra)
    if moments is not None:
        fields.update(
            use_precision_aware_optimizer=True,
            exp_avg_dtype=DTYPES[moments],
            exp_avg_sq_dtype=DTYPES[moments],
            main_grads_dtype=DTYPES[grads],
            store_param_remainders=remainders,
        )
    return fields


def train(
    moments: str | None,
    steps: int,
    *,
    grads: str = "fp32",
    remainders: bool = False,
    features: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    after=None,
    prepare=None,
    **train_args: Any,
) -> dict:
    """bf16 tiny GPT + DistributedOptimizer on the current DP world; losses (+ ``after``'s result)."""
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", **(features or {}))
    init_parallel(seed=SEED)
    model = tiny_gpt(bf16=True)
    box: dict = {}

    def on_optimizer(wrapped, opt):
        box.update(model=wrapped, opt=opt)
        if prepare is not None:
            prepare(wrapped, opt)

    train_args.setdefault("lr", 1e-2)
    losses = train_steps(
        model,
        steps,
        seed=SEED,
        optimizer=optimizer_fields(moments, grads=grads, remainders=remainders, **(extra or {})),
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=grads == "fp32",
        on_optimizer=on_optimizer,
        **train_args,
    )
    out = {"losses": losses}
    if after is not None:
        out["after"] = after(box["model"], box["opt"])
    destroy_parallel()
    return out
