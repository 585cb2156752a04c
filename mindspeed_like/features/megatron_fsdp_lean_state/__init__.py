"""megatron-fsdp-lean-state (``--megatron-fsdp-lean-state``, optimization level 2): the savings of
reuse-fp32-param and the precision-aware optimizer inside Megatron-FSDP's sharded buffers (bf16).

Megatron-FSDP (``optim_grads_params``) keeps per rank a bf16 weight shard, an fp32 master shard (its
main-weight buffer), an fp32 gradient shard and fp32 Adam moments: (2 + 4 + 4 + 8) / DP bytes a
parameter. With this feature, under bf16 only:

- no main-weight buffer (megatron's ``preserve_fp32_weights=False``): the optimizer steps the bf16
  weight shard itself and keeps each fp32 master as that shard plus an int16 remainder (megatron's
  precision-aware optimizer with ``store_param_remainders``; bit for bit the fp32 master, as
  reuse-fp32-param's layout): 2 + 2 instead of 2 + 4;
- bf16 gradient buffers (``grad_reduce_in_fp32=False``, megatron's ``--main-grads-dtype bf16``): 2;
- bf16 Adam moments (``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``): 2 + 2.

(2 + 2 + 2 + 4) / DP = 10 / DP bytes a parameter: 5.0 at DP 2 where megatron-core 0.16 holds 9.0
(0.19, whose gradient buffers are already in the parameters' dtype: 8.0). Every piece is megatron's own
option; megatron-core 0.16.1 leaves two links of it unwired (made here), 0.19.2 has them as options,
and the Adam is ours where TE's FusedAdam is absent (precision-aware-optimizer). Targets: ``state.py``.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.megatron_fsdp_lean_state import state as s
from mindspeed_like.toolkit.declaration import Context, Feature, Flag

NAME = "megatron-fsdp-lean-state"
PRESERVE_FP32_WEIGHTS = ">=0.16,<0.17"
"""0.16's layout (read and measured on 0.16.1): ``preserve_fp32_weights`` / ``grad_reduce_in_fp32`` and
two links made here."""
MIXED_PRECISION_POLICY = ">=0.19"
"""0.19's layout (read and measured on 0.19.2): ``megatron_fsdp_main_params_dtype`` /
``megatron_fsdp_main_grads_dtype`` / ``megatron_fsdp_use_decoupled_grad``."""
VERSIONS = (PRESERVE_FP32_WEIGHTS, MIXED_PRECISION_POLICY)
"""The releases whose Megatron-FSDP buffers and optimizer path were read and measured: 0.13 has no
Megatron-FSDP; 0.14, 0.15, 0.17 and 0.18 were not read (not installed here). Elsewhere the patches are not
applied and Megatron-FSDP keeps its own buffers."""


def acts_on(release: object) -> bool:
    """Whether megatron-core ``release`` (a Version; None: none installed) is in one of :data:`VERSIONS`
    (for tools that predict a run without applying the patches: ``mindspeed-like plan``)."""
    from packaging.specifiers import SpecifierSet

    return release is not None and any(release in SpecifierSet(v) for v in VERSIONS)


def acts_with_installed_megatron() -> bool:
    """:func:`acts_on` the installed megatron-core."""
    from mindspeed_like.megatron_version import megatron_core_version

    return acts_on(megatron_core_version())


def patches(ctx: Context) -> list[Patch]:
    fall_back = ctx.fallback(NAME, instead="keeping Megatron-FSDP's own buffers")
    layouts = (
        (PRESERVE_FP32_WEIGHTS, s.LEAN_DDP, s.LeanOptimizer(link_buffer=True)),
        (MIXED_PRECISION_POLICY, s.LEAN_DDP_MIXED_PRECISION, s.LeanOptimizer(link_buffer=False, keep_masters=True)),
    )
    out = []
    for versions, ddp_changes, optimizer in layouts:
        out += [
            Patch(
                s.FSDP_INIT,
                Kind.WRAP,
                s.LeanBuffers(fall_back, ddp_changes),
                why="no fp32 main-weight buffer, bf16 gradient buffers (bf16 runs under Megatron-FSDP)",
                versions=versions,
                after=("cpu-adapter",),  # the host twin builds the wrapper from the config handed on here
                before=("fix-megatron-fsdp-no-shard",),  # its refusal comes first
            ),
            Patch(
                s.GET_OPTIMIZER,
                Kind.WRAP,
                optimizer,
                why="the precision-aware optimizer (remainder masters, bf16 moments) over the lean buffers",
                versions=versions,
                before=("precision-check",),  # the run's precision is checked first
            ),
        ]
    out.append(  # 0.19 reads .decoupled_grad of Megatron-FSDP parameters itself
        Patch(
            s.GRADS_FOR_NORM,
            Kind.WRAP,
            s.grads_for_norm,
            versions=PRESERVE_FP32_WEIGHTS,
            why="the grad norm of a lean optimizer reads its decoupled gradients (megatron reads .grad, None)",
        )
    )
    return out


FEATURE = Feature(
    name=NAME,
    summary="under Megatron-FSDP (bf16): masters as bf16 shard + int16 remainder, bf16 grads and moments: "
    "10/DP B/param instead of 18/DP",
    patches=patches,
    flags=(
        Flag(
            "megatron_fsdp_lean_state",
            bool,
            False,
            "under --use-megatron-fsdp with bf16: no fp32 main-weight buffer (each master is the bf16 weight "
            "shard plus an int16 remainder in the precision-aware optimizer), bf16 gradient buffers and bf16 "
            "Adam moments: (2+2+2+4)/DP bytes a parameter instead of (2+4+4+8)/DP",
        ),
    ),
    switch_on={"megatron_fsdp_lean_state": True},
    optimization_level=2,
    precisions=("bf16",),
)

__all__ = [
    "FEATURE",
    "MIXED_PRECISION_POLICY",
    "PRESERVE_FP32_WEIGHTS",
    "VERSIONS",
    "acts_on",
    "acts_with_installed_megatron",
]
