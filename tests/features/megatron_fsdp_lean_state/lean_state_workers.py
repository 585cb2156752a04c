"""Runs for the megatron-fsdp-lean-state tests in spawned gloo processes (must be importable).

The tiny GPT (bf16) under Megatron-FSDP ``optim_grads_params`` at 2 ranks, megatron's own buffers
(the feature off) against the lean ones (on), in one spawn. Returns plain data: each step's loss and
grad norm, and this rank's model state as the last optimizer step starts (compare's meter:
``compare.measure.state_bytes``, every storage reached from the live model and optimizer)."""

from __future__ import annotations

import torch

from mindspeed_like.workloads.fsdp_checkpoint import fsdp_dtensor_state

STEPS = 4
STRATEGY = dict(data_parallel_sharding_strategy="optim_grads_params")


def _model():
    from megatron.core import tensor_parallel

    from mindspeed_like.testing import tiny_gpt

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return tiny_gpt(bf16=True, share_embeddings_and_output_weights=False)


def _train(steps: int, data=None, on_optimizer=None, on_step=None) -> dict:
    """``steps`` steps; returns losses, grad norms and the bytes a parameter of each kind as the last
    step starts."""
    from mindspeed_like.compare.measure import state_bytes
    from mindspeed_like.testing.training import train_steps

    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    out: dict = {"grad_norms": [], "bytes_per_param": {}}

    def hold(wrapped_model, optimizer):
        step = optimizer.step
        count = [0]

        def measured_step():
            count[0] += 1
            if count[0] == steps:
                out["bytes_per_param"] = {k: v / numel for k, v in state_bytes(wrapped_model, optimizer).items()}
            result = step()
            out["grad_norms"].append(float(result[1]))
            return result

        optimizer.step = measured_step
        out["optimizer"] = type(optimizer.optimizer).__name__
        if on_optimizer is not None:
            on_optimizer(wrapped_model, optimizer)

    dp = torch.distributed.get_world_size()
    out["losses"] = train_steps(
        model,
        steps,
        lr=1e-2,
        micro_batch_size=4 // dp,
        seq_length=32,
        data=data,
        data_parallel="megatron_fsdp",
        ddp_options=STRATEGY,
        finalize_grads=True,
        on_optimizer=hold,
        on_step=on_step,
    )
    return out


def off_and_on(steps: int = STEPS) -> dict[str, dict]:
    """megatron's buffers (the feature off), then the lean ones (on), same model, data and seed."""
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel

    runs: dict[str, dict] = {}
    mindspeed_like.configure(device="cpu")
    init_parallel(seed=1234)
    try:
        for name, on in (("megatron", False), ("lean", True)):
            mindspeed_like.configure(device="cpu", megatron_fsdp_lean_state=on)
            runs[name] = _train(steps)
    finally:
        destroy_parallel()
    return runs


# -- fsdp_dtensor checkpoints: what Megatron-LM's save_checkpoint / load_checkpoint do with
# --ckpt-format fsdp_dtensor (as tests/fsdp/megatron_fsdp_checkpoint_workers.py)

CKPT_STEPS = 6
SAVE_AFTER = 3


_state = fsdp_dtensor_state


def _data():
    from mindspeed_like.testing.training import make_batches

    return make_batches(CKPT_STEPS, 4, 32, 256, seed=7)


def save_midway(ckpt_dir: str, lean: bool) -> list[float]:
    """``CKPT_STEPS`` steps straight, an fsdp_dtensor checkpoint after ``SAVE_AFTER``; the losses."""
    import torch.distributed.checkpoint as dcp

    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel

    mindspeed_like.configure(device="cpu", megatron_fsdp_lean_state=lean)
    init_parallel(seed=1234)
    held: dict = {}

    def maybe_save(step, loss):
        if step == SAVE_AFTER - 1:
            dcp.save(_state(held["model"], held["optimizer"], False)[1], storage_writer=dcp.FileSystemWriter(ckpt_dir))

    try:
        return _train(CKPT_STEPS, _data(), lambda m, o: held.update(model=m, optimizer=o), maybe_save)["losses"]
    finally:
        destroy_parallel()


