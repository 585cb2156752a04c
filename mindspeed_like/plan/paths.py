"""Which code path each part of the model takes in one arm: megatron's own, or a feature's.

The memory model asks these questions instead of reading flags: a feature that is switched on but
cannot act on this model (fused-rmsnorm on a LayerNorm model, flash-attention under context
parallelism, where the CP attention runs instead) takes megatron's path here, as it does in a run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from mindspeed_like.plan.spec import Run

MEGATRON = "megatron"
FEATURES = "features"


@dataclass(frozen=True)
class Paths:
    """The paths one arm takes; ``feature`` names the feature behind each non-megatron path."""

    fused_rmsnorm: bool = False
    fused_rope: bool = False
    flash_attention: bool = False
    fused_swiglu: bool = False
    recompute_activation: bool = False
    recompute_activation_layers: int | None = None  # first N layers of each chunk; None: all
    fused_linear_cross_entropy: bool = False
    moe_zero_memory: bool = False
    moe_alltoall_overlap: bool = False  # the alltoall dispatcher's experts run once per local expert
    fused_permute: bool = False
    fused_router: bool = False
    grouped_gemm: bool = False
    reuse_fp32_param: bool = False
    precision_aware_portable: bool = False
    # Megatron-FSDP (bf16, a sharding strategy): masters as int16 remainders, bf16 grads and moments
    megatron_fsdp_lean_state: bool = False
    host_allocator: bool = False  # glibc keeps every freed block (a CPU host only)
    # fsdp2-config's sharding_size under --use-torch-fsdp2 (HSDP): the ranks a parameter is sharded over,
    # where smaller than the data-parallel group (replicated across the groups); None: the whole group
    fsdp_shard_size: int | None = None
    # fsdp2-config's reshard_after_forward (a bool; None: the run's --torch-fsdp2-no-reshard-after-forward) and
    # its explicit prefetch (num_to_forward_prefetch, num_to_backward_prefetch; 0: FSDP2's own)
    fsdp_reshard_after_forward: bool | None = None
    fsdp_prefetch: tuple[int, int] = (0, 0)

    @property
    def any(self) -> bool:
        return any(getattr(self, name) for name in self.__dataclass_fields__ if name != "recompute_activation_layers")


def megatron_paths() -> Paths:
    """megatron-core's own path (level 0: device adapters and fixes only)."""
    return Paths()


def feature_paths(run: Run, enabled: Collection[str], config: Mapping[str, Any]) -> Paths:
    """The paths of the features arm: each switched-on feature (``enabled``: their names; ``config``:
    the resolved flag values) where it acts on ``run``'s model."""
    model, layout = run.model, run.layout
    on = set(enabled)
    bf16 = run.precision.params == "bf16"
    return Paths(
        fused_rmsnorm="fused-rmsnorm" in on and model.normalization == "RMSNorm",
        fused_rope="fused-rotary-pos-emb" in on and model.position_embedding_type == "rope",
        # under CP megatron has no local CP attention: the context-parallel feature's runs in both arms
        flash_attention="flash-attention" in on and layout.cp == 1,
        fused_swiglu="fused-swiglu" in on and model.gated_linear_unit,
        recompute_activation="recompute-activation-function" in on,
        recompute_activation_layers=config.get("recompute_activation_function_num_layers"),
        fused_linear_cross_entropy="fused-linear-cross-entropy" in on,
        moe_zero_memory="moe-zero-memory" in on and model.is_moe,
        # where its pipeline takes the dispatch (features/moe_alltoall_overlap/dispatcher.py why_not): the
        # alltoall dispatcher, EP > 1, expert TP 1, two or more local experts
        moe_alltoall_overlap="moe-alltoall-overlap" in on
        and model.is_moe
        and model.moe_token_dispatcher_type == "alltoall"
        and layout.ep > 1
        and layout.expert_tp == 1
        and model.num_experts // layout.ep >= 2,
        fused_permute="moe-permute" in on and model.is_moe,
        fused_router="moe-router" in on and model.is_moe,
        grouped_gemm="grouped-gemm" in on and model.is_moe,
        # reuse-fp32-param acts on bf16 mixed precision only (megatron's Float16 / Distributed optimizer)
        reuse_fp32_param="reuse-fp32-param" in on and bf16,
        precision_aware_portable="precision-aware-optimizer" in on and run.precision.precision_aware_optimizer,
        megatron_fsdp_lean_state="megatron-fsdp-lean-state" in on
        and bf16
        and layout.fsdp == "megatron_fsdp"
        and layout.sharding_strategy != "no_shard"
        and _lean_state_acts(),
        # it stands aside where the tensors are not in host memory (docs/features/host-allocator.md)
        host_allocator="host-allocator" in on and run.device == "cpu",
        **fsdp2_fields(run, on, config),
    )


def _lean_state_acts() -> bool:
    """megatron-fsdp-lean-state's layouts apply to the megatron-core release predicted (0.16-0.19; on 0.13-0.15
    Megatron-FSDP keeps its own buffers): the installed one, or a record's (:func:`megatron_code.release`)."""
    from mindspeed_like.features.megatron_fsdp_lean_state import acts_on
    from mindspeed_like.plan import megatron_code

    return acts_on(megatron_code.release())


FSDP2_KEYS_MODELED = ("sharding_size", "reshard_after_forward", "num_to_forward_prefetch", "num_to_backward_prefetch")
"""The fsdp2-config keys the plan reads (a reshard_after_forward that is an int, resharding to a smaller
group, is not: said as unmodeled)."""


def fsdp2_fields(run: Run, enabled: Collection[str], config: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`Paths` fields of fsdp2-config's YAML on a --use-torch-fsdp2 run: its HSDP shard group
    (``sharding_size``, where smaller than the data-parallel group x CP), ``reshard_after_forward`` (a
    bool) and its explicit prefetch counts; none without the file or on another path."""
    path = config.get("fsdp2_config_path")
    if "fsdp2-config" not in enabled or not path or run.layout.fsdp != "torch_fsdp2":
        return {}
    from mindspeed_like.features.fsdp2_config.options import load

    group = run.layout.dp * run.layout.cp
    options = load(path)
    options.check_group_size(group, "the data-parallel size x context-parallel size")
    shard = options.shard_size(group)
    reshard = options.reshard_after_forward
    return {
        "fsdp_shard_size": shard if shard < group else None,
        "fsdp_reshard_after_forward": reshard if isinstance(reshard, bool) else None,
        "fsdp_prefetch": (options.num_to_forward_prefetch, options.num_to_backward_prefetch),
    }


def fsdp2_keys_not_modeled(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of an fsdp2-config file the plan does not model (:data:`FSDP2_KEYS_MODELED`)."""
    path = config.get("fsdp2_config_path")
    if not path:
        return ()
    from mindspeed_like.features.fsdp2_config.options import load

    options = load(path)
    modeled = set(FSDP2_KEYS_MODELED)
    if not isinstance(options.reshard_after_forward, bool) and options.reshard_after_forward is not None:
        modeled.discard("reshard_after_forward")
    return tuple(sorted(key for key in options.given if key not in modeled))
