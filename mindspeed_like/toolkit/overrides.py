"""Running megatron code with one config field (or module global) seen differently, for one call only.

Several features reach megatron's own code path by changing one field megatron reads (the
fused branch of MLP.forward behind ``bias_activation_fusion``, GroupedMLP's bf16-only assertion,
the SP assertion of the torch norm). The change must be invisible outside the call and must not
re-run ``TransformerConfig.__post_init__`` (which would re-derive and re-validate everything):
a shallow copy with the fields set is handed in, and the original object is put back.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any


def with_fields(config: Any, **fields: Any) -> Any:
    """A shallow copy of ``config`` with ``fields`` set (not re-validated)."""
    view = copy.copy(config)
    for name, value in fields.items():
        if not hasattr(config, name):
            raise AttributeError(f"{type(config).__name__} has no field {name!r}")
        object.__setattr__(view, name, value)
    return view


@contextlib.contextmanager
def config_fields(owner: Any, **fields: Any) -> Iterator[Any]:
    """``owner.config`` is a view with ``fields`` set for the block, the original afterwards."""
    original = owner.config
    owner.config = with_fields(original, **fields)
    try:
        yield owner.config
    finally:
        owner.config = original


_UNBOUND = object()


@contextlib.contextmanager
def attributes_set(namespace: Any, **values: Any) -> Iterator[None]:
    """``namespace``'s attributes (a module's globals, a class's) set to ``values`` for the block;
    afterwards each is what it was, or unbound again where it was unbound."""
    saved = {name: vars(namespace).get(name, _UNBOUND) for name in values}
    try:
        for name, value in values.items():
            setattr(namespace, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is _UNBOUND:
                delattr(namespace, name)
            else:
                setattr(namespace, name, value)
