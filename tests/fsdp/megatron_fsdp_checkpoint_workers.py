"""Runs for test_megatron_fsdp_checkpoint.py in spawned gloo processes (must be importable).

Megatron-FSDP's ``fsdp_dtensor`` checkpoint through megatron-core's API, step for step what Megatron-LM's
``save_checkpoint`` / ``load_checkpoint`` do with ``--ckpt-format fsdp_dtensor`` (megatron/training/
checkpointing.py, core_v0.16.1): the model's ``state_dict_for_save_checkpoint()``, the distributed
optimizer's ``sharded_state_dict(metadata={'distrib_optim_sharding_type': 'fsdp_dtensor'})``, then
``preprocess_fsdp_dtensor_state_dict`` (megatron-core's ``handle_fp8_extra_state_case``,
``handle_swiglu_in_state_dict`` on the ``MegatronFSDP`` module, ``preprocess_state_dict_for_uneven_dtensor``)
and torch's distributed checkpoint. A load builds the same with ``is_loading=True``, reads into it, and
hands the unsplit dicts to ``load_state_dict`` of the wrapper and the optimizer."""

from __future__ import annotations

import os

import torch

from mindspeed_like.workloads.fsdp_checkpoint import fsdp_dtensor_state

STEPS = 6
SAVE_AFTER = 3
STRATEGY = dict(data_parallel_sharding_strategy="optim_grads_params")


# The tiny MoE GPT of hsdp_expert_workers.py (4 experts, top-2, alltoall, TE spec) without its dropout: this
# API-level checkpoint holds the model and optimizer only (Megatron-LM saves the RNG states beside them).
MOE = dict(transformer_impl="transformer_engine", num_moe_experts=4)


def _model(bf16: bool, model: dict | None = None):
    from megatron.core import tensor_parallel

    from mindspeed_like.testing import tiny_gpt

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return tiny_gpt(bf16=bf16, share_embeddings_and_output_weights=False, **(model or {}))


_state = fsdp_dtensor_state


def save(model, optimizer, ckpt_dir: str) -> None:
    import torch.distributed.checkpoint as dcp

    _, prepared = _state(model, optimizer, loading=False)
    dcp.save(prepared, storage_writer=dcp.FileSystemWriter(ckpt_dir))


def load(model, optimizer, ckpt_dir: str) -> None:
    import torch.distributed.checkpoint as dcp

    raw, prepared = _state(model, optimizer, loading=True)
    dcp.load(prepared, storage_reader=dcp.FileSystemReader(ckpt_dir))
    model.load_state_dict(raw["model"])
    optimizer.load_state_dict(raw["optimizer"])


def _setup(without: tuple[str, ...], layout: dict | None = None):
    """``without``: names of fix-megatron-fsdp-dtensor-checkpoint's wrappers left out (the fix's test);
    a spawned process ends with its test, so nothing is put back. ``layout``: ``ep`` and ``instances``
    (``num_distributed_optimizer_instances``), 1 each by default."""
    import mindspeed_like
    from mindspeed_like import runtime
    from mindspeed_like.fixes import megatron_fsdp_dtensor_checkpoint as fix
    from mindspeed_like.testing import init_parallel

    mindspeed_like.configure(device="cpu")
    if without:
        runtime.ENGINE.apply(fix.NAME, [p for p in fix.PATCHES if p.new.__name__ not in without])
    layout = layout or {}
    init_parallel(ep=layout.get("ep", 1), seed=1234, num_distributed_optimizer_instances=layout.get("instances", 1))


def _data():
    from mindspeed_like.testing.training import make_batches

    return make_batches(STEPS, 4, 32, 256, seed=7)  # global batch 4 at every DP size


def _train(
    bf16: bool,
    steps: int,
    data,
    on_optimizer=None,
    on_step=None,
    model: dict | None = None,
    layout: dict | None = None,
) -> dict[str, list[float]]:
    """``{"losses": [...], "grad_norms": [...]}``: each step's loss (averaged over the data-parallel ranks)
    and the grad norm megatron's optimizer computed (``optimizer.step()``'s second value)."""
    from hsdp_expert_workers import _record_grad_norms

    from mindspeed_like.testing.training import train_steps

    dp = torch.distributed.get_world_size()
    norms: list[float] = []
    record = _record_grad_norms(norms)

    def prepare(wrapped, optimizer):
        if on_optimizer is not None:
            on_optimizer(wrapped, optimizer)
        record(wrapped, optimizer)

    options = dict(STRATEGY, num_distributed_optimizer_instances=(layout or {}).get("instances", 1))
    losses = train_steps(
        _model(bf16, model),
        steps,
        lr=1e-2,
        micro_batch_size=4 // dp,
        data=data,
        data_parallel="megatron_fsdp",
        ddp_options=options,
        finalize_grads=True,
        on_optimizer=prepare,
        on_step=on_step,
    )
    return {"losses": losses, "grad_norms": norms}


def save_midway(
    bf16: bool, ckpt_dir: str, without: tuple[str, ...] = (), model: dict | None = None, layout: dict | None = None
) -> dict[str, list[float]]:
    """``STEPS`` steps straight, saving after ``SAVE_AFTER``; returns the losses and grad norms. ``model``:
    ``tiny_gpt`` overrides (``MOE``); ``layout``: as ``_setup``'s."""
    from mindspeed_like.testing import destroy_parallel

    _setup(without, layout)
    held: dict = {}

    def keep(model, optimizer):
        held.update(model=model, optimizer=optimizer)

    def maybe_save(step, loss):
        if step == SAVE_AFTER - 1:
            save(held["model"], held["optimizer"], ckpt_dir)

    try:
        return _train(bf16, STEPS, _data(), keep, maybe_save, model, layout)
    finally:
        destroy_parallel()


def resume(
    bf16: bool, ckpt_dir: str, without: tuple[str, ...] = (), model: dict | None = None, layout: dict | None = None
) -> dict[str, list[float]]:
    """A fresh model and optimizer load the checkpoint and take the remaining steps."""
    from mindspeed_like.testing import destroy_parallel

    _setup(without, layout)
    try:
        return _train(
            bf16,
            STEPS - SAVE_AFTER,
            _data()[SAVE_AFTER:],
            lambda m, o: load(m, o, ckpt_dir),
            model=model,
            layout=layout,
        )
    finally:
        destroy_parallel()


def empty_load(bf16: bool, ckpt_dir: str, without: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Megatron-LM's ``--load DIR`` without a checkpoint in DIR: the load's state dict is built
    (``sharded_state_dict(is_loading=True)``), nothing is read. Returns that run's and a plain run's losses."""
    from mindspeed_like.testing import destroy_parallel

    _setup(without)
    os.makedirs(ckpt_dir, exist_ok=True)
    try:
        plain = _train(bf16, 3, _data())["losses"]
        built = _train(bf16, 3, _data(), lambda m, o: _state(m, o, loading=True))["losses"]
    finally:
        destroy_parallel()
    return {"plain": plain, "empty_load": built}
