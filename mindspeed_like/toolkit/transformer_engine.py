"""Is TransformerEngine here, and can megatron build its TE layers? Asked without being fooled
by our own TE-compatible backend.

``installed()`` looks for a real ``transformer_engine`` package on ``sys.path`` (the path finder
only: a ``transformer_engine`` module our backend serves to clients through ``sys.meta_path`` is
not TE). ``megatron_te_layers_available()`` asks megatron itself whether its TE wrapper classes
are real classes (a real TE, or the te-backend's), rather than ``MagicMock`` stand-ins.
"""

from __future__ import annotations

import importlib.machinery
import sys


def installed() -> bool:
    """Whether a real TransformerEngine is importable (never our backend's client module)."""
    try:
        return importlib.machinery.PathFinder.find_spec("transformer_engine", sys.path) is not None
    except (ImportError, ValueError):
        return False


def megatron_te_layers_available() -> bool:
    """Whether ``megatron.core.extensions.transformer_engine.TELinear`` is a class (importing it)."""
    try:
        import megatron.core.extensions.transformer_engine as extension
    except ImportError:
        return False
    return isinstance(getattr(extension, "TELinear", None), type)
