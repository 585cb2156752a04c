"""No import cycle anywhere in mindspeed_like, counting imports inside functions and under
``if TYPE_CHECKING:``; the product never imports ``mindspeed_like.testing``.

Dependencies point one way (docs/architecture.md): a cycle, even through an import inside a
function, means a lower layer reaches back up (e.g. a feature reading the runtime's global
config per call). A type-only import never runs, but it is still a dependency: the module cannot
be read, type-checked or moved without the one it names, so it counts (config.py,
toolkit/declaration.py and toolkit/precision.py formed one cycle through two such imports).
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


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Every mindspeed_like module ``module`` imports, anywhere (functions, TYPE_CHECKING)."""
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
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


def test_the_checker_sees_a_cycle_through_a_function_level_or_type_checking_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse(
        "import typing\nif typing.TYPE_CHECKING:\n    import mindspeed_like.x\ndef f():\n    import mindspeed_like.y\n"
    )
    known = {"mindspeed_like.x", "mindspeed_like.y"}
    assert _imports(tree, "mindspeed_like.z", False, known) == {"mindspeed_like.x", "mindspeed_like.y"}


def test_no_import_cycle_in_mindspeed_like():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions and under TYPE_CHECKING count):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


TESTING = f"{PACKAGE}.testing"


def _testing_paths_named(tree: ast.AST) -> set[str]:
    """String constants that are a ``mindspeed_like.testing`` module path (``importlib.import_module``,
    ``python -m``, ``pytest -p``): an import the graph cannot see. Prose naming one (a docstring)
    is not a path."""
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value == TESTING or node.value.startswith(f"{TESTING}."))
        and " " not in node.value
    }


def _outside_testing(module: str) -> bool:
    return module != TESTING and not module.startswith(f"{TESTING}.")


def test_the_product_never_imports_testing():
    """``mindspeed_like.testing`` holds what only tests use (the npu emulator, parity helpers, the
    Megatron-LM unit-test plugin) and may import the product; what the product runs lives in the
    product (``workloads/``). Counted: imports at module level, in functions, under TYPE_CHECKING,
    and module paths given as strings."""
    graph, modules = import_graph(), _modules()
    offenders = {
        module: sorted(
            {target for target in graph[module] if not _outside_testing(target)}
            | _testing_paths_named(ast.parse(modules[module].read_text()))
        )
        for module in graph
        if _outside_testing(module)
    }
    offenders = {module: targets for module, targets in offenders.items() if targets}
    assert not offenders, f"the product imports test-only helpers: {offenders}"


def test_the_testing_rule_sees_every_kind_of_import():
    known = {PACKAGE, TESTING, f"{TESTING}.parity", f"{PACKAGE}.workloads"}
    for source in (
        "from mindspeed_like.testing import parity\n",
        "def f():\n    import mindspeed_like.testing.parity\n",
        "import typing\nif typing.TYPE_CHECKING:\n    from mindspeed_like.testing.parity import SEED\n",
    ):
        assert _imports(ast.parse(source), f"{PACKAGE}.demo", False, known) == {f"{TESTING}.parity"}, source
    tree = ast.parse(
        '"""Checked against the emulator (``mindspeed_like.testing.npu_emulator``)."""\n'
        'CMD = ["-m", "mindspeed_like.testing.isa_lane"]\n'
    )
    assert _testing_paths_named(tree) == {"mindspeed_like.testing.isa_lane"}


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
