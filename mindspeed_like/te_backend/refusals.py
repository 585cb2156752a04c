"""What the TE-compatible backend does not implement, refused with the TE feature's name and the
alternative, at the earliest point it can be seen (argument validation for Megatron-LM, module
construction for megatron-core users)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspeed_like.toolkit.errors import FeatureUnsupported


class TransformerEngineFeatureUnsupported(FeatureUnsupported):
    """A TransformerEngine feature that the TE-compatible backend does not provide."""


def refuse(te_feature: str, alternative: str) -> None:
    raise TransformerEngineFeatureUnsupported(
        f"mindspeed_like te-backend: TransformerEngine's {te_feature} is not available without TransformerEngine "
        f"(this backend implements TE's megatron layers on PyTorch kernels, not its CUDA-only features); "
        f"{alternative}"
    )


def _set(value: Any) -> bool:
    return value not in (None, False, 0, "", "none")


# (config field, TE feature, what to do instead, whether a value asks for it): fields of megatron's
# TransformerConfig (and of Megatron-LM's args, which mostly share the names) that ask for a
# TE-only mechanism. Checked when a TE-compatible module is built and, for Megatron-LM, at
# argument validation.
TE_ONLY_FIELDS: tuple[tuple[str, str, str, Callable[[Any], bool]], ...] = (
    ("fp8", "fp8 training (fp8 recipes, fp8_autocast)", "train in bf16 (--bf16)", _set),
    ("fp4", "fp4 training (NVFP4 recipes)", "train in bf16 (--bf16)", _set),
    ("fp8_param", "fp8 parameters", "train in bf16 (--bf16)", _set),
    ("fp8_param_gather", "fp8 parameters (--fp8-param-gather)", "train in bf16 (--bf16)", _set),
    (
        "tp_comm_overlap",
        "userbuffers TP communication overlap (--tp-comm-overlap)",
        "use --use-tiled-tp-overlap (tiled all-gather/reduce-scatter overlap on any device)",
        _set,
    ),
    (
        "cpu_offloading",
        "CPU offloading of activations and weights (get_cpu_offload_context)",
        "use --recompute-activation-function or megatron's --recompute-granularity to save activation memory",
        _set,
    ),
    ("delay_wgrad_compute", "delayed weight-gradient computation", "leave --delay-wgrad-compute off", _set),
    ("symmetric_ar_type", "symmetric-memory all-reduce", "leave --symmetric-ar-type unset", _set),
    ("fused_residual_rmsnorm", "fused residual RMSNorm (TEFusedResidualRMSNorm)", "leave it off", _set),
    ("te_rng_tracker", "CUDA RNG states tracker (--te-rng-tracker)", "leave --te-rng-tracker off", _set),
    ("use_te_op_fuser", "operation-based fused MLP (--use-te-op-fuser)", "leave it off", _set),
    ("use_te_activation_func", "activation operations (--use-te-activation-func)", "leave it off", _set),
    (
        "cuda_graph_impl",
        "CUDA graphs (--cuda-graph-impl transformer_engine)",
        "leave --cuda-graph-impl unset",
        lambda value: value == "transformer_engine",
    ),
    ("enable_cuda_graph", "CUDA graphs (--enable-cuda-graph)", "leave it off", _set),
    ("external_cuda_graph", "CUDA graphs (--external-cuda-graph)", "leave it off", _set),
)


def te_only_requests(config: Any) -> list[tuple[str, str, str]]:
    """The TE-only mechanisms ``config`` (a TransformerConfig or Megatron-LM's args) switches on."""
    return [
        (field, te_feature, alternative)
        for field, te_feature, alternative, asks in TE_ONLY_FIELDS
        if asks(getattr(config, field, None))
    ]


def check_config(config: Any) -> None:
    """Refuse the first TE-only mechanism ``config`` asks for."""
    for field, te_feature, alternative in te_only_requests(config):
        refuse(f"{te_feature} [{field}]", alternative)


class _Refused:
    """A TE class megatron builds only for a TE-only option: constructing it says which and why."""

    te_feature = ""
    alternative = ""

    def __new__(cls, *args: Any, **kwargs: Any):
        refuse(cls.te_feature, cls.alternative)


class TEFusedMLP(_Refused):
    te_feature = "operation-based fused MLP (TEFusedMLP, --use-te-op-fuser)"
    alternative = "leave --use-te-op-fuser off; --use-fused-swiglu fuses the MLP's activation"


class TEFusedMLPWithGroupedLinear(_Refused):
    te_feature = "operation-based fused grouped MLP (TEFusedMLPWithGroupedLinear, --use-te-op-fuser)"
    alternative = "leave --use-te-op-fuser off; grouped experts run on TEGroupedMLP's grouped GEMM"


class TEActivationOp(_Refused):
    te_feature = "activation operations (TEActivationOp, --use-te-activation-func)"
    alternative = "leave --use-te-activation-func off; --use-fused-swiglu fuses SwiGLU"
