"""Training runs for the reuse-fp32-param tests: in-process and in spawned gloo processes
(module level, importable). Every run returns plain data: per-step losses and the bit
patterns (int32 / int16) of the final fp32 masters and bf16 weights, so comparisons are
bitwise."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mindspeed_like.testing.parity import SEED


def inner_optimizers(opt) -> list:
    return list(getattr(opt, "chained_optimizers", [opt]))


def masters_of(opt) -> list[torch.Tensor]:
    """Exact fp32 masters as megatron's state_dict writes them (int32 bit patterns)."""
    out = []
    for inner in inner_optimizers(opt):
        if hasattr(inner, "fp32_from_float16_groups"):
            state = inner.state_dict()
            out += [p.detach().clone().view(torch.int32) for g in state["fp32_from_fp16_params"] for p in g]
    return out


def weights_of(opt) -> list[torch.Tensor]:
    out = []
    for inner in inner_optimizers(opt):
        groups = getattr(inner, "float16_groups", None) or getattr(inner, "model_float16_groups", [])
        out += [p.detach().clone().view(torch.int16) for g in groups for p in g]
    return out


def configure(flag: bool, **features: Any) -> None:
    import mindspeed_like

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", reuse_fp32_param=flag, **features)


def train(
    flag: bool,
    steps: int,
    *,
    tp: int = 1,
    model_args: Mapping[str, Any] | None = None,
    features: Mapping[str, Any] | None = None,
    prepare: Callable[[Any, Any], None] | None = None,
    after: Callable[[Any, Any], Any] | None = None,
    data: torch.Tensor | None = None,
    **train_args: Any,
) -> dict:
    """Build a bf16 tiny GPT, train ``steps`` steps with the flag on or off, return the results.

    ``prepare(model, optimizer)`` runs before the first step, ``after(model, optimizer)`` after
    the last (its return value is ``result['after']``)."""
    from mindspeed_like.testing import destroy_parallel, init_parallel, param_bytes, tiny_gpt, train_steps

    configure(flag, **(features or {}))
    init_parallel(tp=tp, seed=SEED)
    model = tiny_gpt(bf16=True, **(model_args or {}))
    box: dict = {}

    def on_optimizer(wrapped_model, opt):
        box.update(model=wrapped_model, opt=opt)
        if prepare is not None:
            prepare(wrapped_model, opt)

    train_args.setdefault("lr", 1e-2)
    losses = train_steps(model, steps, seed=SEED, on_optimizer=on_optimizer, data=data, **train_args)
    opt = box["opt"]
    result = dict(losses=losses, masters=masters_of(opt), weights=weights_of(opt))
    weights = [p for inner in inner_optimizers(opt) for g in getattr(inner, "float16_groups", []) for p in g]
    masters = [p for inner in inner_optimizers(opt) for g in getattr(inner, "fp32_from_float16_groups", []) for p in g]
    tensors = weights + masters
    result["numel"] = sum(p.numel() for p in weights)
    result["bytes"] = param_bytes(tensors)
    if after is not None:
        result["after"] = after(box["model"], opt)
    destroy_parallel()
    return result


def equal(xs: list, ys: list) -> bool:
    """Bitwise equal lists of tensors (or numpy arrays from a spawned process)."""
    return len(xs) == len(ys) > 0 and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(xs, ys))


def same(a: dict, b: dict) -> bool:
    """Bitwise equal losses, masters and weights."""
    return a["losses"] == b["losses"] and equal(a["masters"], b["masters"]) and equal(a["weights"], b["weights"])


