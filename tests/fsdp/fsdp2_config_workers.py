"""Runs for the fsdp2-config tests in spawned gloo processes (must be importable).

Each case writes its YAML (rank 0; the others wait), switches ``--fsdp2-config-path`` to it (or off) with
``configure()``, builds megatron's tiny GPT on the same seed and trains it under megatron's
``TorchFullyShardedDataParallel`` through megatron's ``finalize_model_grads`` and optimizer (clipping on:
the grad norm goes through megatron's DTensor group look-up). Returns each case's losses and what the
wrapper built (mesh shape, the FSDP units by name)."""

from __future__ import annotations

import contextlib
import os

import torch

STEPS = 3


def _model(impl: str, seed: int = 1234, **overrides):
    from megatron.core import tensor_parallel

    from mindspeed_like.testing import tiny_gpt

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = tiny_gpt(transformer_impl=impl, share_embeddings_and_output_weights=False, **overrides)
    model.config.transformer_impl = impl  # what Megatron-LM's config carries (megatron's wrapper reads it)
    return model


def _write(directory: str, name: str, yaml_text: str | None) -> str | None:
    if yaml_text is None:
        return None
    path = os.path.join(directory, f"{name}.yaml")
    if torch.distributed.get_rank() == 0:
        with open(path, "w") as f:
            f.write(yaml_text)
    torch.distributed.barrier()
    return path


def _units(model) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    top = model.module
    return [name for name, m in top.named_modules() if name and isinstance(m, FSDPModule)]


class _Meter(contextlib.AbstractContextManager):
    """Bytes saved for backward in the first step's forward (recompute_modules lowers them)."""

    def __init__(self, out: list[int]) -> None:
        from mindspeed_like.testing.memory import SavedBytesMeter

        self.out, self.meter = out, SavedBytesMeter()

    def __enter__(self):
        self.meter.__enter__()
        return self

    def __exit__(self, *exc):
        self.meter.__exit__(*exc)
        self.out.append(self.meter.bytes)


def _megatron_group_error(model) -> str | None:
    """What megatron's own ``get_data_parallel_group_if_dtensor`` (our wrapper peeled off) says of a
    parameter of this model: a 2-D (HSDP) mesh has no single group."""
    from megatron.core import utils

    original = getattr(
        utils.get_data_parallel_group_if_dtensor, "__wrapped__", utils.get_data_parallel_group_if_dtensor
    )
    try:
        original(next(model.parameters()))
    except RuntimeError as error:
        return str(error)
    return None


def train_cases(cases: list[dict], directory: str) -> dict:
    """``cases``: dicts of ``name``, ``impl``, ``yaml`` (text or None: no config), optional ``overrides``
    (tiny_gpt's). A case whose wrapper refuses its YAML returns ``{"error": message}``."""
    import mindspeed_like
    from mindspeed_like.testing import destroy_parallel, init_parallel
    from mindspeed_like.testing.training import train_steps
    from mindspeed_like.toolkit.errors import ConfigError

    mindspeed_like.configure(device="cpu")
    init_parallel(seed=1234)
    results: dict = {}
    try:
        for case in cases:
            path = _write(directory, case["name"], case["yaml"])
            mindspeed_like.configure(fsdp2_config_path=path)
            model = _model(case["impl"], **case.get("overrides", {}))
            built: dict = {}

            saved: list[int] = []

            def keep(wrapped, optimizer, built=built):
                built["units"] = _units(wrapped)
                built["mesh"] = tuple(wrapped.device_mesh.shape)
                built["megatron_group_error"] = _megatron_group_error(wrapped)

            def meter(step, saved=saved):
                return _Meter(saved) if step == 0 else contextlib.nullcontext()

            try:
                losses = train_steps(
                    model,
                    STEPS,
                    lr=1e-2,
                    data_parallel="torch_fsdp2",
                    finalize_grads=True,
                    on_optimizer=keep,
                    forward_context=meter,
                )
            except ConfigError as error:
                results[case["name"]] = {"error": str(error)}
                continue
            results[case["name"]] = {"losses": losses, "saved_bytes": saved[0], **built}
    finally:
        mindspeed_like.configure(fsdp2_config_path=None)
        destroy_parallel()
    return results
