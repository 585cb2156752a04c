"""glibc malloc's settings for a training process whose tensors live in host memory.

Why this matters on a CPU host: torch's CPU allocator is ``posix_memalign`` / ``free``, i.e. glibc
malloc. glibc serves every block above ``M_MMAP_THRESHOLD`` (128 KiB, raised adaptively to at most
32 MiB) with a fresh ``mmap`` and returns it with ``munmap`` on free, and trims the heap's top
above ``M_TRIM_THRESHOLD``. A training step allocates and frees the same large activations every
step (attention scores, expert rows, gradients), so each step asks the kernel for fresh pages and
first-touches every one of them: on the 2-core dev host megatron's MoE preset at 4 layers, hidden
512, seq 1024 took ~450k minor page faults and ~2 s of system time per 2.5 s step
(``benchmarks/host_allocator.py`` prints both).

Tuned: ``M_MMAP_MAX = 0`` (no block is mmapped: freed blocks stay in the heap and the next step
reuses pages already faulted in) and ``M_TRIM_THRESHOLD`` at its largest value (a freed top of
the heap is not given back below 2 GiB). The process then holds its peak between steps, which a
training process reaches every step anyway.

Switching back cannot give the process glibc's untouched state: any ``mallopt`` of these
parameters ends glibc's adaptive threshold for good (``mp_.no_dyn_threshold``), and glibc's
static default (every block above 128 KiB mmapped) is slower than what a running process
reaches by adapting. ``restore()`` therefore sets where the adaptation settles in a training
process, which frees blocks above 32 MiB every step: the mmap threshold at its adaptive maximum
(32 MiB) and the trim threshold at twice that (glibc's own rule), mmap allowed again, then
trims the heap (``malloc_trim``). Measurements of glibc's defaults therefore run in a process
that never switched the feature on (``benchmarks/host_allocator.py`` runs each arm in its own).

The same effect as ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` in the environment, or
``LD_PRELOAD`` of jemalloc / tcmalloc (PyTorch's CPU tuning guide): where the user chose one of
those, :func:`why_not` says so and nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from functools import cache

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4

# where glibc's adaptive thresholds settle (malloc/malloc.c: DEFAULT_MMAP_THRESHOLD_MAX on 64-bit,
# the trim threshold raised to twice the mmap threshold), with glibc's DEFAULT_MMAP_MAX
ADAPTED = {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 64 * 2**20, M_MMAP_MAX: 65536}
TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int
TUNED = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD_MAX}

USER_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc")


@cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def why_not(environ: dict[str, str] | None = None) -> str | None:
    """Why this process's allocator is not ours to tune (None: it is glibc malloc, untouched)."""
    environ = dict(os.environ) if environ is None else environ
    preload = environ.get("LD_PRELOAD", "")
    other = next((name for name in OTHER_ALLOCATORS if name in preload), None)
    if other is not None:
        return f"LD_PRELOAD has {other} ({preload}): that allocator manages host memory, glibc's settings do not apply"
    chosen = [name for name in USER_ENV if name in environ]
    if "malloc." in environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES (glibc.malloc.*)")
    if chosen:
        return f"the environment sets glibc malloc itself ({', '.join(chosen)}): the user's settings stand"
    if _libc() is None:
        return f"the C library is not glibc ({platform.libc_ver()[0] or platform.system()}): nothing to tune"
    return None


def _set(values: dict[int, int]) -> None:
    libc = _libc()
    for param, value in values.items():
        if libc.mallopt(param, value) != 1:
            raise OSError(f"glibc mallopt({param}, {value}) was refused")


def tune() -> None:
    """Keep freed blocks in the heap for reuse (see the module doc). Call only when
    :func:`why_not` is None."""
    _set(TUNED)


def release_free_pages() -> bool:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``: the free top, and the whole
    pages inside free chunks), whatever the settings; False where the C library is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def restore() -> None:
    """glibc's settled adaptive settings (see the module doc), and the retained free memory
    returned to the system."""
    _set(ADAPTED)
    release_free_pages()
