"""Which of megatron's module names the backend binds, read from the installed megatron-core.

megatron reaches TransformerEngine through one module, ``megatron.core.extensions.transformer_engine``
(its TE wrapper classes; without TE they are ``MagicMock`` stand-ins or None), and one spec
provider, ``...transformer_engine_spec_provider.TESpecProvider``. Other modules take those names by
``from ... import`` at their top level, often inside ``try: import transformer_engine`` (unbound
without TE) or ``if HAVE_TE:`` (None without TE): the spec modules (``gpt_layer_specs``, MTP,
HybridModel's, ...), attention, MLA, MoE. Which modules and which names differs per release, so
it is read from the installed source (the text first, the AST of the few files that mention the
extension modules), never from a hand-kept table. Nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import os
import sys
from collections.abc import Iterator

EXTENSION = "megatron.core.extensions.transformer_engine"
SPEC_PROVIDER = "megatron.core.extensions.transformer_engine_spec_provider"
SOURCES = (EXTENSION, SPEC_PROVIDER)


def _top_level(nodes: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those inside top-level if/try blocks (not functions)."""
    for node in nodes:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(block)


def _megatron_core_dir() -> str | None:
    """megatron-core's directory, found without importing anything: ``importlib.util.find_spec
    ("megatron.core")`` would import the ``megatron`` package, and the adaptor must import nothing
    of megatron (mindspeed_like_autoload applies it inside the import system's look-up of megatron)."""
    parent = sys.modules.get("megatron")
    locations = getattr(parent, "__path__", None)
    if locations is None:
        spec = _find_spec("megatron", None)
        locations = None if spec is None else spec.submodule_search_locations
    spec = _find_spec("megatron.core", list(locations)) if locations else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _find_spec(name: str, path: list[str] | None) -> importlib.machinery.ModuleSpec | None:
    """The spec the finders on ``sys.meta_path`` give for ``name`` (the parent's ``path`` for a
    submodule), as the import system would find it, without loading it. wrapt's post-import-hook
    finder is skipped: for a hooked name it answers by ``importlib.util.find_spec``, which imports
    the parent (and the engine hooks megatron's modules), and it only wraps the loader others find."""
    for finder in list(sys.meta_path):
        if type(finder).__module__.startswith("wrapt."):
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(name, path) if find is not None else None
        if spec is not None:
            return spec
    return None


def _module_name(root: str, path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(os.path.dirname(root)))
    name = relative[: -len(".py")].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


@functools.cache
def bound_in(module_path: str) -> frozenset[str]:
    """Names a module binds at its top level in any branch (classes, functions, imports, assignments)."""
    with open(module_path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    names: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
    return frozenset(names)


def names_of(module: str) -> frozenset[str]:
    """What the installed megatron module ``module`` (one of :data:`SOURCES`) binds in some branch."""
    root = _megatron_core_dir()
    if root is None:
        return frozenset()
    return bound_in(os.path.join(root, *module.split(".")[2:]) + ".py")


def modules_mentioning(root: str, needle: str) -> Iterator[tuple[str, str]]:
    """(module name, source text) of every megatron-core file below ``root`` whose text contains
    ``needle`` (a cheap text filter before any AST is parsed)."""
    for directory, _, files in os.walk(root):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(directory, file)
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
            if needle in text:
                yield _module_name(root, path), text


@functools.cache
def _scan(root: str) -> tuple[tuple[str, tuple[str, ...], tuple[ast.ClassDef, ...]], ...]:
    """One parse of every module that mentions the extension module: (module, the names it takes from
    the two extension modules at its top level, the classes it defines under ``if HAVE_TE:``)."""
    found = []
    for module, text in modules_mentioning(root, EXTENSION):
        if module == EXTENSION:
            continue  # the spec provider is an importer too: imported before the import line, its names are None
        tree = ast.parse(text)
        names = sorted(
            {
                alias.name
                for node in _top_level(tree.body)
                if isinstance(node, ast.ImportFrom)
                and node.module in SOURCES
                and node.module != module
                and node.level == 0
                for alias in node.names
                if alias.asname is None
            }
        )
        if names:
            found.append((module, tuple(names), tuple(_te_guarded_classes_in(tree))))
    return tuple(sorted(found, key=lambda entry: entry[0]))


@functools.cache
def _importers(root: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((module, names) for module, names, _ in _scan(root))


def importers() -> dict[str, tuple[str, ...]]:
    """megatron module -> the names it takes at its top level from the two extension modules."""
    root = _megatron_core_dir()
    return dict(_importers(root)) if root is not None else {}


def _te_guarded_classes_in(tree: ast.Module) -> list[ast.ClassDef]:
    """Classes a module defines only under a top-level ``if HAVE_TE:`` (subclasses of TE's wrapper
    classes, e.g. linear_replacements' ``TELayerNormColumnParallelLinearGathered``): without TE they
    do not exist, and whoever imports them gets None."""
    return [
        node
        for guard in tree.body
        if isinstance(guard, ast.If) and isinstance(guard.test, ast.Name) and guard.test.id == "HAVE_TE"
        for node in guard.body
        if isinstance(node, ast.ClassDef)
    ]


def te_guarded_classes() -> dict[str, tuple[str, ...]]:
    """megatron module -> the classes it defines under ``if HAVE_TE:`` (among the modules that take
    names from the extension module)."""
    root = _megatron_core_dir()
    scanned = _scan(root) if root is not None else ()
    return {module: tuple(sorted(c.name for c in classes)) for module, _, classes in scanned if classes}


def te_guarded_class_node(module: str, name: str) -> ast.ClassDef:
    """The source of ``module.name``, one of :func:`te_guarded_classes`, as megatron's file has it."""
    root = _megatron_core_dir()
    for scanned, _, classes in _scan(root) if root is not None else ():
        if scanned == module:
            for node in classes:
                if node.name == name:
                    return node
    raise LookupError(f"{module} defines no class {name} under `if HAVE_TE:`")


@functools.cache
def _importers_of(root: str, module: str, name: str) -> tuple[str, ...]:
    found = []
    for importer, text in modules_mentioning(root, name):
        if importer == module or module not in text:
            continue
        tree = ast.parse(text)
        if any(
            isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0
            and any(alias.name == name and alias.asname is None for alias in node.names)
            for node in _top_level(tree.body)
        ):  # fmt: skip
            found.append(importer)
    return tuple(sorted(found))


def importers_of(module: str, name: str) -> tuple[str, ...]:
    """megatron modules that take ``name`` from ``module`` by ``from module import name`` at their top level."""
    root = _megatron_core_dir()
    return _importers_of(root, module, name) if root is not None else ()
