"""No import circles in `accel` and `harness` (issue 34): each module's imports form a graph without cycles.

Every import statement counts, at top level or inside a function, since an import hidden in
a function is still a circle between two rooms; only ``if TYPE_CHECKING:`` blocks, which never
run, are left out. When this test fails it names each circle with its edges: break it by moving
what both sides share into a lower module (errors in a module of their own, a registry or a
callback where a lower room must tell a higher one), not by moving the import into a function.
"""

import ast
import pathlib

import accel
import harness

ROOTS = [pathlib.Path(accel.__file__).parent, pathlib.Path(harness.__file__).parent]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            if "stub" in path.relative_to(root).parts:  # the stand-in torch_xla package, not ours
                continue
            found[_module_name(path, root)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every import statement of the tree, except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _import_nodes_of(child))
            continue
        yield from _import_nodes_of(node)


def _import_nodes_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _import_nodes(node)


def _owner(name: str, modules: dict) -> str | None:
    """The module of ours that an imported dotted name lives in (a name imported from a package
    may be a submodule of it or an attribute of its ``__init__``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1] if node.level else []
        package = ".".join(base + ([node.module] if node.module else []))
        names = [f"{package}.{alias.name}" for alias in node.names]
    return {owner for name in names if (owner := _owner(name, modules)) and owner != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[module] = set().union(*(_targets(n, module, is_package, modules) for n in _import_nodes(tree)))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_the_graph_sees_imports_at_top_level_and_inside_functions_but_not_type_checking():
    graph = {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.a"}}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    tree = ast.parse(
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import accel.sim\n"
        "def f():\n    from accel import state\n"
    )
    modules = {"accel": None, "accel.state": None, "accel.sim": None, "accel.hooks": None}
    targets = set().union(*(_targets(n, "accel.hooks", False, modules) for n in _import_nodes(tree)))
    assert targets == {"accel.state"}
    real = import_graph()
    assert "accel.state" in real["accel.accelerator"]


def test_no_import_circles_in_accel_and_harness():
    graph = import_graph()
    found = circles(graph)
    report = [
        " / ".join(component)
        + ": "
        + ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a] & set(component)))
        for component in found
    ]
    assert not found, "import circles:\n" + "\n".join(report)


CUDA = "accel.sim.cuda"


def _rooms() -> dict[str, set[str]]:
    """Each room of the simulated GPU -> the rooms its ``__init__`` docstring's "May import:" line allows."""
    rooms = {}
    for init in sorted((ROOTS[0] / "sim" / "cuda").glob("*/__init__.py")):
        lines = [line for line in (ast.get_docstring(ast.parse(init.read_text())) or "").splitlines()]
        allowed = [line.partition(":")[2] for line in lines if line.startswith("May import:")]
        assert allowed, f"{init}: its docstring must end with a 'May import:' line naming the rooms it may import"
        words = allowed[0].replace(",", " ").replace(".", " ").split()
        rooms[init.parent.name] = set(words)
    return rooms


def test_each_room_of_the_simulated_gpu_says_what_it_holds_and_imports_only_what_it_says():
    rooms = _rooms()
    assert {"gpus", "memory", "tensors", "kernels", "attention", "nccl", "torch_cuda", "timing"} <= set(rooms)
    wrong = []
    for module, targets in import_graph().items():
        room = module.removeprefix(CUDA + ".").partition(".")[0]
        if not module.startswith(CUDA + ".") or room not in rooms:
            continue
        for target in targets:
            other = target.removeprefix(CUDA + ".").partition(".")[0]
            if target.startswith(CUDA + ".") and other != room and other not in rooms[room]:
                wrong.append(f"{module} -> {target} (room {room!r} may import {sorted(rooms[room] & set(rooms))})")
    assert not wrong, "imports a room's docstring does not allow:\n" + "\n".join(wrong)
