"""Runs for the FSDP tests in spawned gloo processes (must be importable).

Each worker builds megatron's tiny GPT (``mindspeed_like.testing.tiny_gpt``) per case on the same
process groups and trains it under one of megatron's data-parallel wrappers, returning each step's
loss (averaged over the data-parallel ranks). Several cases share one spawn: a spawn costs seconds."""

from __future__ import annotations

import os

import torch

STEPS = 3


def _model(impl: str, bf16: bool, seed: int = 1234):
    from megatron.core import tensor_parallel

    from mindspeed_like.testing import tiny_gpt

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = tiny_gpt(transformer_impl=impl, bf16=bf16, share_embeddings_and_output_weights=False)
    # what Megatron-LM's config carries (megatron's FSDP2 wrapper reads it to choose its units)
    model.config.transformer_impl = impl
    return model


def train_cases(
    cases: list[dict], flags: dict | None = None, without: tuple[str, ...] = (), keep_config: bool = False
) -> dict[str, list[float]]:
    """``cases``: dicts of ``name``, ``impl`` ('local' / 'transformer_engine'), ``bf16``,
    ``data_parallel`` and ``ddp_options`` (``train_steps``'s), optionally ``flags`` (the adaptor's
    for that case). Returns each case's losses.
    ``flags``: the adaptor's (``configure``); ``without``: features removed first (a fix's test);
    ``keep_config``: the adaptor as the caller left it (no ``configure`` here)."""
    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel
    from mindspeed_like.testing.training import train_steps

    if not keep_config:
        mindspeed_like.configure(device="cpu", **(flags or {}))
    for name in without:
        runtime.ENGINE.remove(name)
    init_parallel(seed=1234)
    losses: dict[str, list[float]] = {}
    try:
        for case in cases:
            if "flags" in case:  # this case's adaptor flags (configure() rebuilds: the same process, new features)
                mindspeed_like.configure(device="cpu", **case["flags"])
            model = _model(case["impl"], case["bf16"])
            losses[case["name"]] = train_steps(
                model,
                STEPS,
                lr=1e-2,
                data_parallel=case["data_parallel"],
                ddp_options=case.get("ddp_options"),
                use_distributed_optimizer=case.get("use_distributed_optimizer", False),
                finalize_grads=True,
            )
    finally:
        destroy_parallel()
    return losses


def _optimizer_state(optimizer) -> dict:
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    return inner.optimizer.state


def save_resume(impl: str, ckpt_dir: str, broken: tuple[str, ...] = ()) -> dict:
    """torch FSDP2: 2 steps, a distributed checkpoint (megatron's ``dist_checkpointing``, the model's
    and the optimizer's sharded state dicts, as Megatron-LM's torch_dist), 2 more steps; then a
    fresh model and optimizer load it and take the same 2 steps. ``broken``: fixes removed first
    (to show what each one repairs; a spawned process ends with the test, so nothing is put back)."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import TorchFullyShardedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.testing import destroy_parallel, init_parallel
    from mindspeed_like.testing.training import make_batches

    mindspeed_like.configure(device="cpu")
    for name in broken:
        runtime.ENGINE.remove(name)
    init_parallel(seed=1234)
    data = make_batches(4, 2, 32, 256, seed=7)
    rank = torch.distributed.get_rank()

    def build():
        gpt = _model(impl, bf16=False)
        model = TorchFullyShardedDataParallel(gpt.config, TorchFullyShardedDataParallelConfig(), gpt)
        return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model])

    def step(model, optimizer, i):
        batch = data[i, rank : rank + 1]
        tokens, labels = batch[:, :-1], batch[:, 1:]
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    def sharded(model, optimizer, loading: bool) -> dict:
        state = {"model": model.sharded_state_dict()}
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading)
        return state

    result: dict = {}
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    try:
        model, optimizer = build()
        for i in range(2):
            step(model, optimizer, i)
        try:
            dist_checkpointing.save(sharded(model, optimizer, False), ckpt_dir)
        except ValueError as error:
            return {"save_error": str(error)}
        result["straight"] = [step(model, optimizer, i) for i in (2, 3)]
        model, optimizer = build()
        loaded = dist_checkpointing.load(sharded(model, optimizer, True), ckpt_dir)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        result["state_types"] = sorted(
            {type(v).__name__ for s in _optimizer_state(optimizer).values() for v in s.values()}
        )
        try:
            result["resumed"] = [step(model, optimizer, i) for i in (2, 3)]
        except RuntimeError as error:
            result["step_error"] = str(error)
    finally:
        destroy_parallel()
    return result


def train_with_megatron_reduce_op(cases: list[dict]) -> dict[str, list[float]]:
    """``train_cases`` with the cpu adapter's scale-then-SUM taken out: megatron's own reduce op."""
    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.adapters.cpu import FEATURE as CPU_ADAPTER
    from mindspeed_like.adapters.cpu.fsdp import scale_then_sum

    mindspeed_like.configure(device="cpu")
    runtime.ENGINE.apply(CPU_ADAPTER.name, [p for p in CPU_ADAPTER.patches if p.new is not scale_then_sum])
    return train_cases(cases, flags=None, keep_config=True)
