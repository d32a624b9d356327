"""The package's layers (docs/architecture.md): every import points down, and no modules or folders
import each other in a circle. Imports are read with ``ast``, those inside functions included."""

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torchpipe"

# From the top floor down; the units of one floor do not import each other.
FLOORS = [
    ["__init__"],
    ["integrations", "sources", "testing"],
    ["io"],
    ["saved", "loader"],
    ["dataset"],
    ["graph"],
    ["distributed", "arguments"],
    ["ops"],
    ["autotune", "storage"],
    ["core", "image"],
    ["runtime"],
    ["observe"],
    ["options", "constants", "errors", "nest", "randomness", "deprecation", "shared_sequence"],
    ["seed_sequences"],
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The torchpipe modules ``path`` imports (``from a import b`` counts ``a.b`` where it is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_every_unit_has_a_floor():
    floored = {unit for floor in FLOORS for unit in floor}
    assert {_unit(module) for module in _modules()} == floored


def test_every_import_points_down():
    floor_of = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}
    upward = []
    for module, imported in _graph().items():
        for target in imported:
            a, b = _unit(module), _unit(target)
            if a != b and floor_of[b] <= floor_of[a]:
                upward.append(f"{module} -> {target}")
    assert sorted(upward) == []


def test_no_modules_import_each_other_in_a_circle():
    assert _circles(_graph()) == []


def _room(module: str, modules: dict[str, Path]) -> str:
    """A module's folder; a module directly in ``torchpipe/`` is a room of its own."""
    if modules[module].name == "__init__.py":
        return module
    folder = module.rpartition(".")[0]
    return module if folder == "torchpipe" else folder


def test_no_folders_import_each_other_in_a_circle():
    modules = _modules()
    folders: dict[str, set[str]] = collections.defaultdict(set)
    for module, imported in _graph().items():
        for target in imported:
            a, b = _room(module, modules), _room(target, modules)
            if a != b and a != "torchpipe":  # the package's face hands every public name on
                folders[a].add(b)
    assert _circles(folders) == []


def test_the_checks_see_a_circle_and_an_upward_import():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    floor_of = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}
    assert floor_of["runtime"] > floor_of["ops"] > floor_of["loader"]
