"""te-backend: megatron's TransformerEngine layers on every device, without TransformerEngine.

megatron-core builds its TE specs (``get_gpt_layer_with_transformer_engine_spec``,
``get_gpt_decoder_block_spec(use_transformer_engine=True)``, the MTP and MoE specs, HybridModel's)
and Megatron-LM's default ``--transformer-impl transformer_engine`` from the wrapper classes in
``megatron.core.extensions.transformer_engine``; without TE those are ``MagicMock`` stand-ins or
None, and the spec modules never bind ``TESpecProvider``/``TENorm``. Where no real
TransformerEngine is installed, this feature binds megatron's names to our classes (TE's
constructor contracts, forward returns, parameter names, ``sharded_state_dict`` keys and
``_extra_state``), built on megatron's own parallel layers and our kernels, so every other
feature acts on TE-spec models as on local-spec ones:

  module here            megatron names                                   built on
  norm.py                TENorm                                           megatron's torch norm (fused-rmsnorm)
  linear.py              TELinear, TEColumnParallelLinear, TERowParallel  ColumnParallelLinear/RowParallelLinear
  layernorm_linear.py    TELayerNormColumnParallelLinear                  norm + ColumnParallelLinear
  attention.py           TEDotProductAttention                            DotProductAttention (flash, CP)
  grouped_linear.py      TEGroupedLinear, TE{Column,Row}ParallelGrouped   the grouped-GEMM kernel
  rope.py                fused_apply_rotary_pos_emb(_thd) (rope_utils')   our RoPE kernel (TE 2.1's contract)
  refusals.py            TEFusedMLP, TEActivationOp, ...                  a clear error naming the TE feature
  guarded_classes.py     megatron's classes defined under `if HAVE_TE:`   megatron's class body on the above
  llava.py               LLaVA's SP/CP check (HAVE_TE while it builds)     megatron's LLaVAModel

Where the names are bound (``megatron_names.py``, read from the installed source): the extension
module itself, and every megatron module that took them by name at import (PROVIDE patches:
unbound, None or a MagicMock stand-in before; megatron's own objects again after ``reset()``).
megatron keeps seeing no TE anywhere else (``HAVE_TE`` stays False: no TE optimizer, no fp8);
TE-only mechanisms (fp8, userbuffers, CUDA graphs, TE's CPU offload) are refused with the
alternative (``refusals.py``). A real TransformerEngine is never shadowed: with one installed
the feature is off. docs/features/te-backend.md has the coverage per class and release.
"""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Iterator
from typing import Any

from mindspeed_like.engine import Deferred, Kind, Patch
from mindspeed_like.te_backend import fsdp2, megatron_names
from mindspeed_like.te_backend.fallbacks import TransformerConfigFallbacks
from mindspeed_like.te_backend.llava import LLAVA, TEAttentionAllowsParallelism
from mindspeed_like.te_backend.megatron_names import EXTENSION, SPEC_PROVIDER
from mindspeed_like.te_backend.vision_norm import CLIP_VIT, NormFromTheBackend
from mindspeed_like.toolkit import transformer_engine
from mindspeed_like.toolkit.declaration import Context, Feature, Flag

NAME = "te-backend"
CLASSES = "mindspeed_like.te_backend.classes"
ROPE = "mindspeed_like.te_backend.rope"
GUARDED = "mindspeed_like.te_backend.guarded_classes"
VERSIONS = "mindspeed_like.te_backend.versions"

OURS = (
    "TENorm",
    "TELinear",
    "TEColumnParallelLinear",
    "TERowParallelLinear",
    "TELayerNormColumnParallelLinear",
    "TEDotProductAttention",
    "TEGroupedLinear",
    "TEColumnParallelGroupedLinear",
    "TERowParallelGroupedLinear",
    "TEFusedMLP",
    "TEFusedMLPWithGroupedLinear",
    "TEActivationOp",
)
"""The names of megatron's extension module that get our classes (the others, TE's fp8 recipes, RNG
tracker, fused permute / cross-entropy kernels, are only used on paths TE-only options open)."""

FUNCTIONS = ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd")
"""megatron's functions over TE's kernels that the backend binds (``rope.py``: megatron's
``apply_rope_fusion``) where megatron's modules take them from the extension module (``rope_utils``:
None without TE). Not in the extension module itself: there they are unbound without TE, and a
module importing them while they were bound there would keep ours after ``reset()`` (an unbound
name has no stand-in whose aliases the engine could swap back)."""


def is_te_stand_in(value: Any) -> bool:
    """What megatron binds in place of TE's layers when TE is absent: a ``MagicMock`` (its
    ``te = MagicMock()`` makes every ``class X(te.pytorch.Y)`` one), or its own wrapper class that
    needs TE to construct (``TENorm``)."""
    return isinstance(value, unittest.mock.NonCallableMock) or (
        isinstance(value, type) and value.__module__ == EXTENSION
    )


