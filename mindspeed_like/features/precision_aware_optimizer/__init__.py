"""precision-aware-optimizer: megatron's ``--use-precision-aware-optimizer`` (bf16/fp16/fp8 Adam
moments, bf16 main grads, int16 master remainders) without TransformerEngine. On by default and
acting only when megatron's OptimizerConfig asks for it and TE's FusedAdam is absent; megatron's
own flags are the interface. Kernel: ``kernels/adam.py``; targets: ``optimizer.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.precision_aware_optimizer import optimizer as o
from mindspeed_like.toolkit.declaration import Context, Feature, Flag

NAME = "precision-aware-optimizer"


def patches(ctx: Context) -> list[Patch]:
    return [
        Patch(
            f"{o.CONFIG_MODULE}.OptimizerConfig.__post_init__",
            Kind.WRAP,
            o.ConfigPostInit(),
            why="no TE import demanded when our Adam stands in for FusedAdam",
        ),
        *[
            Patch(
                f"{module}.is_te_min_version",
                Kind.REPLACE,
                o.te_min_version,
                update_aliases=False,
                versions=">=0.13",
                why=f"TE version checks of the optimizer path answer for our Adam (TE API {o.TE_API}) without TE",
            )
            for module in (o.CONFIG_MODULE, o.OPTIMIZER_MODULE)
        ],
        Patch(
            f"{o.OPTIMIZER_MODULE}._get_megatron_optimizer_based_on_param_groups",
            Kind.WRAP,
            o.BuildOptimizer(
                reuse_fp32_param=bool(ctx.config.get("reuse_fp32_param", False)),
                resolve_conflict=ctx.resolve_conflict,
            ),
            why="precision-aware configs get PrecisionAwareAdam instead of torch's AdamW",
        ),
    ]


@contextlib.contextmanager
def check_megatron_args(args) -> Iterator[None]:
    """validate_args hook (Megatron-LM): --reuse-fp32-param with --use-precision-aware-optimizer is a
    start-up conflict, raised before validation (both are parsed values validate_args only reads):
    the level's reuse-fp32-param steps aside; both given by name, the error naming both."""
    if getattr(args, "use_precision_aware_optimizer", False) and getattr(args, "reuse_fp32_param", False):
        raise o.conflict()
    yield


FEATURE = Feature(
    name=NAME,
    summary="megatron's precision-aware optimizer (bf16/fp8 moments, bf16 grads, int16 remainders) without TE",
    patches=patches,
    flags=(
        Flag(
            "no_portable_precision_aware_optimizer",
            bool,
            False,
            "off switch: by default, when megatron's optimizer config asks for the precision-aware "
            "optimizer (--use-precision-aware-optimizer) and TransformerEngine's FusedAdam is absent, "
            "mindspeed_like's Adam with the same contract runs; with this flag megatron's own path "
            "(its TE error) is kept",
        ),
    ),
    enabled=lambda ctx: not ctx["no_portable_precision_aware_optimizer"],
    switched_by="megatron's --use-precision-aware-optimizer without TE (on by default)",
    backend=lambda ctx: "cuda" if ctx.device == "cuda" else "portable",  # kernels.backend_for
    validate_args_hook=check_megatron_args,
    switch_on={"no_portable_precision_aware_optimizer": False},
    switch_off={"no_portable_precision_aware_optimizer": True},
    optimization_level=1,
)

__all__ = ["FEATURE"]
