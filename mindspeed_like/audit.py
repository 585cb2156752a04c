"""Audit a megatron-core release we have not run: every declared patch target, read statically.

``mindspeed-like audit --megatron-source DIR_OR_WHEEL`` reads each feature's patch table (the
same declarations the runtime applies, built with the audited release's version so ``versions=``
picks that release's targets) and looks every megatron target up in the release's source by
parsing it with :mod:`ast`: nothing of it is imported (a wheel for another Python, or one whose
imports need CUDA packages, audits the same). For each target it reports

* present / MISSING / module removed (the module file is gone) / absent-optional / n/a (the
  patch's ``versions`` exclude the release: the feature declares another target there, or
  nothing is needed);
* the signature against a baseline release (``--against``; default: the installed
  megatron-core's source, also read without importing it): parameters added, removed, renamed
  or with new defaults. Our wrappers read arguments by name through ``toolkit.binding.Call``, so
  a changed signature is a thing to look at, not by itself a failure.

The exit status is non-zero when a non-optional target that applies to the release is missing.
A source is a directory holding ``megatron/`` (site-packages, a Megatron-LM checkout), the
``megatron`` or ``megatron/core`` directory itself, or a ``megatron_core-*.whl``.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import zipfile
from collections.abc import Iterable, Sequence
from functools import cached_property

from packaging.version import Version

PRESENT, MISSING, MODULE_REMOVED, ABSENT_OPTIONAL, NOT_APPLICABLE = (
    "present",
    "MISSING",
    "module removed",
    "absent (optional)",
    "n/a",
)
_DUNDERS_OF_OBJECT = {"__init__", "__new__", "__call__", "__repr__", "__getattr__", "__setattr__"}


class SourceError(ValueError):
    """The path is not a megatron-core source tree or wheel."""


class Source:
    """A megatron-core release's files, from a directory or a wheel, read as text."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.isfile(path) and zipfile.is_zipfile(path):
            self._zip: zipfile.ZipFile | None = zipfile.ZipFile(path)
            self._names = set(self._zip.namelist())
            self._root = ""
        elif os.path.isdir(path):
            self._zip = None
            self._names = set()
            self._root = self._find_root(path)
        else:
            raise SourceError(f"{path}: not a directory or a wheel")
        if self.read("megatron/core/package_info.py") is None:
            raise SourceError(f"{path}: no megatron/core/package_info.py in it (not a megatron-core source)")

    @staticmethod
    def _find_root(path: str) -> str:
        path = os.path.abspath(path)
        for candidate in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
            if os.path.exists(os.path.join(candidate, "megatron", "core", "package_info.py")):
                return candidate
        raise SourceError(f"{path}: no megatron/core/package_info.py in or above it (not a megatron-core source)")

    def read(self, relpath: str) -> str | None:
        if self._zip is not None:
            if relpath not in self._names:
                return None
            return self._zip.read(relpath).decode("utf-8")
        full = os.path.join(self._root, relpath)
        if not os.path.isfile(full):
            return None
        with open(full, encoding="utf-8") as handle:
            return handle.read()

    def is_package(self, module: str) -> bool:
        return self.read(module.replace(".", "/") + "/__init__.py") is not None

    def is_namespace_package(self, module: str) -> bool:
        """A folder of modules without ``__init__.py`` (megatron's ``models/gpt/heterogeneous``)."""
        base = module.replace(".", "/") + "/"
        if self._zip is not None:
            return any(name.startswith(base) for name in self._names)
        return os.path.isdir(os.path.join(self._root, base))

    def module_text(self, module: str) -> str | None:
        base = module.replace(".", "/")
        text = self.read(base + ".py")
        return text if text is not None else self.read(base + "/__init__.py")

    @cached_property
    def version(self) -> Version:
        text = self.read("megatron/core/package_info.py") or ""
        parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\n]*)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
        if not all(parts.values()):
            raise SourceError(f"{self.path}: package_info.py has no MAJOR/MINOR/PATCH")
        return Version(".".join(parts[k].group(1).strip() for k in ("MAJOR", "MINOR", "PATCH")))

    def has_training(self) -> bool:
        return self.read("megatron/training/__init__.py") is not None

    @cached_property
    def _trees(self) -> dict[str, ast.Module | None]:
        return {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.module_text(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]


@dataclasses.dataclass(frozen=True)
class Found:
    """Where a target's attribute path ends: the defining node and the module holding it."""

    module: str
    node: ast.AST | None  # FunctionDef / ClassDef / Assign / Import...; None: inherited from outside
    note: str = ""


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, looking inside if/try blocks (optional imports)."""
    for statement in body:
        if isinstance(statement, ast.If):
            yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _top_level(statement.body)
            for handler in statement.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(statement.orelse)
            yield from _top_level(statement.finalbody)
        else:
            yield statement


def _assigned_names(statement: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    names = []
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.append(node.id)
    return names


def _definitions(body: Iterable[ast.stmt], name: str) -> list[ast.stmt]:
    """Every statement binding ``name`` in a body (the last one wins at run time)."""
    found = []
    for statement in _top_level(body):
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and statement.name == name:
            found.append(statement)
        elif name in _assigned_names(statement):
            found.append(statement)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound == name:
                    found.append(statement)
    return found


def _preferred(definitions: list[ast.stmt]) -> ast.stmt:
    """A real definition beats a fallback assignment (``try: import x except: x = None``)."""
    for kinds in ((ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef), (ast.ImportFrom, ast.Import)):
        for statement in reversed(definitions):
            if isinstance(statement, kinds):
                return statement
    return definitions[-1]


class Resolver:
    """Static attribute lookup in one release's source."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def split(self, target: str) -> tuple[str | None, list[str]]:
        """The longest module prefix present in the source, and the attributes after it."""
        parts = target.split(".")
        module = None
        for index in range(1, len(parts)):
            candidate = ".".join(parts[:index])
            if self.source.module_text(candidate) is not None:
                module = candidate
                if not self.source.is_package(candidate):
                    break
            elif module is not None and not self.source.is_namespace_package(candidate):
                break
        if module is None:
            return None, parts
        return module, parts[len(module.split(".")) :]

    def _absolute(self, module: str, statement: ast.ImportFrom) -> str:
        if not statement.level:
            return statement.module or ""
        package = module if self.source.is_package(module) else module.rsplit(".", 1)[0]
        for _ in range(statement.level - 1):
            package = package.rsplit(".", 1)[0]
        return f"{package}.{statement.module}" if statement.module else package

    def lookup(self, module: str, name: str, depth: int = 0) -> Found | None:
        """``name`` in ``module``'s namespace, following ``from x import name`` within megatron."""
        tree = self.source.tree(module)
        if tree is None or depth > 8:
            return None
        definitions = _definitions(tree.body, name)
        if not definitions:
            if self.source.module_text(f"{module}.{name}") is not None and self.source.is_package(module):
                return Found(f"{module}.{name}", None, "submodule")
            return None
        statement = _preferred(definitions)
        if isinstance(statement, ast.ImportFrom):
            origin = self._absolute(module, statement)
            alias = next(a for a in statement.names if (a.asname or a.name) == name)
            if origin.startswith("megatron"):
                followed = self.lookup(origin, alias.name, depth + 1)
                if followed is not None:
                    return followed
                if self.source.module_text(f"{origin}.{alias.name}") is not None:
                    return Found(f"{origin}.{alias.name}", None, "submodule")
                return None  # imported from a megatron module that no longer has it
            return Found(module, statement, f"imported from {origin}")
        return Found(module, statement)

    def _base_class(self, module: str, base: ast.expr) -> tuple[str, ast.ClassDef] | str:
        """A base class expression -> (module, ClassDef) inside megatron, or its dotted name."""
        dotted = ast.unparse(base)
        head, _, rest = dotted.partition(".")
        found = self.lookup(module, head)
        if found is not None and isinstance(found.node, ast.ClassDef) and not rest:
            return found.module, found.node
        if found is not None and found.node is None and found.note == "submodule" and rest:
            inner = self.lookup(found.module, rest)
            if inner is not None and isinstance(inner.node, ast.ClassDef):
                return inner.module, inner.node
        return dotted

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> Found | None:
        """``name`` on a class: its own body, else its bases (megatron's followed, others noted)."""
        definitions = _definitions(cls.body, name)
        if definitions:
            return Found(module, _preferred(definitions))
        if depth > 8:
            return None
        external = []
        for base in cls.bases:
            resolved = self._base_class(module, base)
            if isinstance(resolved, str):
                external.append(resolved)
                continue
            inherited = self.member(*resolved, name, depth + 1)
            if inherited is not None:
                return inherited
        if name in _DUNDERS_OF_OBJECT or (external and name.startswith("__")):
            return Found(module, None, "inherited from object")
        if external:
            return Found(module, None, f"inherited from {', '.join(external)} (outside megatron: not checked)")
        return None

    def resolve(self, target: str, module_hint: str | None = None) -> tuple[str, Found | None]:
        """(status, where) for a dotted target. ``module_hint``: the module the target is known to
        live in (declared on the patch, or found in the baseline release): its absence here is
        "module removed", not a missing attribute of a parent package."""
        if module_hint is not None and self.source.module_text(module_hint) is None:
            return MODULE_REMOVED, None
        module, attrs = self.split(target)
        if module is None or not attrs:
            return MODULE_REMOVED, None
        found = self.lookup(module, attrs[0])
        for name in attrs[1:]:
            if found is None:
                break
            node = found.node
            if isinstance(node, ast.ClassDef):
                found = self.member(found.module, node, name)
            elif node is None and found.note == "submodule":
                found = self.lookup(found.module, name)
            else:
                return PRESENT, Found(found.module, None, f"attribute of a {type(node).__name__} (not checked)")
        return (PRESENT, found) if found is not None else (MISSING, None)


def signature(node: ast.AST | None) -> str | None:
    """``(a, b=1, *, c)`` for a function definition (annotations dropped); None otherwise."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = node.args
    parts: list[str] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        parts.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
        if args.posonlyargs and index == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        parts.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    return "(" + ", ".join(parts) + ")"


def _param_names(sig: str) -> list[str]:
    return [p.split("=")[0].strip() for p in sig.strip("()").split(",") if p.strip() and p.strip() not in ("*", "/")]


def compare_signatures(new: str | None, old: str | None) -> str:
    if new is None or old is None:
        return "-" if new is None and old is None else ("new target" if old is None else "-")
    if new == old:
        return "same"
    before, after = _param_names(old), _param_names(new)
    added = [p for p in after if p not in before]
    removed = [p for p in before if p not in after]
    bits = [f"+{p}" for p in added] + [f"-{p}" for p in removed]
    if not bits:
        bits = ["defaults/order"]
    return "changed: " + " ".join(bits)


@dataclasses.dataclass(frozen=True)
class Row:
    feature: str
    target: str
    kind: str
    optional: bool
    versions: str | None
    status: str
    signature: str
    note: str = ""


def declared_patches(version: Version) -> list[tuple[str, object]]:
    """(feature name, Patch) for every registered feature, built as the runtime would build them
    for megatron-core ``version`` with every feature switched on (its ``switch_on`` flags)."""
    from mindspeed_like import registry, runtime
    from mindspeed_like.toolkit.declaration import Context

    features = registry.all_features()
    flags: dict[str, object] = {"device": "cpu"}
    for feature in features:
        flags.update(feature.switch_on)
    config = runtime.resolve_config(code=flags, argv=[])
    ctx = Context(
        config=config,
        device="cpu",
        megatron_version=version,
        features=tuple(features),
        flags=tuple(runtime.flags()),
    )
    return [(feature.name, patch) for feature in features for patch in feature.patches_for(ctx)]


def audit(source: Source, baseline: Source | None = None) -> list[Row]:
    """One row per declared megatron patch target of every feature (see the module doc)."""
    version = source.version
    resolver = Resolver(source)
    base_resolver = Resolver(baseline) if baseline is not None else None
    rows = []
    seen = set()
    for feature, patch in declared_patches(version):
        if not patch.target.startswith("megatron."):
            continue
        key = (feature, patch.target, patch.versions)
        if key in seen:
            continue
        seen.add(key)
        specifier = patch.specifier()
        common = dict(feature=feature, target=patch.target, kind=patch.kind.value, optional=patch.optional)
        if specifier is not None and version not in specifier:
            rows.append(Row(**common, versions=patch.versions, status=NOT_APPLICABLE, signature="-"))
            continue
        hint = patch.module
        if hint is None and base_resolver is not None:
            base_module, _ = base_resolver.split(patch.target)
            hint = base_module if base_module and base_module.count(".") > 2 else None
        status, found = resolver.resolve(patch.target, hint)
        note = found.note if found is not None else ""
        if status != PRESENT and patch.optional:
            status = ABSENT_OPTIONAL
        sig = "-"
        if status == PRESENT and base_resolver is not None:
            base_status, base_found = base_resolver.resolve(patch.target)
            old = signature(base_found.node) if base_status == PRESENT and base_found else None
            new = signature(found.node if found else None)
            sig = "new target" if base_status != PRESENT else compare_signatures(new, old)
        rows.append(Row(**common, versions=patch.versions, status=status, signature=sig, note=note))
    return rows


def failures(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.status in (MISSING, MODULE_REMOVED) and not r.optional]


def feature_summary(rows: Sequence[Row]) -> dict[str, str]:
    """One verdict per feature for a release."""
    verdicts: dict[str, str] = {}
    for feature in dict.fromkeys(r.feature for r in rows):
        mine = [r for r in rows if r.feature == feature]
        missing = [r for r in mine if r.status in (MISSING, MODULE_REMOVED) and not r.optional]
        absent = [r for r in mine if r.status == ABSENT_OPTIONAL]
        changed = [r for r in mine if r.signature.startswith("changed")]
        applied = [r for r in mine if r.status == PRESENT]
        if missing:
            verdict = f"BROKEN: {len(missing)} target(s) missing"
        elif not applied:
            verdict = "nothing to patch"
        else:
            verdict = f"{len(applied)} target(s) present"
        if absent:
            verdict += f", {len(absent)} optional absent"
        if changed:
            verdict += f", {len(changed)} signature change(s)"
        verdicts[feature] = verdict
    return verdicts


def installed_source() -> Source | None:
    """The installed megatron-core's source (located without importing it), if any."""
    from mindspeed_like.megatron_version import _package_info_path

    path = _package_info_path()
    if path is None:
        return None
    try:
        return Source(os.path.dirname(path))
    except SourceError:
        return None


def _cell(row: Row | None) -> str:
    if row is None:
        return ""
    if row.status == PRESENT:
        return "ok" if row.signature in ("same", "-", "new target") else f"ok ({row.signature})"
    return row.status


def markdown(results: Sequence[tuple[Source, Sequence[Row]]], baseline: Source | None) -> str:
    """Two markdown tables over several releases: each target's status, each feature's verdict."""
    versions = [str(source.version) for source, _ in results]
    keys: dict[tuple[str, str], None] = {}
    by_version: list[dict[tuple[str, str], Row]] = []
    for _, rows in results:
        table: dict[tuple[str, str], Row] = {}
        for row in rows:
            key = (row.feature, row.target)
            keys.setdefault(key)
            if key not in table or table[key].status == NOT_APPLICABLE:  # the applicable layout wins
                table[key] = row
        by_version.append(table)
    against = f"megatron-core {baseline.version}" if baseline is not None else "no baseline"
    lines = [
        f"Signatures compared with {against}; `ok` = present with the same signature.",
        "",
        "| feature | target | " + " | ".join(versions) + " |",
        "|---|---|" + "---|" * len(versions),
    ]
    for feature, target in keys:
        cells = [_cell(table.get((feature, target))) for table in by_version]
        if all(c == "ok" for c in cells):
            continue
        lines.append(f"| {feature} | `{target.removeprefix('megatron.')}` | " + " | ".join(cells) + " |")
    hidden = sum(1 for key in keys if all(_cell(t.get(key)) == "ok" for t in by_version))
    lines += ["", f"{hidden} further targets are `ok` in every release above.", ""]
    lines += ["| feature | " + " | ".join(versions) + " |", "|---|" + "---|" * len(versions)]
    summaries = [feature_summary(rows) for _, rows in results]
    for feature in dict.fromkeys(f for f, _ in keys):
        lines.append(f"| {feature} | " + " | ".join(s.get(feature, "") for s in summaries) + " |")
    return "\n".join(lines)
