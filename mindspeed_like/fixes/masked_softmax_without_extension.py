"""Fix: ``masked_softmax_fusion`` dies at the first forward without megatron's compiled softmax, on every device.

``megatron.core.fusions.fused_softmax.FusedScaleMaskSoftmax`` (the local spec's attention softmax)
takes its fused path when ``masked_softmax_fusion`` is on (Megatron-LM's default; mbridge's and
verl's configs set it too), the input is fp16/bf16 and the shape fits. That path imports the
compiled extensions ``scaled_masked_softmax_cuda`` (already inside ``is_kernel_available``, for
``get_batch_per_block``) and ``scaled_upper_triang_masked_softmax_cuda`` / ``scaled_softmax_cuda``.
Nothing in megatron-core builds them: they come with apex, or with an old Megatron-LM build step
(core_v0.16.1's ``megatron.legacy.fused_kernels.load`` compiles nothing). Without them a bf16 run
dies at its first forward with ``ModuleNotFoundError: scaled_masked_softmax_cuda``, after start-up,
on a GPU as on a host.

The fix: ``is_kernel_available`` answers False when the extension the call would need is not
installed, so megatron runs its own unfused softmax (``forward_torch_softmax``, the path megatron
takes for every shape the kernel does not fit), said once. Where the extensions are installed
nothing changes. The answer is what megatron itself asks ("can the fused kernel be used?"), so
this is the one target: ``forward`` chooses by it and nothing else calls the fused path.
"""

from __future__ import annotations

import functools
import importlib.util

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.fallback import Fallback

NAME = "fix-masked-softmax-without-extension"
FUSED_SOFTMAX = "megatron.core.fusions.fused_softmax.FusedScaleMaskSoftmax"
_SAID = Fallback(NAME, strict=False, instead="megatron's unfused softmax runs")


@functools.cache
def installed(module: str) -> bool:
    """Whether a compiled extension module can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def needed_extensions(softmax, mask) -> tuple[str, ...]:
    """The compiled modules megatron's fused path imports for this call."""
    from megatron.core.transformer.enums import AttnMaskType

    if softmax.attn_mask_type == AttnMaskType.causal:
        branch = "scaled_upper_triang_masked_softmax_cuda"
    else:
        branch = "scaled_masked_softmax_cuda" if mask is not None else "scaled_softmax_cuda"
    return tuple(dict.fromkeys(("scaled_masked_softmax_cuda", branch)))  # the first: get_batch_per_block


def _kernel_available(wrapped, instance, args, kwargs):
    if getattr(instance, "scaled_masked_softmax_fusion", False):
        mask = args[0] if args else kwargs.get("mask")
        missing = [m for m in needed_extensions(instance, mask) if not installed(m)]
        if missing:
            _SAID.once(
                "masked_softmax_fusion without extension",
                f"{NAME}: masked_softmax_fusion is on but megatron's compiled softmax ({', '.join(missing)}; apex "
                "ships it) is not installed: megatron's unfused softmax runs (the same math, unfused)",
            )
            return False
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        f"{FUSED_SOFTMAX}.is_kernel_available",
        Kind.WRAP,
        _kernel_available,
        why="masked_softmax_fusion imports scaled_masked_softmax_cuda, which nothing builds (ModuleNotFoundError)",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="masked_softmax_fusion without megatron's compiled softmax extension runs megatron's unfused softmax "
    "(was ModuleNotFoundError at the first bf16 forward)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
