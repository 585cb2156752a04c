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
option; megatron-core 0.16.1 leaves two links of it unwired (made here), 0.17.1 the same two (its buffers'
dtypes are options there), 0.18.2 and 0.19.2 have them as options, and the Adam is ours where
TE's FusedAdam is absent (precision-aware-optimizer). Releases with a Megatron-FSDP but no layout read and
run here (0.13-0.15) say so once when its wrapper is built. Targets: ``state.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.megatron_fsdp_lean_state import state as s
from mindspeed_like.toolkit.declaration import Context, Feature, Flag

NAME = "megatron-fsdp-lean-state"
PRESERVE_FP32_WEIGHTS = ">=0.16,<0.17"
"""0.16's layout (read and measured on 0.16.1): ``preserve_fp32_weights`` / ``grad_reduce_in_fp32`` and two
links made here."""
MAIN_PARAMS_DTYPE = ">=0.17,<0.18"
"""0.17's layout (read and measured on 0.17.1): ``megatron_fsdp_main_params_dtype`` /
``megatron_fsdp_main_grads_dtype`` with ``grad_reduce_in_fp32`` off, and 0.16's two links."""
DECOUPLED_GRAD = ">=0.18,<0.19"
"""0.18's layout (read and measured on 0.18.2): 0.19's three options with ``grad_reduce_in_fp32`` off."""
MIXED_PRECISION_POLICY = ">=0.19"
"""0.19's layout (read and measured on 0.19.2): ``megatron_fsdp_main_params_dtype`` /
``megatron_fsdp_main_grads_dtype`` / ``megatron_fsdp_use_decoupled_grad``."""


@dataclass(frozen=True)
class Layout:
    """How one range of releases is made lean: the ``DistributedDataParallelConfig`` fields set on the
    wrapper's copy, whether the buffer's ``use_precision_aware_optimizer`` link is made here
    (``link_buffer``), whether the grad norm is read from the decoupled gradients here (``grad_norm``),
    and whether the Adam's ``master_weights`` is set back where megatron clears it (``keep_masters``)."""

    versions: str
    ddp_changes: tuple[tuple[str, object], ...]
    link_buffer: bool
    grad_norm: bool
    keep_masters: bool


LAYOUTS = (
    Layout(PRESERVE_FP32_WEIGHTS, s.LEAN_DDP, link_buffer=True, grad_norm=True, keep_masters=False),
    Layout(MAIN_PARAMS_DTYPE, s.LEAN_DDP_MAIN_PARAMS_DTYPE, link_buffer=True, grad_norm=True, keep_masters=False),
    Layout(DECOUPLED_GRAD, s.LEAN_DDP_DECOUPLED_GRAD, link_buffer=False, grad_norm=False, keep_masters=True),
    Layout(MIXED_PRECISION_POLICY, s.LEAN_DDP_MIXED_PRECISION, link_buffer=False, grad_norm=False, keep_masters=True),
)
VERSIONS = tuple(layout.versions for layout in LAYOUTS)
"""The releases whose Megatron-FSDP buffers and optimizer path were read and measured."""
NO_LAYOUT = (
    (s.CUSTOM_FSDP_INIT, "<0.14", s.NO_LAYOUT_CUSTOM_FSDP),
    (s.FSDP_INIT, ">=0.14,<0.16", s.NO_LAYOUT_NOT_RUN),
)
"""Where Megatron-FSDP exists but no layout is served: its wrapper, the releases and the line a wrapper built
with the feature on says once (``state.NoLayout``). 0.13's ``custom_fsdp`` does not run on a CPU host; 0.14.0's
and 0.15.3's buffers read as 0.16's, but their Megatron-FSDP does not build with torch 2.13 (its mesh code
reads ``_MeshEnv.child_to_root_mapping``, gone from torch), megatron's own arm included, so nothing was
measured there."""


def layout_of(release: object) -> Layout | None:
    """The layout of megatron-core ``release`` (a Version), None where none was read."""
    from mindspeed_like.megatron_version import release_in

    return next((layout for layout in LAYOUTS if release_in(layout.versions, release)), None)


def acts_on(release: object) -> bool:
    """Whether megatron-core ``release`` (a Version; None: none installed) is in one of :data:`VERSIONS`
    (for tools that predict a run without applying the patches: ``mindspeed-like plan``)."""
    return layout_of(release) is not None


def acts_with_installed_megatron() -> bool:
    """:func:`acts_on` the installed megatron-core."""
    from mindspeed_like.megatron_version import megatron_core_version

    return acts_on(megatron_core_version())


def patches(ctx: Context) -> list[Patch]:
    fall_back = ctx.fallback(NAME, instead="keeping Megatron-FSDP's own buffers")
    out = []
    for layout in LAYOUTS:
        out += [
            Patch(
                s.FSDP_INIT,
                Kind.WRAP,
                s.LeanBuffers(fall_back, layout.ddp_changes),
                why="no fp32 main-weight buffer, bf16 gradient buffers (bf16 runs under Megatron-FSDP)",
                versions=layout.versions,
                after=("cpu-adapter",),  # the host twin builds the wrapper from the config handed on here
                before=("fix-megatron-fsdp-no-shard",),  # its refusal comes first
            ),
            Patch(
                s.GET_OPTIMIZER,
                Kind.WRAP,
                s.LeanOptimizer(link_buffer=layout.link_buffer, keep_masters=layout.keep_masters),
                why="the precision-aware optimizer (remainder masters, bf16 moments) over the lean buffers",
                versions=layout.versions,
                before=("precision-check",),  # the run's precision is checked first
            ),
        ]
        if layout.grad_norm:  # 0.18+ read .decoupled_grad of Megatron-FSDP parameters themselves
            out.append(
                Patch(
                    s.GRADS_FOR_NORM,
                    Kind.WRAP,
                    s.grads_for_norm,
                    versions=layout.versions,
                    why="the grad norm of a lean optimizer reads its decoupled gradients (megatron reads .grad, None)",
                )
            )
    for target, versions, line in NO_LAYOUT:
        order = {"after": ("cpu-adapter",), "before": ("fix-megatron-fsdp-no-shard",)} if target == s.FSDP_INIT else {}
        out.append(
            Patch(
                target,
                Kind.WRAP,
                s.NoLayout(fall_back, line.format(release=ctx.megatron_version)),
                versions=versions,
                why="no lean layout for this release's Megatron-FSDP: said once when its wrapper is built",
                **order,
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
    "DECOUPLED_GRAD",
    "FEATURE",
    "LAYOUTS",
    "MAIN_PARAMS_DTYPE",
    "MIXED_PRECISION_POLICY",
    "NAME",
    "NO_LAYOUT",
    "PRESERVE_FP32_WEIGHTS",
    "VERSIONS",
    "Layout",
    "acts_on",
    "acts_with_installed_megatron",
    "layout_of",
]
