"""cpu-compile-cache: torch.compile's graph caches keyed by the CPU vector ISA (on a CPU device).

Why: Inductor writes a CPU graph's C++ for the lanes of one vector ISA (``pick_vec_isa()``: the
host's best, capped by ``ATEN_CPU_CAPABILITY`` or ``cpp.simdlen``), but torch 2.13's FX graph cache
key, and AOTAutograd's built on it, leave that ISA out (torch version, Inductor config and GPU
name are in it; the CPU is not). One cache directory shared by two ISAs (a home or NFS
``TORCHINDUCTOR_CACHE_DIR`` seen by machines of two CPU kinds, or one host whose process is held to
AVX2) then hands a process the C++ written for the other ISA. Seen (issue 56): megatron's
``GroupedMLP.activation_func_with_probs`` (a ``jit_fuser``, i.e. torch.compile) compiled on this
AVX-512 host stepped 16 floats per iteration (``x1 += 16``, ``Vectorized<float>::loadu(p, 16)``);
a process held to AVX2 found the graph by its key and compiled that C++ again with AVX2 flags (the
C++ compile cache keys on the command line, so it builds a new library, from the AVX-512 source).
``Vectorized<float>`` is 8 floats there: each iteration loads and stores 8 of its 16, so half of
the output (``torch.empty``'s memory) is never written and the loss came out NaN, or wrong.

The fix: ``FxGraphHashDetails.__init__``, where both keys are built (``AOTAutogradCacheDetails``
calls it), is wrapped to add one field, the ISA Inductor generates for in this process (torch's
own ``pick_vec_isa()``: what its code generator will use). The key pickles every field, so a graph
is found again only by a process of the same ISA. The directory is left as it is: a user's
``TORCHINDUCTOR_CACHE_DIR`` is used unchanged and keyed too (the shared-directory case is usually
theirs), and ``torch.compiler.config.cache_key_tag`` stays the user's own knob. Nothing else in the
cache needs it: the C++ libraries and Triton kernels are keyed by their source and compile flags.
Removed by ``configure(device=...)`` off the CPU or ``mindspeed_like.reset()``; the report lists
the wrap as a global change and ``mindspeed-like report`` prints the cache directory in use.
"""

from __future__ import annotations

import os

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Context, Feature, on_device

NAME = "cpu-compile-cache"
TARGET = "torch._inductor.codecache.FxGraphHashDetails.__init__"
KEY_FIELD = "mindspeed_like_cpu_vec_isa"
"""The field added to every FX graph / AOTAutograd cache key (torch's debug log of a key shows it)."""


def vec_isa() -> str:
    """The vector ISA Inductor's C++ code generator uses in this process, as torch names it
    (``"avx2"``, ``"avx512"``, ``"avx512 avx512_vnni amx_tile"``; ``"INVALID_VEC_ISA"``: scalar code).

    torch's own ``pick_vec_isa()``, so the key names exactly what the generated code assumes: it
    honours ``ATEN_CPU_CAPABILITY``, Inductor's ``cpp.simdlen`` and what the host and its compiler
    can build. Called while a graph is being keyed, when Inductor is loaded and about to pick it
    anyway (its build probe is cached per process)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


def key_with_isa(wrapped, instance, args, kwargs) -> None:
    """``FxGraphHashDetails.__init__``, then the ISA as one more field of the key."""
    wrapped(*args, **kwargs)
    setattr(instance, KEY_FIELD, vec_isa())


def cache_dir_in_use() -> tuple[str, str]:
    """Where Inductor caches in this process and why there, read without creating it.

    A ``TORCHINDUCTOR_CACHE_DIR`` equal to torch's default counts as the default: torch writes the
    variable itself the first time it asks for its cache directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen or os.path.abspath(chosen) == default:
        return default, "torch's default: TORCHINDUCTOR_CACHE_DIR unset"
    return os.path.abspath(chosen), "TORCHINDUCTOR_CACHE_DIR, set by you: used as it is"


def describe() -> str:
    """One line for ``mindspeed-like report``: the cache directory, why that one, and the ISA key."""
    directory, why = cache_dir_in_use()  # first: asking for the ISA may create the default directory
    return (
        f"torch.compile cache: {directory} ({why}); {NAME} keys its graphs by the CPU vector ISA "
        f"{vec_isa()!r}, which torch's FX graph and AOTAutograd cache keys leave out"
    )


WHY = (
    f"every FX graph and AOTAutograd cache key gets the field {KEY_FIELD} (the vector ISA Inductor generates "
    "for): torch's key leaves it out, and C++ written for AVX-512 read by an AVX2 process writes half of each "
    "output (issue 56)"
)


def _patches(ctx: Context) -> list[Patch]:
    # Optional: a torch without this class (a later layout) keeps working, said once (an error under
    # --strict) with what to do instead.
    missing = ctx.fallback(
        NAME, instead="compiled graphs are not keyed by the CPU ISA: give each CPU kind its own TORCHINDUCTOR_CACHE_DIR"
    )
    return [
        Patch(
            TARGET,
            Kind.WRAP,
            key_with_isa,
            optional=True,
            on_missing=missing,
            global_change=True,
            counts_as_reached=False,  # every compiled graph is keyed, whatever megatron runs
            why=WHY,
        )
    ]


FEATURE = Feature(
    name=NAME,
    summary="torch.compile's FX graph and AOTAutograd caches keyed by the CPU vector ISA Inductor generates for "
    "(declared global change)",
    patches=_patches,
    enabled=on_device("cpu"),
    backend="cpu",
    switched_by="--device cpu (auto: no NPU, no CUDA)",
    kind="adapter",
)

__all__ = ["FEATURE", "NAME", "cache_dir_in_use", "describe", "vec_isa"]