def plain(result):
    """Tensors -> numpy arrays, recursively: a spawned process's result must not hold shared tensors."""
    if isinstance(result, torch.Tensor):
        return result.numpy().copy()
    if isinstance(result, dict):
        return {k: plain(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        return type(result)(plain(v) for v in result)
    return result


# ---------------------------------------------------------------- checkpoints (fresh processes)


def _save(path: str):
    def after(model, opt):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

    return after


def _load(path: str):
    def prepare(model, opt):
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    return prepare


def checkpoint_save(directory: str, first: int, total: int) -> dict:
    """Train ``first`` steps with the flag on and off and save both; also train ``total`` straight."""
    from mindspeed_like.testing import make_batches

    data = make_batches(total, 2, 32, 256, SEED)
    out = {"straight": train(False, total, data=data)}
    for flag in (True, False):
        path = f"{directory}/ckpt_{'on' if flag else 'off'}.pt"
        out[flag] = train(flag, first, data=data[:first], after=_save(path))
        saved = torch.load(path, weights_only=False)["optimizer"]
        masters = [p for g in saved["fp32_from_fp16_params"] for p in g]
        out[f"plain_{flag}"] = all(
            p.dtype == torch.float32 and p.untyped_storage().nbytes() == 4 * p.numel() for p in masters
        )
    return plain(out)


def checkpoint_load(directory: str, first: int, total: int) -> dict:
    """In a fresh process: resume every (saved with, loaded with) pair and train to ``total``."""
    from mindspeed_like.testing import make_batches

    data = make_batches(total, 2, 32, 256, SEED)[first:]
    out = {}
    for saved_with, loaded_with in ((True, False), (False, True), (True, True)):
        path = f"{directory}/ckpt_{'on' if saved_with else 'off'}.pt"
        out[(saved_with, loaded_with)] = train(loaded_with, total - first, data=data, prepare=_load(path))
    return plain(out)


# ---------------------------------------------------------------- 2 processes


def parallel_parity(steps: int) -> dict:
    """DP=2 Float16 optimizer, TP=2+SP, and TP=2+SP with the fused features on: flag off vs on."""
    out = {}
    fused = dict(use_fused_swiglu=True, use_fused_rmsnorm=True, use_fused_rotary_pos_emb=True)
    out["dp2"] = (train(False, steps), train(True, steps))
    sp = dict(sequence_parallel=True)
    out["tp2_sp"] = (train(False, steps, tp=2, model_args=sp), train(True, steps, tp=2, model_args=sp))
    out["tp2_sp_fused"] = (
        train(False, steps, tp=2, model_args=sp, features=fused),
        train(True, steps, tp=2, model_args=sp, features=fused),
    )
    return plain(out)


def distributed_optimizer(steps: int) -> dict:
    """DP=2 DistributedOptimizer: flag off vs on, with and without overlapped grad reduce."""
    out = {}
    for overlap in (False, True):
        args = dict(use_distributed_optimizer=True, overlap_grad_reduce=overlap)
        out[f"overlap={overlap}"] = (
            train(False, steps, after=_dist_after, **args),
            train(True, steps, after=_dist_after, **args),
        )
    return plain(out)


def _dist_after(model, opt) -> dict:
    """Masters (decoded) and held bytes of a DistributedOptimizer."""
    from mindspeed_like.features.reuse_fp32_param import state_of
    from mindspeed_like.testing import param_bytes

    inner = inner_optimizers(opt)[0]
    state = state_of(inner)
    mains = [p for g in inner.shard_fp32_from_float16_groups for p in g]
    params = [p for g in inner.model_float16_groups for p in g]
    held = param_bytes(params + mains) + (state.extra_bytes() if state is not None else 0)
    layout = None if state is None else state.layout  # "split": every step ran in the scratch layout
    if state is not None:
        state.materialize()
    masters = [p.detach().clone().view(torch.int32) for p in mains]
    numel = sum(p.numel() for p in model.parameters())
    return dict(masters=masters, bytes=held, numel=numel, layout=layout)


# ---------------------------------------------------------------- DistributedOptimizer parameter state


def _dist_save(path: str):
    def after(model, opt):
        import torch.distributed as dist

        inner = inner_optimizers(opt)[0]
        param_state = inner.get_parameter_state_dp_zero()  # collective; data on DP rank 0
        state = {"model": model.state_dict(), "optimizer": inner.state_dict(), "param_state": param_state}
        if dist.get_rank() == 0:
            torch.save(state, path)
        dist.barrier()
        return _dist_after(model, opt)

    return after


def _dist_load(path: str):
    def prepare(model, opt):
        import torch.distributed as dist

        inner = inner_optimizers(opt)[0]
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])  # torch AdamW's per-param step: fix-distopt-checkpoint-without-apex
        inner.load_parameter_state_from_dp_zero(state["param_state"] if dist.get_rank() == 0 else None)

    return prepare


def dist_checkpoint_save(directory: str, first: int, total: int) -> dict:
    """DP=2 DistributedOptimizer: ``total`` steps straight, and ``first`` steps saved with the flag on / off."""
    from mindspeed_like.testing import make_batches

    data = make_batches(total, 4, 32, 256, SEED)
    args = dict(use_distributed_optimizer=True)
    out = {"straight": train(False, total, data=data, after=_dist_after, **args)}
    for flag in (True, False):
        path = f"{directory}/dist_{'on' if flag else 'off'}.pt"
        out[flag] = train(flag, first, data=data[:first], after=_dist_save(path), **args)
    return plain(out)


def dist_checkpoint_load(directory: str, first: int, total: int) -> dict:
    from mindspeed_like.testing import make_batches

    data = make_batches(total, 4, 32, 256, SEED)[first:]
    args = dict(use_distributed_optimizer=True)
    out = {}
    for saved_with, loaded_with in ((True, False), (False, True)):
        path = f"{directory}/dist_{'on' if saved_with else 'off'}.pt"
        out[(saved_with, loaded_with)] = train(
            loaded_with, total - first, data=data, prepare=_dist_load(path), after=_dist_after, **args
        )
    return plain(out)


# ---------------------------------------------------------------- the CUDA path, forced on the CPU


def _read_masters_before(step_number: int, box: dict):
    """Before optimizer step ``step_number``: a checkpoint read (``state_dict``: the masters are
    materialized, and the step then splits them back from that layout)."""

    def prepare(model, opt):
        from mindspeed_like.features.reuse_fp32_param import state_of

        inner = inner_optimizers(opt)[0]
        real, count = opt.step, [0]

        def step():
            count[0] += 1
            if count[0] == step_number:
                inner.state_dict()
                state = state_of(inner)
                box["materialized"] = None if state is None else state.layout
            return real()

        opt.step = step

    return prepare


def _dist_after_with_ties(box: dict):
    def after(model, opt):
        from mindspeed_like.features.reuse_fp32_param import state_of

        state = state_of(inner_optimizers(opt)[0])
        if state is not None:
            box["kinds"] = sorted({type(b.side).__name__ for b in state.buckets})
            box["extra"] = state.extra_bytes()
            residuals = sum(b.residual.untyped_storage().nbytes() for b in state.buckets)
            box["expected_extra"] = residuals + sum((b.size + 7) // 8 for b in state.buckets)
        return _dist_after(model, opt)

    return after


def distributed_optimizer_cuda_path(steps: int) -> dict:
    """DP=2 DistributedOptimizer, flag off vs on with the ``cuda`` backend forced (tie bitmasks)."""
    from mindspeed_like.kernels.backend import force_backend

    args = dict(use_distributed_optimizer=True)
    box: dict = {}
    out = {"base": train(False, steps, prepare=_read_masters_before(4, {}), after=_dist_after, **args)}
    with force_backend("cuda"):
        out["ours"] = train(True, steps, prepare=_read_masters_before(4, box), after=_dist_after_with_ties(box), **args)
    return plain({**out, **box})
