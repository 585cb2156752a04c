"""Megatron-FSDP trained the way a megatron-core script trains it (spawned gloo ranks; must be importable).

Unlike ``fsdp_workers.train_cases`` (a plain ``loss.backward()``), each step goes through megatron's
``get_forward_backward_func`` with ``config.no_sync_func = model.no_sync``, ``finalize_model_grads`` and
megatron's optimizer, as a script ported from ``DistributedDataParallel`` sets them. Returns each case's
``(loss, grad norm)`` per step."""

from __future__ import annotations

from functools import partial

import torch

STEPS = 2
MICRO_BATCH = 2
SEQ = 32


def _train(case: dict) -> list[tuple[float, float]]:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed_like.testing import tiny_gpt

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model = tiny_gpt(seq_length=SEQ)
    config = model.config
    options = dict(use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    if case["wrapper"] == "megatron_fsdp":
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy=case["strategy"], **options
        )
        model = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    else:
        model = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(**options), module=model
        )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0), [model]
    )
    config.no_sync_func = model.no_sync  # what the schedules enter before each last microbatch
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    dp_rank = parallel_state.get_data_parallel_rank()

    def forward_step(data_iterator, module):
        tokens = next(data_iterator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
        output = module(inputs, positions, None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, partial(loss_func)

    results = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + dp_rank)
        microbatches = [torch.randint(0, 256, (MICRO_BATCH, SEQ + 1), generator=generator) for _ in range(2)]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        loss = torch.stack([r["lm loss"] for r in reduced]).mean()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        results.append((loss.item() / parallel_state.get_data_parallel_world_size(), float(grad_norm)))
    return results


def train_with_the_schedule(cases: list[dict], without: tuple[str, ...] = ()) -> dict[str, list]:
    """``cases``: dicts of ``name``, ``wrapper`` (``'ddp'``: DDP with the distributed optimizer, or
    ``'megatron_fsdp'``) and ``strategy``. ``without``: fixes removed first (a fix's test)."""
    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel

    mindspeed_like.configure(device="cpu")
    for name in without:
        runtime.ENGINE.remove(name)
    init_parallel(seed=1234)
    try:
        return {case["name"]: _train(case) for case in cases}
    finally:
        destroy_parallel()


def fsdp2_local_spec_default_impl(without: tuple[str, ...] = ()) -> dict:
    """torch FSDP2 around the local spec, the config's ``transformer_impl`` as the config says it (``"local"``)
    and at TransformerConfig's default (``"transformer_engine"``, what a megatron-core script that builds
    ``get_gpt_layer_local_spec()`` without setting it holds): each case's units and 2 steps' losses, or the
    error's text."""
    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt
    from mindspeed_like.testing.training import train_steps

    mindspeed_like.configure(device="cpu")
    for name in without:
        runtime.ENGINE.remove(name)
    init_parallel(seed=1234)
    results: dict[str, dict] = {}
    try:
        for impl in ("local", "transformer_engine"):
            torch.manual_seed(1234)
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
            model = tiny_gpt(share_embeddings_and_output_weights=False)
            model.config.transformer_impl = impl
            wrapped = {}

            def keep(module, optimizer, wrapped=wrapped):
                wrapped["units"] = sorted(
                    name for name, sub in module.module.named_modules() if "FSDP" in type(sub).__name__ and name
                )

            try:
                losses = train_steps(
                    model, 2, lr=1e-2, data_parallel="torch_fsdp2", finalize_grads=True, on_optimizer=keep
                )
                results[impl] = dict(losses=losses, units=wrapped["units"], error=None)
            except Exception as error:  # the case's outcome, for the test to read
                results[impl] = dict(losses=None, units=None, error=f"{type(error).__name__}: {error}")
    finally:
        destroy_parallel()
    return results
