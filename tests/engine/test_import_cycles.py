"""No import cycle anywhere in mindspeed_like, counting imports inside functions.

Dependencies point one way (docs/architecture.md): a cycle, even through an import inside a
function, means a lower layer reaches back up (e.g. a feature reading the runtime's global
config per call). Imports under ``if TYPE_CHECKING:`` do not count (they never run).
"""

from __future__ import annotations

import ast
import pathlib

import mindspeed_like

ROOT = pathlib.Path(mindspeed_like.__file__).parent
PACKAGE = "mindspeed_like"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Every mindspeed_like module ``module`` imports, anywhere but under TYPE_CHECKING."""
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    found.add(resolve(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.split(".")[0] == PACKAGE:
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    found.add(submodule if submodule in known else resolve(source))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(None)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_checker_sees_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse(
        "import typing\nif typing.TYPE_CHECKING:\n    import mindspeed_like.x\ndef f():\n    import mindspeed_like.y\n"
    )
    assert _imports(tree, "mindspeed_like.z", False, {"mindspeed_like.x", "mindspeed_like.y"}) == {"mindspeed_like.y"}


def test_no_import_cycle_in_mindspeed_like():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_lower_layers_never_import_the_runtime():
    """features/, adapters/, fixes/, integrations/, toolkit/, engine/ and kernels/ are handed
    their configuration; none of them imports the runtime, the registry or the package root."""
    graph = import_graph()
    upper = {f"{PACKAGE}.runtime", f"{PACKAGE}.registry", PACKAGE, f"{PACKAGE}.megatron_adaptor", f"{PACKAGE}.cli"}
    lower = ("features", "adapters", "fixes", "integrations", "toolkit", "engine", "kernels")
    offenders = {
        module: sorted(graph[module] & upper)
        for module in graph
        if module.split(".")[1:2] and module.split(".")[1] in lower and graph[module] & upper
    }
    assert not offenders, offenders


def test_kernels_never_import_megatron_or_features():
    graph, modules = import_graph(), _modules()
    kernels = {m for m in modules if m.startswith(f"{PACKAGE}.kernels")}
    for name in kernels:
        text = modules[name].read_text()
        assert "import megatron" not in text and "from megatron" not in text, name
        assert not graph[name] - kernels, (name, graph[name] - kernels)
