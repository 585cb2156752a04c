"""Training through megatron's pipeline schedules, for `compare` at PP > 1: what Megatron-LM's
``train_step`` does with the model chunks of a rank.

``get_forward_backward_func()`` picks ``forward_backward_pipelining_without_interleaving`` at PP > 1
and ``forward_backward_pipelining_with_interleaving`` with virtual stages (several chunks per rank).
Each chunk is wrapped in megatron's DDP (bucketing only on the first, as Megatron-LM's get_model);
one megatron optimizer holds all chunks; ``finalize_model_grads`` (set on the config, as Megatron-LM
does) all-reduces the data-parallel gradients and the tied embedding's between the first and last
stage after the last microbatch's backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


def _microbatches(
    batch: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches of one step's global batch (``[rows, seq+1]``), each
    cut to this context-parallel rank's zigzag chunks."""
    from megatron.core import parallel_state

    from mindspeed_like.workloads.training import batch_on_this_cp_rank

    rows = batch.shape[0] // dp_size
    mine = batch[dp_rank * rows : (dp_rank + 1) * rows]
    out = []
    for rows_of_one in mine.split(micro_batch_size):
        tokens, labels = rows_of_one[:, :-1].contiguous(), rows_of_one[:, 1:].contiguous()
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        item = {"tokens": tokens, "labels": labels, "position_ids": position_ids}
        if parallel_state.get_context_parallel_world_size() > 1:
            item = batch_on_this_cp_rank(item)
        out.append(item)
    return out


def train_pipeline(
    chunks: list[torch.nn.Module],
    steps: int,
    *,
    data: torch.Tensor,
    lr: float,
    micro_batch_size: int,
    seq_length: int,
    use_distributed_optimizer: bool = False,
    on_step: Callable[[int, float], None] | None = None,
    on_optimizer: Callable[[list[torch.nn.Module], Any], None] | None = None,
    forward_context: Callable[[int], contextlib.AbstractContextManager] | None = None,
    optimizer: dict[str, Any] | None = None,
    grad_reduce_in_fp32: bool = True,
) -> list[float]:
    """Train the rank's model chunks for ``steps`` steps; return each step's loss (the mean over the
    microbatches and the data- and context-parallel ranks, sent from the last stage to every rank).

    ``data[step]``: the step's global batch ``[micro_batch_size * microbatches * DP, seq + 1]``; the
    number of microbatches follows from it. ``forward_context(step)`` is entered around each
    microbatch's forward (a saved-for-backward meter sees one microbatch at a time, as the schedule
    runs the others' backwards in between).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mindspeed_like.workloads.training import _optimizer_config, unwrap

    config = unwrap(chunks[0]).config
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_size = parallel_state.get_context_parallel_world_size()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=use_distributed_optimizer
    )
    models = [
        DistributedDataParallel(
            config=unwrap(chunk).config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        _optimizer_config(
            optimizer or "adam",
            lr=lr,
            bf16=bool(config.bf16),
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        models,
    )
    for chunk in chunks:
        chunk_config = unwrap(chunk).config
        chunk_config.finalize_model_grads_func = finalize_model_grads
        chunk_config.grad_scale_func = optimizer.scale_loss
    if on_optimizer is not None:
        on_optimizer(models, optimizer)
    forward_backward = get_forward_backward_func()
    last_stage = parallel_state.get_pipeline_model_parallel_last_rank()
    loss_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for model in models:
        model.train()
    losses: list[float] = []
    for step in range(steps):
        micro = _microbatches(data[step], micro_batch_size, dp_rank, dp_size)

        def forward_step(data_iterator, model, step=step):
            batch = next(data_iterator)
            around = forward_context(step) if forward_context is not None else contextlib.nullcontext()
            with around:
                output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

            def loss_func(output_tensor):
                loss = output_tensor.float().mean()
                return loss, {"lm loss": loss.detach().clone()}

            return output, loss_func

        for model in models:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [iter(micro) for _ in models]
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models if len(models) > 1 else models[0],
            num_microbatches=len(micro),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        optimizer.step()
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            reported = torch.stack([o["lm loss"] for o in out]).mean().float()
            if dp_size * cp_size > 1:
                dist.all_reduce(reported, group=loss_group)
                reported /= dp_size * cp_size
        else:
            reported = torch.zeros((), dtype=torch.float32)
        dist.broadcast(reported, src=last_stage, group=parallel_state.get_pipeline_model_parallel_group())
        losses.append(reported.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
