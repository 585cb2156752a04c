"""The Float16 optimizer step without the layout shuffle: torch's own Adam math, chunk by chunk.

Converting a whole buffer to the fp32 layout and back is a perfect shuffle of its int16 halves,
``log2(n / chunk)`` in-place passes each way: it made the step 2.6-2.7x megatron's. Adam is
elementwise, so the same update can run on a chunk at a time instead: decode the chunk's exact
masters from the split layout into a small fp32 workspace, call torch's functional
``torch.optim.adam.adam`` on that workspace and the matching slices of the gradient and of the
optimizer's ``exp_avg`` / ``exp_avg_sq`` (the same function, flags and hyperparameters
``Adam.step`` passes), and encode the result straight back. The buffer stays in the split layout,
the workspace is one chunk, and each chunk is touched once while it is in cache.

Bitwise equal to ``optimizer.step()`` on the full fp32 master: each element sees the same
operations in the same order; the step counter, which the functional API increments once per
call, is reset before every chunk so all chunks see the count a full step sees.
State is created by the optimizer's own ``_init_group`` (lazily, as in ``Adam.step``), so the
checkpointed state is torch's. Anything else (other optimizer classes, differentiable groups,
step hooks, a torch without these entry points) takes the shuffling path, which is exact too.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch.optim import adam as torch_adam

from mindspeed_like.kernels import bf16_residual as kernel

_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)


def unsupported(optimizer) -> str | None:
    """Why ``optimizer`` cannot take the chunked step, or None when it can."""
    if type(optimizer) not in _SUPPORTED:
        return f"{type(optimizer).__name__} is not torch's Adam/AdamW"
    if not hasattr(optimizer, "_init_group"):
        return "this torch's Adam has no _init_group"
    if "decoupled_weight_decay" not in inspect.signature(torch_adam.adam).parameters:
        return "this torch's functional adam has no decoupled_weight_decay"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "the optimizer has step hooks"
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return "a differentiable param group"
    return None


@contextlib.contextmanager
def replaced_step(optimizer, step) -> Iterator[None]:
    """``optimizer.step`` is ``step`` inside the block (megatron calls ``self.optimizer.step()``)."""
    optimizer.step = step
    try:
        yield
    finally:
        del optimizer.step


def _adam_kwargs(optimizer, group: dict, has_complex: bool) -> dict:
    beta1, beta2 = group["betas"]
    return dict(
        amsgrad=group["amsgrad"],
        has_complex=has_complex,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=group["differentiable"],
        fused=group["fused"],
        grad_scale=getattr(optimizer, "grad_scale", None),
        found_inf=getattr(optimizer, "found_inf", None),
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )


@torch.no_grad()
def step(optimizer, entries: dict[int, object], chunk: int) -> bool:
    """One ``Adam.step`` of ``optimizer``; shared params (``entries``: id of the fp32 main param
    -> its ``Shared``) are stepped chunk by chunk in their split layout, the rest as torch does.
    Returns False, having changed nothing but torch's lazy state creation, when a shared param's
    gradient or state is not contiguous (it could not be sliced in place): the caller then takes
    the shuffling path."""
    prepared = []
    for group in optimizer.param_groups:
        lists = ([], [], [], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        has_complex = optimizer._init_group(group, *lists)
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, _ = lists
        for i, param in enumerate(params):
            per_param = (grads[i], exp_avgs[i], exp_avg_sqs[i], *([max_sqs[i]] if max_sqs else []))
            if id(param) in entries and not all(t.is_contiguous() for t in per_param):
                return False
        prepared.append((lists, _adam_kwargs(optimizer, group, has_complex)))
    for (params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps), kwargs in prepared:
        plain = [i for i, p in enumerate(params) if id(p) not in entries]
        if plain:
            lists = (params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
            torch_adam.adam(*([xs[i] for i in plain] if xs else [] for xs in lists), **kwargs)
        for i, param in enumerate(params):
            entry = entries.get(id(param))
            if entry is not None:
                tensors = (grads[i], exp_avgs[i], exp_avg_sqs[i], *([max_sqs[i]] if max_sqs else []))
                _step_shared(entry, tensors, steps[i], chunk, kwargs)
    return True


def _step_shared(entry, tensors: tuple, step_t: torch.Tensor, chunk: int, kwargs: dict) -> None:
    grad, exp_avg, exp_avg_sq, *max_sq = (t.view(-1) for t in tensors)
    buf, n = entry.buf, entry.buf.numel() // 2
    before = step_t.clone()
    workspace = torch.empty(min(chunk, n), dtype=torch.float32, device=buf.device)
    ties = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        master = kernel.decode_split(buf, start, stop, entry.side, workspace[: stop - start])
        step_t.copy_(before)
        rows = slice(start, stop)
        torch_adam.adam(
            [master], [grad[rows]], [exp_avg[rows]], [exp_avg_sq[rows]], [m[rows] for m in max_sq], [step_t], **kwargs
        )
        ties.append(kernel.encode_split(buf, start, stop, master))
    entry.side = torch.cat(ties) if ties else kernel._empty_side(buf.device)
