"""The import-system side of the client module: a meta-path finder that serves ``transformer_engine``
(and ``.pytorch``, ``.pytorch.attention``, ``.pytorch.ops``, ``.common.recipe``) from our implementation,
only where no real TransformerEngine is installed, and never to megatron-core.

Never shadows a real TE, structurally: the finder is APPENDED to ``sys.meta_path``, after the path
finder, so a ``transformer_engine`` package anywhere on ``sys.path`` is found before it is asked; it
also checks ``PathFinder`` itself on every request (a TE put on ``sys.path`` after we were
installed still wins), and it serves only the names in :data:`MODULES` (any other
``transformer_engine.*`` is not found: clients' ``try: from transformer_engine.pytorch.optimizers
import ...`` take their fallback).

megatron-core keeps seeing no TE, in any import order. megatron decides ``HAVE_TE`` once per
module, at import, by ``import transformer_engine`` at the module's top level; once our module is
in ``sys.modules`` every later such import would succeed without asking any finder. So the
finder serves nothing until megatron has decided: right after ``megatron.core`` is imported (a
wrapt post-import hook; at once when it already is), every megatron-core module that probes TE at
its top level (:func:`probers.megatron_probers`, read from the installed source) is imported
while the finder declines, so each binds ``HAVE_TE = False``. Requests that arrive while
``megatron.core`` itself is being imported (its ``__init__`` imports probing modules) are declined
as well: only megatron can ask then. A client asking before megatron-core was ever imported makes
the finder import it first (so megatron decides), then it is served. The alternative, declining
by the importing frame's module name, was rejected: ``sys.modules`` hits bypass every finder, so
a megatron module imported after a client would see our module; frame walking is also fragile
through ``importlib.import_module`` / wrapt's own finder. Cost: the probing modules not yet
imported by ``megatron.core`` itself, once (measured 0.75 s on a loaded 2-core host, against
megatron.core's own 5-38 s).

megatron's call-time probes (``megatron.core.utils.get_te_version()`` imports ``transformer_engine``
inside the function) see our module once a client has imported it: they answer
:data:`te_backend.versions.TE_LAYERS_API`, the same as the te-backend's ``TESpecProvider`` does, and
are reached only on TE-gated paths (module-level ``HAVE_TE``, False) or TE-only options (refused).

No distribution metadata is served: ``importlib.metadata.version("transformer-engine")`` still
raises ``PackageNotFoundError``, so probing libraries that check metadata (transformers'
``is_transformer_engine_available``, accelerate's) keep answering "not installed" and never
take their fp8 paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types

import wrapt

from mindspeed_like.te_shim import probers

logger = logging.getLogger("mindspeed_like")

ROOT = "transformer_engine"
MODULES = {
    ROOT: "mindspeed_like.te_shim.client",
    f"{ROOT}.pytorch": "mindspeed_like.te_shim.pytorch",
    f"{ROOT}.pytorch.attention": "mindspeed_like.te_shim.attention",
    f"{ROOT}.pytorch.ops": "mindspeed_like.te_shim.ops",
    f"{ROOT}.pytorch.fp8": "mindspeed_like.te_shim.fp8",
    f"{ROOT}.common": "mindspeed_like.te_shim.common",
    f"{ROOT}.common.recipe": "mindspeed_like.te_shim.recipe",
}
"""Module served -> our module whose ``__all__`` it exposes (packages: those with children here)."""

_PACKAGES = {name.rsplit(".", 1)[0] for name in MODULES if "." in name}
_CHILDREN_IMPORTED = {
    ROOT: (f"{ROOT}.pytorch",),
    f"{ROOT}.pytorch": (f"{ROOT}.pytorch.attention", f"{ROOT}.pytorch.ops", f"{ROOT}.pytorch.fp8"),
}


def real_te_installed() -> bool:
    """A ``transformer_engine`` on ``sys.path`` (the path finder only; never ours)."""
    try:
        return importlib.machinery.PathFinder.find_spec(ROOT, sys.path) is not None
    except (ImportError, ValueError):
        return False


def is_ours(module: object) -> bool:
    spec = getattr(module, "__spec__", None)
    return isinstance(getattr(spec, "loader", None), ClientModuleFinder)


class ClientModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of the client module (one instance while the feature is on)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._settled = False  # megatron's probing modules have decided (without us)
        self._settling = False

    # ------------------------------------------------------------------ megatron decides first
    def settle(self, _module: types.ModuleType | None = None) -> None:
        """Import megatron-core's probing modules while declining (wrapt post-import hook of
        ``megatron.core``; also called directly). Idempotent."""
        with self._lock:
            if self._settled or self._settling or _finder is not self:
                return
            self._settling = True
            try:
                for name in probers.megatron_probers():
                    if name in sys.modules:
                        continue
                    try:
                        importlib.import_module(name)
                    except Exception as error:  # an optional dependency of megatron's is missing
                        logger.debug("te-client-module: %s did not import (%s); it decides when it does", name, error)
            finally:
                self._settling = False
            self._settled = True

    def _ready(self) -> bool:
        """Whether a request may be served now; makes megatron decide first where it can."""
        with self._lock:
            if self._settling:
                return False
            if self._settled:
                return True
            if "megatron.core" in sys.modules:
                return False  # megatron.core's own import is under way: megatron is asking
            if importlib.util.find_spec("megatron") is None or _core_spec() is None:
                self._settled = True  # no megatron-core here: nothing to protect
                return True
        importlib.import_module("megatron.core")  # its post-import hook settles
        self.settle()
        return self._settled

    # ------------------------------------------------------------------ MetaPathFinder / Loader
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MODULES or real_te_installed():
            return None
        if not self._ready():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in _PACKAGES)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        implementation = importlib.import_module(MODULES[module.__name__])
        for name in implementation.__all__:
            setattr(module, name, getattr(implementation, name))
        module.__doc__ = implementation.__doc__
        if hasattr(implementation, "__getattr__"):
            module.__getattr__ = implementation.__getattr__
        if module.__spec__.submodule_search_locations is not None:
            module.__path__ = []  # children come from this finder only
        for child in _CHILDREN_IMPORTED.get(module.__name__, ()):
            importlib.import_module(child)  # as TE's own packages import them


def _core_spec():
    try:
        return importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None


_finder: ClientModuleFinder | None = None
_hook_registered = False


def _on_megatron_core(module: types.ModuleType) -> None:
    if _finder is not None:
        _finder.settle(module)


def install() -> ClientModuleFinder | None:
    """Append the finder to ``sys.meta_path`` (once); None where a real TE is installed."""
    global _finder, _hook_registered
    if real_te_installed():
        return None
    if _finder is None or _finder not in sys.meta_path:
        _finder = ClientModuleFinder()
        sys.meta_path.append(_finder)
        logger.debug("te-client-module: finder appended to sys.meta_path")
    if not _hook_registered:
        _hook_registered = True
        wrapt.register_post_import_hook(_on_megatron_core, "megatron.core")  # at once if imported
    elif "megatron.core" in sys.modules:
        _finder.settle()
    return _finder


def uninstall() -> list[str]:
    """Remove the finder and the modules it served from ``sys.modules`` (a real TE's are never
    touched); the names removed."""
    global _finder
    if _finder is not None:
        while _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
    _finder = None
    removed = [name for name, module in list(sys.modules.items()) if name.split(".")[0] == ROOT and is_ours(module)]
    for name in removed:
        del sys.modules[name]
    return removed


def installed_finder() -> ClientModuleFinder | None:
    return _finder if _finder is not None and _finder in sys.meta_path else None
