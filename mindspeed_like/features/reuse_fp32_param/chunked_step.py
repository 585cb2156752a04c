"""The Float16 optimizer step without the layout shuffle: torch's own Adam math on batches of pieces.

Converting a whole buffer to the fp32 layout and back is a perfect shuffle of its int16 halves,
``log2(n / chunk)`` in-place passes each way: it made the step 2.6-2.7x megatron's. Adam is
elementwise, so the same update can run on pieces instead: the shared parameters are cut into
pieces packed into *batches* of at most ``batch`` elements (a parameter larger than the room
left is split at a multiple of :data:`ALIGN`); per batch each piece's exact masters are decoded
from the split layout into its slot of one fp32 workspace, torch's functional
``torch.optim.adam.adam`` runs ONCE on the list of workspace pieces and the matching slices of
the gradients and of ``exp_avg`` / ``exp_avg_sq`` (the same function, flags and hyperparameters
``Adam.step`` passes: torch picks the same single-tensor, foreach or fused implementation as
megatron's own step), and each piece is encoded straight back. The buffers stay in the split
layout; the workspace is one batch.

One algorithm, two devices (the batch size and the tie record come with the buffers, by device:
``kernels/bf16_residual.batch_for`` / ``new_ties``):

- CPU: batches of 2**18 elements stay in cache between decode, update and encode; ties are an
  index table (host syncs are free there).
- CUDA: batches of 2**25 elements (a 128 MiB workspace, plus torch's own foreach temporaries of
  one batch, where megatron's step makes them for all parameters at once) are a handful of
  launches each; ties are a bitmask and decode/encode one Triton
  kernel per piece: no ``.item()``, ``.tolist()``, ``nonzero()`` or data-dependent shape in the
  step (torch's non-capturable Adam keeps ``step`` on the host and reads it there).

AdamW's decoupled weight decay, ``param.mul_(1 - lr * weight_decay)``, is the first thing torch's
single-tensor and foreach Adam do to a parameter, and it is one correctly rounded fp32 multiply by
that scalar (rounded to fp32, as torch rounds it): it is folded into the decode (``scale``) and
torch's call gets ``weight_decay=0``, which saves a read and a write of every master (~8% of the
step's memory traffic). Not folded for the fused implementation (its own kernel applies the decay)
or a tensor ``lr`` (capturable).

Bitwise equal to ``optimizer.step()`` on the full fp32 masters: each element sees the same
operations in the same order, whatever list it is batched in (torch's foreach ops are
elementwise; the bias corrections come from each tensor's own step, read per tensor). The step
counter, which the functional API increments once per call, is reset to its value before the
step ahead of every batch a parameter is in, so every piece sees the count a full step sees.
State is created by the optimizer's own ``_init_group`` (lazily, as in ``Adam.step``), so the
checkpointed state is torch's. The optimizer's step hooks (torch's global ones, then its own) run
around the chunked step as torch's ``step`` runs them; a pre-hook that replaces the step's arguments
gets torch's own step with them. Anything else (other optimizer classes, differentiable groups, a
torch without these entry points) takes the shuffling path, which is exact too.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch.optim import adam as torch_adam
from torch.optim import optimizer as torch_optimizer

from mindspeed_like.kernels import bf16_residual as kernel

_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)
ALIGN = 128
"""Pieces of one parameter are cut, and workspace slots start, at multiples of 128 elements: whole
bytes of a tie bitmask (8 elements each) and 512-byte aligned fp32 slots (vectorized loads)."""


def unsupported(optimizer) -> str | None:
    """Why ``optimizer`` cannot take the chunked step, or None when it can."""
    if type(optimizer) not in _SUPPORTED:
        return f"{type(optimizer).__name__} is not torch's Adam/AdamW"
    if not hasattr(optimizer, "_init_group"):
        return "this torch's Adam has no _init_group"
    if "decoupled_weight_decay" not in inspect.signature(torch_adam.adam).parameters:
        return "this torch's functional adam has no decoupled_weight_decay"
    if not all(hasattr(torch_optimizer, n) for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")):
        return "this torch keeps its optimizer step hooks elsewhere"
    if not hasattr(type(optimizer).step, "__wrapped__"):
        return "this torch's Adam.step is not wrapped by its step hooks"
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return "a differentiable param group"
    return None


def run_pre_hooks(optimizer) -> tuple[tuple, dict] | None:
    """torch's step pre-hooks (global, then the optimizer's), run as ``Optimizer.step``'s wrapper runs
    them; the ``(args, kwargs)`` a hook replaced, or None when none did."""
    args: tuple = (optimizer,)
    kwargs: dict = {}
    replaced = False
    hooks = chain(torch_optimizer._global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values())
    for hook in hooks:
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"a step pre-hook must return None or (new_args, new_kwargs), got {result}")
            (args, kwargs), replaced = result, True
    return (args, kwargs) if replaced else None


def run_post_hooks(optimizer, args: tuple, kwargs: dict) -> None:
    """torch's step post-hooks (the optimizer's, then global) and its step bookkeeping, as its wrapper."""
    optimizer._optimizer_step_code()
    hooks = chain(optimizer._optimizer_step_post_hooks.values(), torch_optimizer._global_optimizer_post_hooks.values())
    for hook in hooks:
        hook(optimizer, args, kwargs)


def unhooked_step(optimizer, args: tuple, kwargs: dict) -> Any:
    """torch's own ``step`` body without its hooks (they ran around the chunked step)."""
    return type(optimizer).step.__wrapped__(*args, **kwargs)


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


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of shared parameter ``slot``, at ``at`` in the batch's workspace."""

    slot: int
    start: int
    stop: int
    at: int


