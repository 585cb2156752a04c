"""Which of megatron-core's modules ask ``import transformer_engine`` when they are imported, read
from the installed source (never a hand-kept list: the set changes with every release).

A module "probes" when a statement at its top level (inside ``try``/``if`` blocks too, not inside
functions) imports ``transformer_engine`` or one of its submodules: those bind ``HAVE_TE`` (and
friends) once, at import. Nothing is imported here; the AST of the files that mention the name is
read once per process.
"""

from __future__ import annotations

import ast
import functools

from mindspeed_like.te_backend.megatron_names import _megatron_core_dir, _top_level, modules_mentioning

TE = "transformer_engine"


def _imports_te(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == TE for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == TE
    return False


@functools.cache
def _probers(root: str) -> tuple[str, ...]:
    found = []
    for module, text in modules_mentioning(root, TE):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        if any(_imports_te(node) for node in _top_level(tree.body)):
            found.append(module)
    return tuple(sorted(found))


def megatron_probers() -> tuple[str, ...]:
    """megatron-core modules that import ``transformer_engine`` at their top level (empty without
    megatron-core)."""
    root = _megatron_core_dir()
    return _probers(root) if root is not None else ()
