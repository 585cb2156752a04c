"""A few deterministic training steps through megatron's DDP and optimizer (compare's arms, the demo, parity tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def batch_on_this_cp_rank(batch: dict) -> dict:
    """megatron's ``get_batch_on_this_cp_rank`` on ``batch`` (tensors with the sequence in dim 1),
    across its signatures: 0.19 added a required ``is_hybrid_cp`` and reads ``cu_seqlens``."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" not in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(dict(batch))
    split = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False)
    return {key: split[key] for key in batch}


def make_batches(steps: int, global_batch: int, seq_length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Token ids ``[steps, global_batch, seq_length + 1]``, the same on every rank for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (steps, global_batch, seq_length + 1), generator=generator)


def _optimizer_config(optimizer: str | Mapping[str, Any], *, lr: float, bf16: bool, use_distributed_optimizer: bool):
    from megatron.core.optimizer import OptimizerConfig

    values: dict[str, Any] = dict(
        lr=lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0
    )
    if isinstance(optimizer, str):
        values["optimizer"] = optimizer
    else:
        values.update(optimizer)
    values.update(bf16=bf16, use_distributed_optimizer=use_distributed_optimizer)
    return OptimizerConfig(**values)


DATA_PARALLEL = ("ddp", "torch_fsdp2", "megatron_fsdp")


