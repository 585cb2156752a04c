"""Where megatron's source spells CUDA: the inventory the CPU adapters are checked against.

The host twins (``host_view``) rewrite four spellings inside the functions they adapt:
``torch.cuda.<fn>(...)``, the constant ``'cuda'``, the type strings ``'torch.cuda.*Tensor'`` and
the method call ``x.cuda(...)``. Every megatron function that holds one of them raises on a
CPU-only torch when it runs, unless something adapts it. This module finds them in the INSTALLED
source (parsed, never imported or executed), so the list follows each megatron release instead of
being kept by hand: a new call site upstream shows up here the day it is installed.

Not counted (a CPU-only torch answers them correctly): ``torch.cuda.is_available()`` (False:
the code takes its own host branch), ``torch.cuda.empty_cache()`` (nothing to free) and
annotations. A ``'cuda'`` that is the ``device=`` of a ``torch.<factory>(...)`` call is told apart
(``factory-device``): a module-wide host view of torch (``cpu_training.host_training``) places
those on the host, while it does nothing for the others.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

TENSOR_TYPE_STRINGS = frozenset({"torch.cuda.FloatTensor", "torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"})
HARMLESS_TORCH_CUDA = frozenset({"is_available", "empty_cache"})
FACTORIES = frozenset(
    {
        "tensor", "as_tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
        "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    }
)  # fmt: skip

# kinds of site
TORCH_CUDA = "torch.cuda"  # torch.cuda.<fn>(...) called
CUDA_METHOD = ".cuda()"  # x.cuda(...)
CUDA_CONSTANT = "'cuda'"  # the string 'cuda' anywhere but a factory's device=
FACTORY_DEVICE = "factory-device"  # torch.<factory>(..., device='cuda')
TYPE_STRING = "'torch.cuda.*Tensor'"
CUDA_INDEXED = "'cuda:N'"  # a 'cuda:...' string or f-string: no host twin rewrites it
CURRENT_DEVICE_FORMAT = "f'cuda:{current_device()}'"  # exactly f"cuda:{torch.cuda.current_device()}": twins read "cpu"


@dataclass(frozen=True)
class Site:
    kind: str
    detail: str  # torch.cuda's function, the constant, ...
    line: int

    def __str__(self) -> str:
        return f"{self.kind} {self.detail} (line {self.line})"


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_current_device_format(node: ast.JoinedStr) -> bool:
    """``f"cuda:{torch.cuda.current_device()}"`` and nothing else: a host twin reads it as "cpu"
    (its literal ``'cuda:'`` is dropped and the host view's current device formats as "cpu")."""
    if len(node.values) != 2:
        return False
    literal, value = node.values
    return (
        isinstance(literal, ast.Constant)
        and literal.value == "cuda:"
        and isinstance(value, ast.FormattedValue)
        and value.conversion == -1
        and value.format_spec is None
        and isinstance(value.value, ast.Call)
        and _dotted(value.value.func) == "torch.cuda.current_device"
        and not value.value.args
    )


class _Finder(ast.NodeVisitor):
    """Collects sites per owner: the outermost function (``Class.method``, ``function``); nested
    functions belong to their enclosing one (a twin of it covers them); module level is
    ``<module>`` and class bodies ``Class``."""

    def __init__(self) -> None:
        self.sites: dict[str, list[Site]] = {}
        self._scope: list[str] = []
        self._owner: str | None = None
        self._factory_devices: set[int] = set()

    def _add(self, kind: str, detail: str, node: ast.AST) -> None:
        owner = self._owner or (".".join(self._scope) if self._scope else "<module>")
        self.sites.setdefault(owner, []).append(Site(kind, detail, node.lineno))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        self._scope.append(node.name)
        for statement in node.body:
            self.visit(statement)
        self._scope.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        for default in [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]:
            self.visit(default)
        outer = self._owner
        if outer is None:
            self._owner = ".".join([*self._scope, node.name])
        self._scope.append(node.name)
        for statement in node.body:
            self.visit(statement)
        self._scope.pop()
        self._owner = outer

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:  # the annotation is not executed code
        if node.value is not None:
            self.visit(node.value)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        if name and name.startswith("torch.cuda."):
            fn = name[len("torch.cuda.") :]
            if fn not in HARMLESS_TORCH_CUDA:
                self._add(TORCH_CUDA, fn, node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
            self._add(CUDA_METHOD, f"{_dotted(node.func.value) or '...'}.cuda()", node)
        if name and name.startswith("torch.") and name[len("torch.") :] in FACTORIES:
            for keyword in node.keywords:
                if (
                    keyword.arg == "device"
                    and isinstance(keyword.value, ast.Constant)
                    and keyword.value.value == "cuda"
                ):
                    self._factory_devices.add(id(keyword.value))
                    self._add(FACTORY_DEVICE, f"{name}(device='cuda')", node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if not isinstance(value, str) or id(node) in self._factory_devices:
            return
        if value == "cuda":
            self._add(CUDA_CONSTANT, "'cuda'", node)
        elif value in TENSOR_TYPE_STRINGS:
            self._add(TYPE_STRING, repr(value), node)
        elif value.startswith("cuda:"):
            self._add(CUDA_INDEXED, repr(value), node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        first = node.values[0] if node.values else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("cuda:"):
            if _is_current_device_format(node):
                self._add(CURRENT_DEVICE_FORMAT, "f'cuda:{torch.cuda.current_device()}'", node)
            else:
                self._add(CUDA_INDEXED, "f'cuda:{...}'", node)
            return
        self.generic_visit(node)


def sites_in_source(source: str, filename: str = "<source>") -> dict[str, tuple[Site, ...]]:
    """Each function of ``source`` that spells CUDA, with its sites (owner -> sites, by line)."""
    finder = _Finder()
    tree = ast.parse(source, filename)
    # annotations of arguments and returns are not executed code either: drop them first
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for arg in [
                *node.args.args,
                *node.args.posonlyargs,
                *node.args.kwonlyargs,
                node.args.vararg,
                node.args.kwarg,
            ]:
                if arg is not None:
                    arg.annotation = None
    finder.visit(tree)
    return {owner: tuple(sorted(found, key=lambda s: s.line)) for owner, found in finder.sites.items()}


def package_modules(package: str, roots: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """(module name, file) of every module under ``package``, found without importing it (only
    its parents are imported by ``find_spec``; megatron is a namespace package). ``roots``: the
    package's folders, where it is not importable here (Megatron-LM's ``megatron/training`` in a
    checkout that is not on sys.path)."""
    if roots is None:
        spec = importlib.util.find_spec(package)
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            relative = os.path.relpath(folder, root)
            prefix = package if relative == "." else f"{package}.{relative.replace(os.sep, '.')}"
            for file in sorted(files):
                if file.endswith(".py"):
                    stem = file[:-3]
                    yield (prefix if stem == "__init__" else f"{prefix}.{stem}"), os.path.join(folder, file)


def cuda_sites(package: str, roots: list[str] | None = None) -> dict[str, tuple[Site, ...]]:
    """Every function under ``package`` that spells CUDA: ``"module:Owner.qualname"`` -> sites."""
    found = {}
    for module, path in package_modules(package, roots):
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        try:
            per_owner = sites_in_source(source, path)
        except SyntaxError:  # a file for a newer Python than this one: it cannot run here either
            continue
        for owner, sites in per_owner.items():
            found[f"{module}:{owner}"] = sites
    return found
