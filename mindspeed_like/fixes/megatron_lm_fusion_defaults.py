"""Fix: Megatron-LM's default fusions that need TransformerEngine or apex, switched off where absent (every device).

Megatron-LM's arguments turn on, unless the user passes ``--no-...``, fusions whose kernels megatron
does not ship (read in core_v0.16.1's ``megatron/training/arguments.py`` and megatron-core):

* ``--apply-rope-fusion`` (``--no-rope-fusion``): TransformerEngine's ``fused_apply_rotary_pos_emb``;
  without TE ``TransformerConfig.__post_init__`` raises "apply_rope_fusion is not available. Please
  install TE >= 1.4.". The te-backend serves it (TE 2.1's fused RoPE on our kernel), so it is switched
  off only with the backend off, or for what TE 2.1's fused RoPE does not cover (interleaved
  rotation, multi-latent attention's Triton kernel): ``toolkit.transformer_engine.rope_fusion_unavailable``.
  Our fused RoPE kernel is also ``--use-fused-rotary-pos-emb`` (level 1).
* ``--gradient-accumulation-fusion``: apex's ``fused_weight_gradient_mlp_cuda`` for megatron's own
  linears (TE's linears fuse it themselves); without it ``ColumnParallelLinear`` raises at model
  build.
* persistent LayerNorm (``--no-persist-layer-norm`` off): apex's FastLayerNorm; the local spec's
  torch norm asserts "persist_layer_norm not supported by torch LayerNorm".

On a GPU without TE or apex (issue 36's H100) each stopped the run at start-up unless the user knew
the ``--no-...`` flags; the cpu-training-loop switched them on a CPU host only. Here, on every
device, each default whose kernel is absent is switched to megatron's unfused choice before
``validate_args`` derives anything from it, each change logged (rank 0), as the cpu-training-loop
does. Only Megatron-LM's defaults are changed (these are store-false options: a user cannot ask
for them by name). ``--masked-softmax-fusion`` needs no switch: fix-masked-softmax-without-extension
runs megatron's unfused softmax where the compiled extension is absent, for every client.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

from mindspeed_like.toolkit import transformer_engine
from mindspeed_like.toolkit.argument_changes import say_adjusted
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-lm-fusion-defaults"


@functools.cache
def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fusion_defaults(args) -> list[str]:
    """Switch the fusions whose kernels are absent to megatron's unfused choice; one line per change."""
    changes: list[str] = []

    def change(name: str, value, why: str) -> None:
        if hasattr(args, name) and getattr(args, name) != value:
            changes.append(f"args.{name}: {getattr(args, name)!r} -> {value!r} ({why})")
            setattr(args, name, value)

    te = transformer_engine.installed()
    rope = getattr(args, "position_embedding_type", "rope") in ("rope", "mrope")
    if rope and getattr(args, "apply_rope_fusion", False):
        why = transformer_engine.rope_fusion_unavailable(args)
        if why is not None:
            change("apply_rope_fusion", False, why)
    te_linears = te and getattr(args, "transformer_impl", None) == "transformer_engine"
    if not te_linears and not _installed("fused_weight_gradient_mlp_cuda"):
        change("gradient_accumulation_fusion", False, "megatron's linears need apex's fused_weight_gradient_mlp_cuda")
    if not _installed("apex"):
        change("no_persist_layer_norm", True, "persistent LayerNorm is apex's")
    return say_adjusted(NAME, args, changes)


@contextlib.contextmanager
def switch_absent_fusions(args) -> Iterator[None]:
    """validate_args hook: the absent fusions switched before validation."""
    fusion_defaults(args)
    yield


FEATURE = Feature(
    name=NAME,
    summary="Megatron-LM's default fusions that need TransformerEngine/apex (RoPE fusion, gradient-accumulation "
    "fusion, persistent LayerNorm) are switched off, logged, where those are absent, on every device",
    enabled=always_on,
    backend="any",
    validate_args_hook=switch_absent_fusions,
    kind="fix",
)