def plan(sizes: list[int], capacity: int) -> list[list[Piece]]:
    """Batches of pieces of parameters of ``sizes`` elements, each batch at most ``capacity``
    elements of workspace (rounded up to :data:`ALIGN`); a parameter appears at most once per
    batch, its pieces in order."""
    capacity = max(ALIGN, capacity // ALIGN * ALIGN)
    batches: list[list[Piece]] = []
    batch: list[Piece] = []
    used = 0
    for slot, n in enumerate(sizes):
        start = 0
        while start < n:
            take = n - start
            room = capacity - used
            if take > room:
                take = room // ALIGN * ALIGN
            if take == 0:
                batches.append(batch)
                batch, used = [], 0
                continue
            batch.append(Piece(slot, start, start + take, used))
            used += -(-take // ALIGN) * ALIGN
            start += take
    if batch:
        batches.append(batch)
    return batches


@torch.no_grad()
def step(optimizer, entries: dict[int, object], batch: int) -> bool:
    """One ``Adam.step`` of ``optimizer``; shared params (``entries``: id of the fp32 main param
    -> its ``Shared``) are stepped in batches of pieces in their split layout, the rest as torch
    does. Returns False, having changed nothing but torch's lazy state creation, when a shared
    param's gradient or state is not contiguous (it could not be sliced in place): the caller
    then takes the shuffling path."""
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
    entries = {key: entry for key, entry in entries.items() if entry.buf.numel()}  # empty: torch's own step
    for (params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps), kwargs in prepared:
        plain = [i for i, p in enumerate(params) if id(p) not in entries]
        if plain:
            lists = (params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
            torch_adam.adam(*([xs[i] for i in plain] if xs else [] for xs in lists), **kwargs)
        shared = [
            _Shared(entries[id(p)], grads[i], exp_avgs[i], exp_avg_sqs[i], max_sqs[i] if max_sqs else None, steps[i])
            for i, p in enumerate(params)
            if id(p) in entries
        ]
        if shared:
            _step_shared(shared, batch, kwargs)
    return True


@dataclass
class _Shared:
    """One shared parameter in this step: its buffer entry, flat gradient and state, step counter."""

    entry: object
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_sq: torch.Tensor | None
    step: torch.Tensor
    before: torch.Tensor = field(init=False)  # the step count before this step
    n: int = field(init=False)

    def __post_init__(self) -> None:
        self.grad, self.exp_avg, self.exp_avg_sq = (t.view(-1) for t in (self.grad, self.exp_avg, self.exp_avg_sq))
        self.max_sq = None if self.max_sq is None else self.max_sq.view(-1)
        self.before = self.step.clone()
        self.n = self.entry.buf.numel() // 2


def fold_weight_decay(kwargs: dict) -> tuple[dict, float | None]:
    """(the kwargs for torch's call, the decode's scale): see the module docstring."""
    lr, decay = kwargs["lr"], kwargs["weight_decay"]
    if kwargs["fused"] or kwargs["differentiable"] or not kwargs["decoupled_weight_decay"] or decay == 0:
        return kwargs, None
    if isinstance(lr, torch.Tensor) or isinstance(decay, torch.Tensor):
        return kwargs, None
    return {**kwargs, "weight_decay": 0.0}, 1 - lr * decay


def _step_shared(shared: list[_Shared], batch_size: int, kwargs: dict) -> None:
    batches = plan([s.n for s in shared], batch_size)
    kwargs, scale = fold_weight_decay(kwargs)
    device = shared[0].entry.buf.device
    size = max(piece.at + piece.stop - piece.start for batch in batches for piece in batch)
    workspace = torch.empty(size, dtype=torch.float32, device=device)
    for batch in batches:
        masters, columns = [], ([], [], [], [], [])  # grads, exp_avgs, exp_avg_sqs, max_sqs, steps
        for piece in batch:
            s, rows = shared[piece.slot], slice(piece.start, piece.stop)
            master = workspace[piece.at : piece.at + piece.stop - piece.start]
            kernel.decode_split(s.entry.buf, piece.start, piece.stop, s.entry.side, master, scale)
            masters.append(master)
            s.step.copy_(s.before)  # every batch sees the count before the step
            for column, t in zip(columns, (s.grad, s.exp_avg, s.exp_avg_sq, s.max_sq)):
                if t is not None:
                    column.append(t[rows])
            columns[4].append(s.step)
        torch_adam.adam(masters, *columns, **kwargs)
        for piece, master in zip(batch, masters):
            s = shared[piece.slot]
            kernel.encode_split(s.entry.buf, piece.start, piece.stop, master, s.entry.side)
    for s in shared:
        s.entry.side.commit()
