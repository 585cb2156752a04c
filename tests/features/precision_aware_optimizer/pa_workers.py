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
    repeat_batch: bool = False,
    **train_args: Any,
) -> dict:
    """bf16 tiny GPT + DistributedOptimizer on the current DP world; losses (+ ``after``'s result).

    ``repeat_batch``: every step sees the same batch (the loss curve then falls: a learning curve)."""
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel, make_batches, tiny_gpt, train_steps

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", **(features or {}))
    init_parallel(seed=SEED)
    model = tiny_gpt(bf16=True)
    box: dict = {}
    if repeat_batch:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        gpt = model.module if hasattr(model, "module") else model
        train_args["data"] = make_batches(1, 2 * world, gpt.max_sequence_length, gpt.vocab_size, SEED)[0]

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


CURVES = {
    "megatron": dict(moments=None),
    "fp32": dict(moments="fp32"),
    "fp32+remainders": dict(moments="fp32", remainders=True),
    "bf16": dict(moments="bf16", grads="bf16", remainders=True),
    "fp8": dict(moments="fp8", grads="bf16", remainders=True),
}


# megatron's DP-zero file is keyed by (param dtype, grad dtype): a checkpoint changes moment dtypes
# only between runs with the same main-grads dtype
CONFIGS = {
    **CURVES,
    "bf16 moments, fp32 grads": dict(moments="bf16"),
    "fp8 moments, fp32 grads": dict(moments="fp8"),
}


def curves(steps: int, names: tuple[str, ...] = tuple(CURVES)) -> dict[str, list[float]]:
    """Loss curves of the named configurations, one after another in this process (DP = world)."""
    return {name: train(steps=steps, repeat_batch=True, **CURVES[name])["losses"] for name in names}


def _states(opt) -> list[torch.Tensor]:
    inner = opt.optimizer
    out = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    for g in inner.param_groups:
        for p in g["params"]:
            out += [t.clone() for t in inner.state[p].values()]
    for bucket in {id(b): b for b in inner._buckets.values()}.values():
        out += [s.scales.clone() for s in bucket.stores.values() if s.scales is not None]
    return out


def skipped_step(moments: str) -> dict:
    """Two steps with a constant loss scale (so megatron checks grads for inf), then a step with an
    inf in one main grad: megatron must skip it and every weight, state and scale stay bit for bit."""

    def after(model, opt):
        before = _states(opt)
        steps_before = [g.get("step") for g in opt.optimizer.param_groups]
        model.zero_grad_buffer()
        opt.zero_grad()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.main_grad.fill_(1e-3)
        params[0].main_grad.view(-1)[0] = float("inf")
        ok, _, _ = opt.step()
        after_ = _states(opt)
        return dict(
            update_successful=ok,
            unchanged=len(before) == len(after_) and all(torch.equal(a, b) for a, b in zip(before, after_)),
            steps=(steps_before, [g.get("step") for g in opt.optimizer.param_groups]),
        )

    return train(moments, 2, grads="bf16", remainders=True, extra=dict(loss_scale=1.0), after=after)["after"]


# ---------------------------------------------------------------- checkpoints (fresh processes)


def _save(directory: str):
    def after(model, opt):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{directory}/common_{rank}.pt")
        opt.save_parameter_state(f"{directory}/param_state.pt")  # megatron's DP-zero format
        return None

    return after


def _load(directory: str):
    def prepare(model, opt):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        common = torch.load(f"{directory}/common_{rank}.pt", weights_only=False)
        model.load_state_dict(common["model"])
        opt.load_state_dict(common["optimizer"])
        opt.load_parameter_state(f"{directory}/param_state.pt")

    return prepare


def checkpoint_save(directory: str, moments: str, first: int, total: int) -> dict:
    """Train ``total`` steps straight, and ``first`` steps then save (megatron's DP-zero files).
    ``moments``: a key of :data:`CURVES` ("megatron" is the default path's fp32-state checkpoint)."""
    from mindspeed_like.testing import make_batches

    world = torch.distributed.get_world_size()
    data = make_batches(total, 2 * world, 32, 256, SEED)
    cfg = CONFIGS[moments]
    straight = train(steps=total, data=data, **cfg)["losses"]
    first_part = train(steps=first, data=data[:first], after=_save(directory), **cfg)["losses"]
    return {"straight": straight, "first": first_part}


def checkpoint_load(directory: str, moments: str, first: int, total: int) -> list[float]:
    """A fresh process: load the checkpoint into ``moments`` states, train the remaining steps."""
    from mindspeed_like.testing import make_batches

    world = torch.distributed.get_world_size()
    data = make_batches(total, 2 * world, 32, 256, SEED)
    cfg = CONFIGS[moments]
    return train(steps=total - first, data=data[first:], prepare=_load(directory), **cfg)["losses"]
