"""reuse-fp32-param (``--reuse-fp32-param``): bf16 weights live inside their fp32 masters' storage
(Float16 optimizer: 6 -> 4 B/param; DistributedOptimizer at DP>=2: 2 B/param/DP saved), bitwise
identical training. Layouts: ``float16.py``, ``distributed.py``; targets: ``wrappers.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.reuse_fp32_param import live, readers
from mindspeed_like.features.reuse_fp32_param import wrappers as w
from mindspeed_like.features.reuse_fp32_param.float16 import ReuseFp32ParamUnsupported, state_of
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.targets import DISTRIB_OPTIMIZER, OPTIMIZER

NAME = "reuse-fp32-param"
FLOAT16 = f"{OPTIMIZER}.Float16OptimizerWithFloat16Params"
DISTRIB = f"{DISTRIB_OPTIMIZER}.DistributedOptimizer"
HOST = ("cpu-adapter",)  # on a CPU host megatron's own method runs as a host twin inside ours
# DistributedOptimizer methods that read or write masters outside the step (checkpoints, reload),
# with the megatron-core versions that have them (bucket-space format before 0.15, DP-reshardable since).
MASTER_READERS = {
    **dict.fromkeys(
        (
            "state_dict",
            "sharded_state_dict",
            "load_parameter_state_from_dp_zero",
            "load_parameter_state_from_dp_zero_legacy",
            "load_parameter_state_from_fs_model_space",
            "_copy_model_params_to_main_params",
            "_get_main_param_and_optimizer_states",
            "_set_main_param_and_optimizer_states",
        )
    ),
    **dict.fromkeys(("get_parameter_state_fs_bucket_space", "load_parameter_state_from_fs_bucket_space"), "<0.15"),
    **dict.fromkeys(
        (
            "get_parameter_state_dp_reshardable",
            "load_parameter_state_from_dp_reshardable",
            "load_parameter_state_from_fully_reshardable",
        ),
        ">=0.15",
    ),
}
HOST_TWINNED_READERS = ("get_parameter_state_dp_zero", "load_state_dict")


def patches(ctx: Context) -> list[Patch]:
    fall_back = ctx.fallback(NAME, ReuseFp32ParamUnsupported, "keeping megatron's separate fp32 masters")
    why_reader = "reads/writes fp32 masters: materialize"
    return [
        Patch(
            f"{FLOAT16}.__init__",
            Kind.WRAP,
            w.Float16Init(fall_back),
            why="masters move into shared buffers",
            after=HOST,
        ),
        Patch(
            f"{OPTIMIZER}.MixedPrecisionOptimizer.step_with_ready_grads",
            Kind.WRAP,
            w.StepWithReadyGrads(fall_back),
            why="buffers become exact fp32 masters only around the inner optimizer step",
        ),
        Patch(
            f"{FLOAT16}._copy_main_params_to_model_params",
            Kind.WRAP,
            w.copy_main_params_to_model_params,
            why="copy-back replaced by the in-place conversion to bf16 + residual",
        ),
        Patch(
            f"{FLOAT16}._copy_model_params_to_main_params",
            Kind.WRAP,
            w.copy_model_params_to_main_params,
            why="reload_model_params: master = bf16 weight (residuals 0)",
        ),
        Patch(f"{FLOAT16}.state_dict", Kind.WRAP, w.state_dict, why="checkpoints hold plain fp32 masters"),
        Patch(f"{FLOAT16}.load_state_dict", Kind.WRAP, w.load_state_dict, why="loaded fp32 masters re-split in place"),
        Patch(
            f"{OPTIMIZER}.FP32Optimizer.__init__",
            Kind.WRAP,
            w.Fp32Init(ctx.config.sources.get("reuse_fp32_param") == "optimization-level", fall_back),
            why="flag needs bf16: clear error (a logged fallback when --optimization-level 2 switched it on)",
            after=HOST,
        ),
        Patch(
            f"{DISTRIB}.__init__",
            Kind.WRAP,
            w.DistributedInit(fall_back),
            why="master shards become residual shards beside the bf16 param buffer",
            after=HOST,
        ),
        Patch(
            f"{DISTRIB}._copy_main_params_to_model_params",
            Kind.WRAP,
            w.copy_main_params_to_model_params,
            why="copy into the param buffer replaced by the split back to bf16 shard + residual",
        ),
        *[
            Patch(f"{DISTRIB}.{n}", Kind.WRAP, w.materialize_first, why=why_reader, after=HOST)
            for n in HOST_TWINNED_READERS
        ],
        *[
            Patch(f"{DISTRIB}.{n}", Kind.WRAP, w.materialize_first, why=why_reader, versions=versions)
            for n, versions in MASTER_READERS.items()
        ],
        *readers.patches(ctx),  # Megatron-LM's readers of masters (--log-params-norm)
    ]


FEATURE = Feature(
    name=NAME,
    summary="bf16 weights live inside their fp32 masters' storage: 4 B/param instead of 6, bitwise exact",
    patches=patches,
    flags=(
        Flag(
            "reuse_fp32_param",
            bool,
            False,
            "keep each bf16 parameter and its fp32 master in one 4-byte storage (bf16 mixed precision; "
            "Float16OptimizerWithFloat16Params: 6 -> 4 B/param, DistributedOptimizer at DP>=2: "
            "residual shards save 2 B/param/DP; bitwise identical training)",
        ),
    ),
    backend=lambda ctx: "cuda" if ctx.device == "cuda" else "portable",  # kernels.backend_for
    validate_args_hook=w.bf16_required,
    switch_on={"reuse_fp32_param": True},
    before_switch_off=live.before_switch_off,
    optimization_level=2,
    precisions=("bf16",),  # a bf16 weight is the high half of its fp32 master; fp16's is not
)

__all__ = ["FEATURE", "ReuseFp32ParamUnsupported", "state_of"]
