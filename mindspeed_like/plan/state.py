"""Model state on one rank: weights, gradients and optimizer state, as megatron lays them out.

- Gradients live in DDP's contiguous grad buffer (fp32 with ``--accumulate-allreduce-grads-in-fp32``,
  which Megatron-LM sets for bf16; bf16 with the precision-aware optimizer's
  ``--main-grads-dtype bf16``). Dense and expert-parallel parameters have separate buffers.
- With the distributed optimizer the bf16 parameters become views of a param buffer, and both
  buffers are padded: each parameter's start to 64 elements, each bucket's end to
  lcm(data-parallel size, 128) (``_ParamAndGradBuffer``); fp32 masters and Adam's moments exist
  for this rank's 1/DP shard only.
- Without it, megatron's ``Float16OptimizerWithFloat16Params`` keeps an fp32 master of every
  parameter and both Adam moments (fp32), plus a 4-byte ``step`` per parameter tensor.

Features: reuse-fp32-param stores each bf16 weight and its master in one 4-byte buffer (weights
4 B/param, no separate master) or, with the distributed optimizer, replaces the fp32 master shard
by an int16 residual shard; the precision-aware optimizer stores the moments in the dtypes asked
for and the master as bf16 weight + int16 remainder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindspeed_like.plan.params import Param
from mindspeed_like.plan.paths import Paths
from mindspeed_like.plan.spec import BYTES, Run

BLOCK_SCALE = 4 / 128  # fp16 / fp8 moments: one fp32 scale per block of 128 (precision-aware optimizer)


@dataclass(frozen=True)
class Line:
    """One row of the model-state table."""

    kind: str  # weights, gradients, optimizer
    what: str
    bytes: int
    feature: str | None = None


def _pad(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)


@dataclass(frozen=True)
class Buffer:
    """One DDP buffer (dense or expert-parallel) of one model chunk."""

    numel: int  # unpadded
    padded: int
    tensors: int
    group: int  # its data-parallel group size (the distributed optimizer shards over it)

    @property
    def shard(self) -> int:
        return self.padded // self.group


def buffers(run: Run, chunks: list[list[Param]]) -> list[Buffer]:
    """The DDP buffers of one rank's chunks, padded as megatron pads them."""
    lay = run.layout
    dense_group = lay.dp * lay.cp
    expert_group = max(1, lay.tp * lay.cp * lay.dp // (lay.expert_tp * lay.ep))
    out = []
    for params in chunks:
        for expert, group in ((False, dense_group), (True, expert_group)):
            mine = [p for p in params if p.expert == expert]
            if not mine:
                continue
            numel = sum(p.numel for p in mine)
            padded = _padded(mine, group) if lay.distributed_optimizer else numel
            out.append(Buffer(numel, padded, len(mine), group))
    return out


def _padded(params: list[Param], group: int) -> int:
    """``_ParamAndGradBuffer``'s layout under the distributed optimizer: parameters in reverse
    order, each start aligned to 64, the bucket (one per buffer without --overlap-grad-reduce; the
    tied embedding's copy its own) ended at a multiple of lcm(DP, 128)."""
    divisor = math.lcm(group, 128)
    index = 0
    bucket_start = 0
    for p in reversed(params):
        index = _pad(index, 64)
        if p.shared_embedding and index > bucket_start:
            index = _pad(index, divisor)
            bucket_start = index
        index += p.numel
        if p.shared_embedding:
            index = _pad(index, divisor)
            bucket_start = index
    return _pad(index, divisor)


def model_state(run: Run, chunks: list[list[Param]], paths: Paths) -> list[Line]:
    """Weights, gradients and optimizer state of one rank (``chunks``: its chunks' parameters)."""
    prec, lay = run.precision, run.layout
    if lay.fsdp is not None:
        return fsdp_state(run, chunks, paths)
    bufs = buffers(run, chunks)
    numel = sum(b.numel for b in bufs)
    padded = sum(b.padded for b in bufs)
    shard = sum(b.shard for b in bufs)
    shard_unpadded = sum(math.ceil(b.numel / b.group) for b in bufs)
    tensors = sum(b.tensors for b in bufs)
    p = prec.param_bytes
    mixed = prec.params != "fp32"
    lines: list[Line] = []
    # weights
    if lay.distributed_optimizer:
        lines.append(Line("weights", f"param buffer ({prec.params}, padded)", p * padded))
    elif paths.reuse_fp32_param and mixed:
        lines.append(
            Line(
                "weights",
                "bf16 weights + int16 residuals in one fp32 buffer (the fp32 masters)",
                4 * numel,
                "reuse-fp32-param",
            )
        )
    else:
        lines.append(Line("weights", f"parameters ({prec.params})", p * numel))
    # gradients
    g = prec.grad_bytes
    grad_dtype = prec.grad_dtype
    lines.append(
        Line("gradients", f"grad buffer ({grad_dtype}{', padded' if lay.distributed_optimizer else ''})", g * padded)
    )
    # optimizer
    n = shard_unpadded if lay.distributed_optimizer else numel
    if mixed:
        if prec.precision_aware_optimizer and lay.distributed_optimizer:
            if prec.main_params == "fp16":
                lines.append(Line("optimizer", "fp16 master shard (block-scaled)", int(n * (2 + BLOCK_SCALE))))
            else:
                lines.append(Line("optimizer", "int16 master remainders (master = bf16 weight + remainder)", 2 * n))
        elif paths.reuse_fp32_param and lay.distributed_optimizer:
            lines.append(
                Line(
                    "optimizer",
                    "int16 residual shard (the fp32 master shard's low halves)",
                    2 * shard,
                    "reuse-fp32-param",
                )
            )
        elif paths.reuse_fp32_param:
            pass  # the masters are the weights' own buffers (counted under weights)
        else:
            what = "fp32 master shard" if lay.distributed_optimizer else "fp32 masters"
            lines.append(Line("optimizer", what, 4 * n))
    if prec.optimizer == "sgd":
        # torch's SGD (megatron's without TE or Apex): one fp32 momentum buffer beside each master when
        # --sgd-momentum is not 0, nothing else (no step counter)
        if prec.sgd_momentum:
            lines.append(Line("optimizer", "SGD momentum buffer (fp32)", 4 * n))
        return lines
    adam = "Adam" if prec.optimizer == "adam" else f"{prec.optimizer} (not modeled: counted as Adam's)"
    for name, dtype in (("exp_avg", prec.exp_avg), ("exp_avg_sq", prec.exp_avg_sq)):
        if not prec.precision_aware_optimizer:
            dtype = "fp32"
        per = BYTES[dtype] + (BLOCK_SCALE if dtype in ("fp16", "fp8") else 0)
        feature = "precision-aware-optimizer" if dtype != "fp32" and paths.precision_aware_portable else None
        lines.append(Line("optimizer", f"{adam} {name} ({dtype})", int(n * per), feature))
    steps = math.ceil(tensors / max(1, min(b.group for b in bufs))) if lay.distributed_optimizer else tensors
    lines.append(Line("optimizer", f"{adam} step counters (one fp32 per parameter tensor)", 4 * steps))
    return lines


def fsdp_state(run: Run, chunks: list[list[Param]], paths: Paths) -> list[Line]:
    """One rank's model state under megatron's FSDP paths (plan/fsdp.py): torch FSDP2's DTensor
    shards (over fsdp2-config's HSDP shard group where it sets one), Megatron-FSDP's buffers by
    strategy and buffer dtypes, with the precision-aware optimizer's decoupled gradients and moments; under
    Megatron-FSDP with megatron-fsdp-lean-state (bf16) its remainder masters and bf16 gradients and moments.
    reuse-fp32-param, and the precision-aware optimizer under torch FSDP2, are not modeled on these paths."""
    from mindspeed_like.plan import fsdp

    prec, lay = run.precision, run.layout
    hsdp = lay.fsdp == fsdp.TORCH_FSDP2 and paths.fsdp_shard_size is not None
    group = paths.fsdp_shard_size if hsdp and paths.fsdp_shard_size else fsdp.group_size(run)
    feature = "fsdp2-config" if hsdp else None
    replicated = f", replicated over {fsdp.group_size(run) // group} groups (HSDP)" if hsdp else ""
    params = [p for c in chunks for p in c]
    numel = sum(p.numel for p in params)
    # Megatron-FSDP shards an expert's parameters over its expert data-parallel group (FSDP2 refuses EP)
    sharded = sum(
        fsdp.shard(q.numel, fsdp.group_size(run, q.expert) if q.expert and not hsdp else group) for q in params
    )
    p = prec.param_bytes
    lines: list[Line] = []
    if lay.fsdp == fsdp.TORCH_FSDP2:
        lines.append(
            Line("weights", f"parameter shards ({prec.params}, 1/{group} of each{replicated})", p * sharded, feature)
        )
        lines.append(
            Line(
                "gradients",
                f"gradient shards ({prec.params}, from backward to the optimizer step)",
                p * sharded,
                feature,
            )
        )
        n = sharded
        master = "fp32 master shard"
    else:
        # Megatron-FSDP: weights are the model-weight buffer; the fp32 main-weight buffer (the masters, which
        # the module's parameters view during a step) is optimizer state, as compare's meter counts it. Under
        # HSDP (--num-distributed-optimizer-instances) the buffers are sharded within an instance's ranks, and
        # with --outer-dp-sharding-strategy optim the masters and moments across the instances too
        strategy = lay.sharding_strategy
        weights_sharded = strategy == "optim_grads_params"
        grads_sharded = strategy in ("optim_grads", "optim_grads_params")
        group, optim_group = fsdp.hybrid_groups(run)
        sharded = sum(fsdp.shard(q.numel, fsdp.hybrid_groups(run, q.expert)[0]) for q in params)
        optim_sharded = sum(fsdp.shard(q.numel, fsdp.hybrid_groups(run, q.expert)[1]) for q in params)
        n = optim_sharded if strategy != "no_shard" else numel
        part = f"1/{optim_group}" if strategy != "no_shard" else "whole"
        if lay.optimizer_instances > 1:
            replicated = f", replicated over {lay.optimizer_instances} instances (HSDP)"
            part += ", across the instances too" if optim_group != group else replicated
        if strategy == "no_shard":
            lines.append(Line("weights", f"parameters ({prec.params})", p * numel))
        else:
            lines.append(
                Line(
                    "weights",
                    f"model-weight buffer ({prec.params}, {f'1/{group}' if weights_sharded else 'whole'}{replicated})",
                    p * (sharded if weights_sharded else numel),
                )
            )
        grad_dtype = fsdp.megatron_fsdp_grad_dtype(prec)
        lines.append(
            Line(
                "gradients",
                f"main-grad buffer ({grad_dtype}, {f'1/{group}' if grads_sharded else 'whole'}{replicated})",
                BYTES[grad_dtype] * (sharded if grads_sharded else numel),
            )
        )
        copy = fsdp.megatron_fsdp_grad_copy_dtype(prec)
        if copy:
            # update_main_grads' cast of each gradient shard to the main-weight buffer's dtype, kept to the next step
            # (megatron-core 0.19: the main-grad buffer in the parameters' dtype whatever grad_reduce_in_fp32 says)
            lines.append(
                Line(
                    "gradients", f"{copy} copy of the gradient shards for the {copy} masters ({part})", BYTES[copy] * n
                ),
            )
        main = fsdp.megatron_fsdp_main_params_dtype(prec)
        # the optimizer's parameters: the main-weight buffer's shard, or without one (auto) the weights' own shard
        stepped = main or prec.params
        master = f"main-weight buffer ({main} masters, {part})" if main else ""
    if paths.megatron_fsdp_lean_state and lay.fsdp == fsdp.MEGATRON_FSDP:
        return lines[:1] + _lean_state(n, grads_sharded, sharded, numel, group)
    # an fp32 master beside each non-fp32 shard under FSDP2 (megatron's Float16Optimizer; its FP32Optimizer keeps
    # none); Megatron-FSDP's main-weight buffer in its own dtype (fsdp.megatron_fsdp_main_params_dtype), whatever
    # the parameters' dtype, or none
    if lay.fsdp == fsdp.MEGATRON_FSDP:
        if main:
            lines.append(Line("optimizer", master, BYTES[main] * n))
    else:
        stepped = "fp32"
        if prec.params != "fp32":
            lines.append(Line("optimizer", master, 4 * n, feature))
    # torch's Adam and SGD make their state as torch.zeros_like(the parameter they step) (megatron's init_state_fn
    # too): fp32 beside fp32 masters, the parameters' dtype where Megatron-FSDP keeps no main-weight buffer
    state_bytes = BYTES[stepped]
    if prec.optimizer == "sgd":
        if prec.sgd_momentum:
            lines.append(Line("optimizer", f"SGD momentum buffer ({stepped})", state_bytes * n, feature))
        return lines
    adam = "Adam" if prec.optimizer == "adam" else f"{prec.optimizer} (not modeled: counted as Adam's)"
    if lay.fsdp == fsdp.MEGATRON_FSDP and fsdp.megatron_fsdp_decoupled_grads(prec):
        # the precision-aware Adam over Megatron-FSDP's main-weight buffer: its moments in the dtypes asked for;
        # megatron turns its own masters off there (master_weights=False: the main-weight buffer is the masters)
        for name, dtype in (("exp_avg", prec.exp_avg), ("exp_avg_sq", prec.exp_avg_sq)):
            per = BYTES[dtype] + (BLOCK_SCALE if dtype in ("fp16", "fp8") else 0)
            which = "precision-aware-optimizer" if dtype != "fp32" and paths.precision_aware_portable else None
            lines.append(Line("optimizer", f"{adam} {name} ({dtype}, precision-aware)", int(n * per), which))
    else:
        for name in ("exp_avg", "exp_avg_sq"):
            lines.append(Line("optimizer", f"{adam} {name} ({stepped})", state_bytes * n, feature))
    lines.append(Line("optimizer", f"{adam} step counters (one fp32 per parameter tensor)", 4 * len(params)))
    return lines


def _lean_state(n: int, grads_sharded: bool, sharded: int, numel: int, group: int) -> list[Line]:
    """megatron-fsdp-lean-state's buffers and optimizer state (features/megatron_fsdp_lean_state): no
    main-weight buffer, a bf16 main-grad buffer, and the precision-aware Adam over the bf16 weight shard
    (an int16 remainder per element, bf16 moments, one step count per group, no tensor)."""
    feature = "megatron-fsdp-lean-state"
    part = f"1/{group}" if grads_sharded else "whole"
    return [
        Line("gradients", f"main-grad buffer (bf16, {part})", 2 * (sharded if grads_sharded else numel), feature),
        Line("optimizer", "int16 master remainders (master = bf16 weight shard + remainder)", 2 * n, feature),
        Line("optimizer", "Adam exp_avg (bf16)", 2 * n, feature),
        Line("optimizer", "Adam exp_avg_sq (bf16)", 2 * n, feature),
    ]


def totals(lines: list[Line]) -> dict[str, int]:
    out = {"weights": 0, "gradients": 0, "optimizer": 0}
    for line in lines:
        out[line.kind] += line.bytes
    out["model_state"] = out["weights"] + out["gradients"] + out["optimizer"]
    return out