def _wrap_data_parallel(kind: str, config, model, ddp_fields: dict, options: dict):
    """``model`` in megatron's data-parallel wrapper ``kind`` (see ``train_steps``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if kind == "ddp":
        return DistributedDataParallel(config, DistributedDataParallelConfig(**{**ddp_fields, **options}), model)
    if kind == "torch_fsdp2":
        from megatron.core.distributed import TorchFullyShardedDataParallelConfig
        from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

        return TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(**options), model)
    if kind == "megatron_fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        fields = {**ddp_fields, "use_distributed_optimizer": True, "use_megatron_fsdp": True, **options}
        return FullyShardedDataParallel(config, DistributedDataParallelConfig(**fields), model)
    raise ValueError(f"data_parallel={kind!r}: choose one of {DATA_PARALLEL}")


def train_steps(
    model: torch.nn.Module,
    steps: int,
    *,
    seed: int = 1234,
    optimizer: str | Mapping[str, Any] = "adam",
    use_distributed_optimizer: bool = False,
    bf16: bool | None = None,
    ddp: bool = True,
    overlap_grad_reduce: bool = False,
    lr: float = 1e-3,
    micro_batch_size: int = 2,
    seq_length: int | None = None,
    data: torch.Tensor | None = None,
    on_step: Callable[[int, float], None] | None = None,
    on_optimizer: Callable[[torch.nn.Module, Any], None] | None = None,
    grad_reduce_in_fp32: bool = True,
    device: torch.device | str | None = None,
    forward_context: Callable[[int], contextlib.AbstractContextManager] | None = None,
    finalize_grads: bool = False,
    data_parallel: str = "ddp",
    ddp_options: Mapping[str, Any] | None = None,
) -> list[float]:
    """Train ``model`` for ``steps`` steps; return the loss of each step (before its update).

    The model (a GPTModel, possibly in ``Float16Module``) is wrapped in megatron's
    ``DistributedDataParallel`` (unless ``ddp=False``) and trained with
    ``get_megatron_optimizer``: ``optimizer`` is ``'adam'``/``'sgd'`` or a dict of
    ``OptimizerConfig`` fields; ``bf16`` defaults to ``model.config.bf16`` (then megatron picks
    ``Float16OptimizerWithFloat16Params``, or ``DistributedOptimizer`` with
    ``use_distributed_optimizer``).

    Data: step ``i`` uses ``data[i]`` (``[global_batch, seq+1]`` token ids; a 2-D ``data`` is
    used for every step) or, by default, ``make_batches(..., seed)``: random tokens of the
    model's vocabulary, identical on every rank. ``global_batch = micro_batch_size * DP``;
    each data-parallel rank trains on its own ``micro_batch_size`` rows. The loss is the mean
    of GPTModel's per-token loss, averaged over the data-parallel group (so a DP=2 run is
    comparable with a DP=1 run on the whole batch). Under context parallelism each CP rank keeps
    its zigzag chunks of every sequence (megatron's ``get_batch_on_this_cp_rank``) and the loss is
    averaged over the data- and context-parallel ranks. ``on_step(step, loss)`` is called after
    each step (progress output). ``on_optimizer(model, optimizer)`` is called once, after the
    (DDP-wrapped) model and megatron's optimizer are built and before the first step (load a
    checkpoint into them, or keep references to read masters or save state afterwards).
    ``grad_reduce_in_fp32=False`` keeps the grad buffers in the params' dtype (bf16 main grads,
    as Megatron-LM's ``--main-grads-dtype bf16``). ``device``: where the batches go (default:
    the CPU, where the tests run). ``forward_context(step)``: a context manager entered around
    that step's forward and loss (e.g. a saved-for-backward meter), exited before its backward.
    ``finalize_grads=True`` ends each backward with megatron's ``finalize_model_grads`` (what
    megatron's schedules call through ``config.finalize_model_grads_func``) instead of DDP's
    ``finish_grad_sync`` alone: it also all-reduces over TP the gradients of parameters marked
    ``sequence_parallel`` (norms, and the duplicated linears that read sequence shards, e.g. MLA's
    TE-spec down projections). Without it such a gradient holds only this rank's sequence shard's
    part; two specs with the same SP-marked parameters agree anyway, a spec with more of them
    does not (opt-in so existing parity baselines keep their numbers).
    ``data_parallel``: megatron's wrapper, ``"ddp"`` (``DistributedDataParallel``), ``"torch_fsdp2"``
    (``TorchFullyShardedDataParallel``; ``ddp_options`` go to ``TorchFullyShardedDataParallelConfig``,
    e.g. ``reshard_after_forward``) or ``"megatron_fsdp"`` (``FullyShardedDataParallel`` with
    ``use_megatron_fsdp=True``; ``ddp_options`` are ``DistributedDataParallelConfig`` fields, e.g.
    ``data_parallel_sharding_strategy``), as Megatron-LM's ``get_model`` builds them.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer

    if data_parallel == "megatron_fsdp":
        use_distributed_optimizer = True  # megatron-FSDP's optimizer is the distributed one (Megatron-LM asserts it)
    gpt = unwrap(model)
    config = gpt.config
    bf16 = bool(config.bf16) if bf16 is None else bf16
    seq_length = seq_length or gpt.max_sequence_length
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_size = parallel_state.get_context_parallel_world_size()
    # the loss is averaged over every rank that holds other tokens: data- and context-parallel
    loss_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if data is None:
        data = make_batches(steps, micro_batch_size * dp_size, seq_length, gpt.vocab_size, seed)
    elif data.dim() == 2:
        data = data.unsqueeze(0).expand(steps, *data.shape)

    if ddp:
        model = _wrap_data_parallel(
            data_parallel,
            config,
            model,
            dict(
                grad_reduce_in_fp32=grad_reduce_in_fp32,
                overlap_grad_reduce=overlap_grad_reduce,
                use_distributed_optimizer=use_distributed_optimizer,
            ),
            dict(ddp_options or {}),
        )
    opt = get_megatron_optimizer(
        _optimizer_config(optimizer, lr=lr, bf16=bf16, use_distributed_optimizer=use_distributed_optimizer),
        [model],
    )
    if on_optimizer is not None:
        on_optimizer(model, opt)
    model.train()
    losses: list[float] = []
    for step in range(steps):
        batch = data[step]
        rows = batch.shape[0] // dp_size
        batch = batch[dp_rank * rows : (dp_rank + 1) * rows]
        if device is not None:
            batch = batch.to(device)
        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        if cp_size > 1:  # megatron's zigzag split: this CP rank's two chunks of each sequence
            mine = batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": position_ids})
            tokens, labels, position_ids = mine["tokens"], mine["labels"], mine["position_ids"]
        if ddp:
            model.zero_grad_buffer()
        opt.zero_grad()
        around = forward_context(step) if forward_context is not None else contextlib.nullcontext()
        with around:
            per_token = model(tokens, position_ids, None, labels=labels)
            loss = per_token.float().mean()
        (loss * opt.get_loss_scale()).backward()
        if ddp and finalize_grads:
            from megatron.core.distributed.finalize_model_grads import finalize_model_grads

            finalize_model_grads([model])
        elif ddp:
            model.finish_grad_sync()
        opt.step()
        reported = loss.detach().clone()
        if dp_size * cp_size > 1:
            dist.all_reduce(reported, group=loss_group)
            reported /= dp_size * cp_size
        losses.append(reported.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
