"""What a user's megatron-core training script does, as functions the user-script tests run.

Only documented interfaces of ours are used (``mindspeed_like.configure``); everything else is
plain megatron-core the way its quick-start (examples/run_simple_mcore_train_loop.py) and
Megatron-LM's training loop drive it: TransformerConfig defaults (no ``use_cpu_initialization``),
``attention_mask=None`` (megatron builds the causal mask), ``get_forward_backward_func()``,
megatron's DDP, ``get_megatron_optimizer``, ``finalize_model_grads``, ``dist_checkpointing``.
"""

from __future__ import annotations

import torch

SEQ, MBS, VOCAB = 32, 2, 128


def configure() -> None:
    import mindspeed_like

    mindspeed_like.configure(device="cpu")


def build(*, bf16: bool = False, dropout: float = 0.0, distributed_optimizer: bool = False, **config):
    """GPTModel (local spec) in megatron's DDP (and Float16Module for bf16) + megatron optimizer."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(123)
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        **config,
    )
    cfg.finalize_model_grads_func = finalize_model_grads
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        VOCAB,
        SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if bf16:
        model = Float16Module(cfg, model)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=bf16
    )
    model = DistributedDataParallel(cfg, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, bf16=bf16, use_distributed_optimizer=distributed_optimizer, clip_grad=1.0
        ),
        [model],
    )
    return model, optimizer


def _batches(step: int, microbatches: int, dp_rank: int, dp_size: int):
    """``microbatches`` x (MBS rows) per DP rank; the global batch of a step is the same for any DP."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, VOCAB, (microbatches * dp_size * MBS, SEQ + 1), generator=g)
    mine = rows[dp_rank * microbatches * MBS : (dp_rank + 1) * microbatches * MBS]
    return iter([{"tokens": m[:, :-1], "labels": m[:, 1:]} for m in mine.split(MBS)])


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    output = model(batch["tokens"], position_ids, None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def train(model, optimizer, first_step: int, steps: int, global_microbatches: int = 4) -> list[float | None]:
    """Megatron's schedule for the parallel layout; the loss of each step averaged over DP
    (None on pipeline stages other than the last)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    dp_size = parallel_state.get_data_parallel_world_size()
    microbatches = global_microbatches // dp_size
    forward_backward = get_forward_backward_func()
    losses: list[float | None] = []
    for step in range(first_step, first_step + steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=_batches(step, microbatches, parallel_state.get_data_parallel_rank(), dp_size),
            model=model,
            num_microbatches=microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        optimizer.step()
        if out:
            loss = torch.stack([o["lm loss"] for o in out]).mean()
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            losses.append(float(loss) / dp_size)
        else:
            losses.append(None)
    return losses


def _model_state(model, optimizer=None, *, loading: bool = False) -> dict:
    state = {"model": model.module.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading)
    return state


def save(model, optimizer, directory: str) -> None:
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)  # megatron wants an existing, empty directory
    dist.barrier()
    dist_checkpointing.save(_model_state(model, optimizer), directory)


def load(model, optimizer, directory: str) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_model_state(model, optimizer, loading=True), directory)
    model.module.load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])


def pipeline_suite(directory: str, steps: int = 3, more: int = 2) -> dict:
    """2 processes: PP=2 equals PP=1 (DP=2) from the same weights; PP=2 checkpoint round trip.

    The PP=1 model's weights go through a dist checkpoint into the PP=2 model (megatron
    reshards the layers over the stages), so both start from the same function.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mindspeed_like.testing import destroy_parallel, init_parallel

    configure()
    out: dict = {}

    init_parallel(pp=1)  # world 2 -> DP=2
    model, optimizer = build()
    save(model, None, f"{directory}/init")
    out["pp1_dp2"] = train(model, optimizer, 0, steps)
    destroy_parallel()

    init_parallel(pp=2)
    out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    model, optimizer = build()
    load(model, None, f"{directory}/init")
    out["pp2"] = train(model, optimizer, 0, steps)
    save(model, optimizer, f"{directory}/pp2")
    out["pp2_straight"] = train(model, optimizer, steps, more)
    dist.barrier()
    model, optimizer = build()  # fresh weights and optimizer: everything must come from the checkpoint
    load(model, optimizer, f"{directory}/pp2")
    out["pp2_resumed"] = train(model, optimizer, steps, more)
    destroy_parallel()
    return out
