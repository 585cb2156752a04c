"""cpu-training-loop, Megatron-LM's arguments: defaults that need CUDA-only extensions.

Megatron-LM's defaults assume CUDA extensions (TransformerEngine layers, NCCL, apex/TE fusions);
where the extension is absent the default is switched to the portable choice before
``validate_args`` derives anything from it, each change logged. TransformerEngine's layers are
the exception while the te-backend is on (wherever TE is not installed, unless --no-te-backend):
megatron's TE wrapper classes are then ours, so ``--transformer-impl transformer_engine`` (the
default) stays and builds the TE-spec model; only with the backend off is it switched to
``local``. So is TE's RoPE fusion (``--apply-rope-fusion``, the default), which the te-backend
serves on our RoPE kernel: switched off only where that does not cover the model
(``transformer_engine.rope_fusion_unavailable``). Runs as the feature's hook of
the one ``validate_args`` wrap (``mindspeed_like.integrations.megatron_lm``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

from mindspeed_like.adapters.cpu.not_adapted import refused_given
from mindspeed_like.toolkit import transformer_engine
from mindspeed_like.toolkit.argument_changes import say_adjusted
from mindspeed_like.toolkit.errors import ConfigError


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def host_defaults(args) -> list[str]:
    """Switch Megatron-LM defaults that need CUDA-only extensions to their portable choices.

    Returns what was changed, one line each (also logged). Called on Megatron's parsed args
    before ``validate_args`` derives anything from them.
    """
    changes = []

    def change(name: str, value, why: str) -> None:
        if hasattr(args, name) and getattr(args, name) != value:
            changes.append(f"args.{name}: {getattr(args, name)!r} -> {value!r} ({why})")
            setattr(args, name, value)

    have_te = transformer_engine.installed()
    if getattr(args, "transformer_impl", None) == "transformer_engine" and not te_layers_available():
        why = "TransformerEngine is not installed and the te-backend is off (--no-te-backend)"
        change("transformer_impl", "local", why)
    if getattr(args, "distributed_backend", None) == "nccl" and not torch.distributed.is_nccl_available():
        change("distributed_backend", "gloo", "this torch has no NCCL")
    if not have_te and getattr(args, "apply_rope_fusion", False):
        # megatron's fused RoPE is TE's; the te-backend serves TE 2.1's (rotate-half, sbhd/thd) on our
        # kernel, so it stays on where that covers the model (the same rule as fix-megatron-lm-fusion-defaults)
        why = transformer_engine.rope_fusion_unavailable(args)
        if why is not None:
            change("apply_rope_fusion", False, why)
    if not _installed("fused_weight_gradient_mlp_cuda"):
        change("gradient_accumulation_fusion", False, "needs apex's fused_weight_gradient_mlp_cuda")
    if not _installed("scaled_masked_softmax_cuda"):
        change("masked_softmax_fusion", False, "needs the scaled_masked_softmax_cuda extension")
    if not _installed("apex"):
        change("no_persist_layer_norm", True, "persistent LayerNorm needs apex")
    parallel = getattr(args, "tensor_model_parallel_size", 1) > 1 or getattr(args, "context_parallel_size", 1) > 1
    if parallel and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and not _max_connections_one_only_warned(args):
        # Megatron asserts this for TP/CP on GPUs (kernel ordering across streams). A host runs
        # in program order, which is what the setting asks for; set it so the check passes.
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        changes.append("CUDA_DEVICE_MAX_CONNECTIONS=1 (host work runs in program order already)")
    return say_adjusted("cpu-training-loop", args, changes)


def _max_connections_one_only_warned(args) -> bool:
    """Where Megatron-LM's ``validate_args`` does not ask ``CUDA_DEVICE_MAX_CONNECTIONS=1`` for TP/CP.

    With ``--use-torch-fsdp2`` or ``--use-megatron-fsdp`` it only warns about TP/CP there and
    asserts the opposite (``!= "1"``: "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large
    than one"), so setting it stopped every FSDP run with TP or CP on a host; with
    ``--overlap-moe-expert-parallel-comm`` it only warns as well.
    """
    return any(
        getattr(args, name, False)
        for name in ("use_torch_fsdp2", "use_megatron_fsdp", "overlap_moe_expert_parallel_comm")
    )


def te_layers_available() -> bool:
    """Whether megatron can build its TE layers here: a real TransformerEngine, or the te-backend's
    classes bound into megatron's extension module (the feature is on; its PROVIDE patches apply
    when that module is imported). Asked of megatron itself, so ``--no-te-backend`` (megatron's
    ``MagicMock`` stand-ins) answers False."""
    return transformer_engine.installed() or transformer_engine.megatron_te_layers_available()


def refuse_host_unsupported(args) -> None:
    """A Megatron-LM flag whose code is CUDA-only (``adapters/cpu/not_adapted.py``: it would crash
    mid-run, after minutes of start-up) stops the run before anything is built, saying why."""
    given = list(refused_given(args).items())
    fraction = getattr(args, "optimizer_offload_fraction", 1.0)
    if getattr(args, "optimizer_cpu_offload", False) and fraction is not None and fraction < 1.0:
        # the cpu adapter runs megatron's HybridDeviceOptimizer on one device (adapters/cpu/
        # hybrid_optimizer.py): alone it steps exactly as AdamW at any fraction, but in
        # pretrain_gpt.py (bf16, distributed + precision-aware optimizer, 10 iterations) fraction 0.5
        # ended at lm loss 5.459 against 5.200 without offload and 5.200 at fraction 1.0
        given.append(
            (
                "optimizer_offload_fraction",
                "below 1.0 with --optimizer-cpu-offload trains visibly slower on a CPU host than without offload "
                "(measured, not understood yet); use --optimizer-offload-fraction 1.0, which trains as without it",
            )
        )
    if given:
        options = [f"--{name.replace('_', '-')}" for name, _ in given]
        lines = [f"{option}: {why.removeprefix(option + ': ')}" for option, (_, why) in zip(options, given)]
        raise ConfigError(
            "these Megatron-LM flags need CUDA and cannot run on this CPU host (drop them, or run on a GPU):\n  "
            + "\n  ".join(lines)
        )


@contextlib.contextmanager
def portable_defaults(args) -> Iterator[None]:
    """validate_args hook: flags a host cannot run are refused, the portable defaults set, before
    validation."""
    refuse_host_unsupported(args)
    host_defaults(args)
    yield
    drop_nccl_stream_priorities(args)


def drop_nccl_stream_priorities(args) -> list[str]:
    """High-priority communication streams are an NCCL communicator option: ``validate_args`` adds
    ``dp_cp`` (and ``ep_dp``) to ``args.high_priority_stream_groups`` for ``--use-torch-fsdp2``
    whatever the device, and ``parallel_state.get_nccl_options`` then builds
    ``torch.distributed.ProcessGroupNCCL.Options``, which a torch without NCCL does not have
    (AttributeError while the process groups are created). Without NCCL there are no streams to
    prioritise: the groups are dropped after validation, said once on rank 0."""
    groups = list(getattr(args, "high_priority_stream_groups", None) or [])
    if not groups or torch.distributed.is_nccl_available():
        return []
    args.high_priority_stream_groups = []
    change = f"args.high_priority_stream_groups: {groups!r} -> [] (an NCCL stream option; this torch has no NCCL)"
    return say_adjusted("cpu-training-loop", args, [change])