def _ours(module: str, name: str) -> Deferred:
    if name == "TESpecProvider":
        return Deferred(SPEC_PROVIDER, "TESpecProvider")
    return Deferred(ROPE, name) if name in FUNCTIONS else Deferred(CLASSES, name)


def patches(ctx: Context) -> list[Patch]:
    provided = set(OURS) | set(FUNCTIONS) | {"TESpecProvider"}
    result = [
        Patch(
            f"{EXTENSION}.{name}",
            Kind.PROVIDE,
            Deferred(CLASSES, name),
            placeholder=is_te_stand_in,
            why="megatron's TE layer class, on megatron's parallel layers and our kernels",
        )
        for name in OURS
        if name in megatron_names.names_of(EXTENSION)
    ]
    for module, names in megatron_names.importers().items():
        result += [
            Patch(
                f"{module}.{name}",
                Kind.PROVIDE,
                _ours(module, name),
                placeholder=is_te_stand_in,
                why="taken by name from megatron's TE extension modules (unbound or None without TE)",
            )
            for name in names
            if name in provided
        ]
    for module, names in megatron_names.te_guarded_classes().items():
        for name in names:
            ours = Deferred(GUARDED, f"{module}:{name}")
            result += [
                Patch(
                    f"{where}.{name}",
                    Kind.PROVIDE,
                    ours,
                    placeholder=is_te_stand_in,
                    why="megatron defines it only under `if HAVE_TE:` on TE's wrapper classes (guarded_classes.py)",
                )
                for where in (module, *megatron_names.importers_of(module, name))
            ]
    result.append(
        Patch(
            "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__",
            Kind.WRAP,
            TransformerConfigFallbacks(ctx.fallback(NAME, instead="megatron's unfused path")),
            why="TE-only fusions clients set in code (moe_permute_fusion) switched off, said once (fallbacks.py)",
        )
    )
    result.append(
        Patch(
            f"{CLIP_VIT}.CLIPViTModel.__init__",
            Kind.WRAP,
            NormFromTheBackend(),
            why="its NORM_IMPL default is torch's LayerNorm without TE, which takes no config= (vision_norm.py)",
        )
    )
    result.append(
        Patch(
            f"{LLAVA}.LLaVAModel.__init__",
            Kind.WRAP,
            TEAttentionAllowsParallelism(),
            why="LLaVA allows SP/CP only with TEDotProductAttention and its module's HAVE_TE (llava.py)",
        )
    )
    result.append(
        Patch(
            fsdp2.TARGET,
            Kind.WRAP,
            fsdp2.shard_as_under_te,
            after=("cpu-adapter",),
            why="--use-torch-fsdp2 shards ColumnParallelLinear instances: our TE layers are, TE's are not (fsdp2.py)",
        )
    )
    spec_provider_names = megatron_names.names_of(SPEC_PROVIDER)
    result += [
        Patch(
            f"{SPEC_PROVIDER}.{name}",
            Kind.REPLACE,
            Deferred(VERSIONS, ours),
            update_aliases=False,  # megatron.core.utils' own stays: elsewhere megatron sees no TE
            why="TESpecProvider's TE version checks answer for the TE layer API this backend implements",
        )
        for name, ours in (("is_te_min_version", "te_layers_min_version"), ("get_te_version", "te_layers_version"))
        if name in spec_provider_names
    ]
    return result


@contextlib.contextmanager
def refuse_te_only_arguments(args) -> Iterator[None]:
    """validate_args hook: a TE-only option on Megatron-LM's command line is an error now, naming
    it and the alternative, not an ImportError in the middle of model construction; so is an
    ``--attention-backend`` the TE-spec model cannot honour (``attention_backend.check_attention_backend``)."""
    from mindspeed_like.te_backend.attention_backend import check_attention_backend
    from mindspeed_like.te_backend.refusals import check_config

    check_config(args)
    check_attention_backend(args)
    yield


def enabled(ctx: Context) -> bool:
    return not ctx["no_te_backend"] and not transformer_engine.installed()


FEATURE = Feature(
    name=NAME,
    summary="megatron's TransformerEngine layers (TE specs, --transformer-impl transformer_engine, HybridModel) "
    "without TransformerEngine, on megatron's parallel layers and our kernels",
    patches=patches,
    flags=(
        Flag(
            "no_te_backend",
            bool,
            False,
            "off switch: leave megatron's TE names as megatron binds them without TransformerEngine (TE specs then "
            "cannot be built); the backend is never on where a real TransformerEngine is installed",
        ),
    ),
    enabled=enabled,
    backend=lambda ctx: "off: TransformerEngine is installed" if transformer_engine.installed() else ctx.kernel_backend,
    switched_by="no TransformerEngine installed (off: --no-te-backend)",
    validate_args_hook=refuse_te_only_arguments,
    kind="adapter",
)

__all__ = ["FEATURE", "is_te_stand_in"]