def resume(ckpt_dir: str, lean: bool) -> list[float]:
    """A fresh model and optimizer load the checkpoint and take the remaining steps."""
    import torch.distributed.checkpoint as dcp

    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel

    mindspeed_like.configure(device="cpu", megatron_fsdp_lean_state=lean)
    init_parallel(seed=1234)

    def load(model, optimizer):
        raw, prepared = _state(model, optimizer, True)
        dcp.load(prepared, storage_reader=dcp.FileSystemReader(ckpt_dir))
        model.load_state_dict(raw["model"])
        optimizer.load_state_dict(raw["optimizer"])

    try:
        return _train(CKPT_STEPS - SAVE_AFTER, _data()[SAVE_AFTER:], load)["losses"]
    finally:
        destroy_parallel()


# -- releases without a lean layout (0.13's custom_fsdp, 0.14's and 0.15's Megatron-FSDP)

BUILDS = 2


def wrapper_class():
    """The installed release's Megatron-FSDP wrapper and the DistributedDataParallelConfig field that
    selects it (0.13: ``custom_fsdp``, ``use_custom_fsdp``; 0.14+: ``mcore_fsdp_adapter``, ``use_megatron_fsdp``)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if "use_megatron_fsdp" in DistributedDataParallelConfig.__dataclass_fields__:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel, "use_megatron_fsdp"
    from megatron.core.distributed.custom_fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel, "use_custom_fsdp"


def build_wrappers(lean: bool, strict: bool = False, builds: int = BUILDS) -> dict:
    """Build the release's Megatron-FSDP wrapper ``builds`` times over the tiny bf16 GPT with the feature
    ``lean`` or not; returns what the "mindspeed_like" logger said (``before``: before any build), the
    feature's fallback reasons, and
    for each build the exception that stopped it (None: built), FeatureUnsupported's message under strict.

    megatron's own constructor may stop after the feature's line on this host (0.13: custom_fsdp is not
    adapted to a CPU host; 0.14/0.15: their mesh code reads what torch 2.13 no longer has): that is
    recorded, not raised, since the line is what this run checks."""
    import logging

    from megatron.core.distributed import DistributedDataParallelConfig

    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel
    from mindspeed_like.toolkit.errors import FeatureUnsupported
    from mindspeed_like.toolkit.fallback import fell_back

    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger("mindspeed_like")
    logger.addHandler(handler)
    mindspeed_like.configure(device="cpu", megatron_fsdp_lean_state=lean, strict=strict)
    init_parallel(seed=1234)
    cls, field = wrapper_class()
    before = list(said)  # configured, megatron's wrapper imported, nothing built yet
    stopped: list = []
    try:
        for _ in range(builds):
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params", **{field: True}
            )
            try:
                model = _model()
                cls(model.config, ddp_config, model)
                stopped.append(None)
            except FeatureUnsupported as error:
                stopped.append(f"FeatureUnsupported: {error}")
            except Exception as error:  # megatron's own constructor on this host, after the line
                stopped.append(f"{type(error).__name__}: {error}"[:300])
    finally:
        logger.removeHandler(handler)
        destroy_parallel()
    return {"before": before, "said": said, "fell_back": fell_back(), "stopped": stopped}


NO_LAYOUT_CASES = ((True, False), (False, False), (True, True))
"""(lean, strict): the feature on, off, and on under --strict."""


def no_layout_cases() -> dict:
    """:func:`build_wrappers` for each of :data:`NO_LAYOUT_CASES` in one process, from a fresh start each
    (``mindspeed_like.reset()``: no patch, no line logged yet)."""
    import mindspeed_like

    out = {}
    for lean, strict in NO_LAYOUT_CASES:
        mindspeed_like.reset()
        out[(lean, strict)] = build_wrappers(lean, strict)
    return out
