"""The package layout: app's subpackages (launch, training, checkpoint, modes, reporting,
callbacks) and top-level modules depend on each other without a circle.

No import cycle between modules is not enough: `training -> launch -> training` through
different modules still ties two concerns together so that neither can be read, tested or
moved alone. Every import counts, those inside functions included (a lazy import is still a
dependency); a top-level module (`app.dist`, `app.config`, ...) is a node of its own.
"""

from __future__ import annotations

import ast

from conftest import REPO

APP = REPO / "src" / "app"


def _node(module: str) -> str | None:
    """The node of a module `app.X[.Y...]`: its subpackage, or the top-level module itself;
    None for a module outside app (and for the package `app` itself)."""
    parts = module.split(".")
    if parts[0] != "app" or len(parts) < 2:
        return None
    return parts[1]


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The statements under `if TYPE_CHECKING:`: they name types for annotations, which are
    never evaluated (`from __future__ import annotations`), and import nothing at run time."""
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                skipped |= set(ast.walk(statement))
    return skipped


def _imported(tree: ast.AST) -> set[str]:
    """The app modules (or subpackages) a module imports, anywhere in it (a function's own
    imports included) but for those only type checkers read."""
    names = set()
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "app":  # `from app import dist`: the module named
                names |= {f"app.{alias.name}" for alias in node.names}
            else:
                names.add(node.module)
    return names


def package_graph() -> dict[str, set[str]]:
    """Each node of app and the nodes it imports (itself left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(APP.rglob("*.py")):
        parts = path.relative_to(APP.parent).with_suffix("").parts
        source = _node(".".join(parts))
        if source is None or source == "__init__":
            continue
        targets = {_node(name) for name in _imported(ast.parse(path.read_text(), str(path)))}
        graph.setdefault(source, set()).update(t for t in targets if t and t != source)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: its strongly connected components of more than one node
    (Tarjan's algorithm), each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
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
            visit(node)
    return sorted(found)


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """The edges inside a circle, with the modules that make each one."""
    edges = []
    for path in sorted(APP.rglob("*.py")):
        parts = path.relative_to(APP.parent).with_suffix("").parts
        source = _node(".".join(parts))
        if source not in component:
            continue
        for name in sorted(_imported(ast.parse(path.read_text(), str(path)))):
            target = _node(name)
            if target in component and target != source:
                edges.append(f"{'.'.join(parts)} -> {name}")
    return f"{' <-> '.join(component)}: " + "; ".join(edges)


def test_the_graph_sees_the_subpackages() -> None:
    graph = package_graph()
    for package in ("launch", "training", "checkpoint", "modes", "reporting", "sweeps",
                    "callbacks"):
        assert package in graph
    assert "training" in graph["launch"]  # the launcher runs training: an edge it must see


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_level_cycle() -> None:
    graph = package_graph()
    found = cycles(graph)
    assert not found, "package-level import cycles in app:\n" + "\n".join(
        _describe(graph, component) for component in found)


def module_graph() -> dict[str, set[str]]:
    """Each module of app and the app modules it imports, those only type checkers read
    included (they tie two modules together for a reader too); a package's `__init__`
    re-exporting its own modules is left out (that is what it is for)."""
    files = {".".join(p.relative_to(APP.parent).with_suffix("").parts).removesuffix(
        ".__init__"): p for p in sorted(APP.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files
                         else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            targets |= {name for name in names if name in files}
        package = path.name == "__init__.py"
        graph[module] = {t for t in targets if t != module
                         and not (package and t.startswith(module + "."))}
    return graph


def test_no_module_level_cycle() -> None:
    graph = module_graph()
    assert "app.launch.spawn" in graph["app.launch.run"]  # (an edge it must see)
    assert cycles(graph) == []


# The layers, top to bottom: a node imports only from layers below its own (the shared
# top-level modules, the last layer, import among themselves without a circle:
# test_no_module_level_cycle). Annotations only type checkers read are left out (they import
# nothing at run time).
LAYERS = [
    {"__main__", "status", "runs", "report", "ckpt", "replay"},  # entry points
    {"sweeps"},  # what a sweep leaves, its Hydra callback
    {"launch"},  # where a job runs: plan, run, spawn, worker, watchdog
    {"modes", "callbacks"},  # what a job does besides training; extensions of the loop
    {"training"},  # the loop, its step, state and hooks
    {"checkpoint"},
    {"data", "reporting"},  # data sets; what one run leaves
]


def test_imports_run_downward() -> None:
    layer = {node: i for i, nodes in enumerate(LAYERS) for node in nodes}
    shared = len(LAYERS)
    def up(source: str, target: str) -> bool:
        above, below = layer.get(source, shared), layer.get(target, shared)
        return below < above or below == above != shared

    upward = sorted(f"{source} -> {target}" for source, targets in package_graph().items()
                    for target in targets if up(source, target))
    assert upward == []
    assert {"launch", "training", "sweeps"} <= set(layer)  # (the layers name real packages)


def test_app_imports_nothing_of_its_hydra_plugins() -> None:
    """The plugins (src/hydra_plugins) use app; app's own modules (`python -m app.status`
    among them) read a sweep's record and its jobs' ends through app.sweeps."""
    found = sorted(f"{path.relative_to(APP.parent)}: {name}" for path in APP.rglob("*.py")
                   for name in _imported(ast.parse(path.read_text()))
                   if name.startswith("hydra_plugins"))
    assert found == []
