"""Opt-in: the import line in every process a client starts, with no change to the client.

torch imports every entry point of the group ``torch.backends`` at ``import torch`` (its device
extension autoload, ``torch/__init__.py`` ``_import_device_backends``; off for all extensions with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). Ours is :func:`load`. With ``MINDSPEED_LIKE_AUTOLOAD=1`` it
puts :class:`_Trigger` first on ``sys.meta_path``; the first import of a module of megatron,
mcore_bridge or transformer_engine after torch's own import has finished then runs
``import mindspeed_like.megatron_adaptor`` (flags from ``MINDSPEED_LIKE_ARGS`` as always) and
lets that import go on. So ``megatron sft`` (ms-swift), torchrun workers and Ray workers get the
adaptor before they import megatron, mcore-bridge or ``transformer_engine``, without editing them.

Why a package of its own, outside ``mindspeed_like``: torch imports this module in EVERY process
of the environment. ``mindspeed_like/__init__.py`` imports the patch engine (wrapt, ...), so a
module inside it would cost every process that never asked. This one imports nothing that is not
loaded by then (``os``, ``sys``, ``typing``) unless the variable asks, and does nothing else
(docs/clients.md has the measured cost).

Why deferred to that first import and not done here: this runs INSIDE ``import torch`` (near its
end, but torch is not complete), and the adaptor builds its config from torch (device detection,
kernels). The trigger lets imports pass while torch's module, or a module of megatron,
mcore_bridge or transformer_engine, is still executing its body on this thread: applying patches
to half-executed modules would find targets missing, and te-client-module must let megatron
decide ``HAVE_TE`` before it serves anyone. So when megatron itself is the first import
(``import megatron.core`` imports torch), the adaptor comes in at the first import of a megatron
module that ``megatron.core`` did not import itself (a model, a spec, Megatron-LM's training):
after megatron-core, before the model is built, which the adaptor supports like any import order.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

ENV = "MINDSPEED_LIKE_AUTOLOAD"
WATCHED = ("megatron", "mcore_bridge", "transformer_engine")

_trigger = None  # the installed _Trigger, None when not asked (or already fired)


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``MINDSPEED_LIKE_AUTOLOAD`` asks for the adaptor: "1" yes; unset, empty or "0" no.
    Anything else is a ValueError naming the variable: a value meant to switch it on ("true",
    "yes") must not silently leave the process without the adaptor."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if value.strip() in ("", "0"):
        return False
    if value.strip() == "1":
        return True
    raise ValueError(
        f"{ENV}={value!r}: expected 1 (apply mindspeed_like.megatron_adaptor in every process that imports "
        f"megatron, mcore_bridge or transformer_engine) or 0 (off; unset is off too)"
    )


def load() -> None:
    """torch's ``torch.backends`` entry point: installs the trigger when asked, else nothing.

    A bad value fails ``import torch`` (torch names this extension and chains our message): the
    process asked for something we cannot tell it has."""
    if requested():
        install()


def install() -> None:
    """Put the trigger first on ``sys.meta_path`` (once)."""
    global _trigger
    if _trigger is None:
        _trigger = _Trigger()
    if _trigger not in sys.meta_path:
        sys.meta_path.insert(0, _trigger)


def uninstall() -> None:
    """Take the trigger off ``sys.meta_path`` (tests; it also removes itself when it fires)."""
    while _trigger is not None and _trigger in sys.meta_path:
        sys.meta_path.remove(_trigger)


def _import_under_way() -> bool:
    """Whether torch, or a module of a WATCHED package, is executing its body on this thread (its
    module frame is on the stack: an import of it is under way). Frames, not ``__spec__._initializing``
    of every module: a walk up this thread's stack is cheap, scanning ``sys.modules`` on each
    import is not, and another thread's import is no reason to wait."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            root = str(frame.f_globals.get("__name__", "")).partition(".")[0]
            if root == "torch" or root in WATCHED:
                return True
        frame = frame.f_back
    return False


class _Trigger:
    """A meta-path finder that finds nothing itself: it fires once, on the first import of a
    WATCHED module that no import of torch or of a WATCHED module is under way around, then hands
    the look-up to the finders on ``sys.meta_path`` as they are after the adaptor
    (te-client-module appends its finder there)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self.fired = False

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.partition(".")[0] not in WATCHED or self.fired or _import_under_way():
            return None
        with self._lock:
            if self.fired:
                return None
            self.fired = True
            uninstall()
            import mindspeed_like.megatron_adaptor  # noqa: F401  (reads MINDSPEED_LIKE_ARGS, applies)
        return _find_spec(fullname, path, target)


def _find_spec(fullname: str, path, target):
    """The spec the finders now on ``sys.meta_path`` give (what the import would have found had
    the trigger not been first). Python's own loop over ``sys.meta_path`` has moved past the
    trigger's slot, which its removal shifted: a finder appended since would not be asked."""
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None
