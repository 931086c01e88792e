"""Import hygiene of ``src/fastdecode`` (issue 30), read from the source with ``ast``: no import
cycle between modules (imports inside functions count: a lazy import is still a dependency), no
room importing a room above it, no Python file over 400 lines.

A room is a top-level package or module of ``fastdecode``. ``ROOMS`` lists them from the bottom up:
a module may import its own room and the rooms below it. Imports under ``if TYPE_CHECKING:`` are
annotations only and are not counted. The allow-lists hold today's known exceptions, each with why;
they may only shrink."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "fastdecode"

# Bottom to top (DESIGN.md, "Rooms"): errors and checks; configs; the layers (products, attention, the
# compiled ops); caches; model families; loaders; token choice; the engine; the generation strategies; the things
# built on them (speech, the batch pipeline); the public API and what stands on it.
ROOMS = [
    "errors", "validation", "constraints", "memory", "heap", "config", "prompt_checks",
    "layers", "cache", "models", "loading", "decoding", "engine", "generation", "inspect", "speech", "pipeline",
    "api", "__init__", "load_settings", "serve", "integrations", "cli", "__main__",
]

# Cycles known today (none): an entry is removed when its cycle is gone.
ALLOWED_CYCLES: list[set[str]] = []
# Upward imports known today (importer -> imported): none; an entry would be removed once fixed.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
MAX_LINES = 400
# Files over MAX_LINES today: none.
ALLOWED_LONG: set[str] = set()


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                skipped |= {id(sub) for sub in ast.walk(node)}
    return skipped


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: dict) -> list[str]:
    """The fastdecode modules an import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names]
    resolved = []
    for target in names:
        while target not in known and "." in target:  # an attribute of a module: that module
            target = target.rsplit(".", 1)[0]
        if target in known and target != name:
            resolved.append(target)
    return resolved


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, (path, is_package) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        skipped = _type_checking_only(tree)
        graph[name] = {target for node in ast.walk(tree)
                       if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped
                       for target in _targets(name, is_package, node, known)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    """The checks below can fail: a cycle, and an import inside a function, are found."""
    source = "def f():\n    from .b import g\n"
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    known = {"fastdecode.x.a": None, "fastdecode.x.b": None}
    assert _targets("fastdecode.x.a", False, node, known) == ["fastdecode.x.b"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_every_room_is_ordered():
    assert {room(module) for module in modules()} == set(ROOMS)


def test_no_import_cycle_between_modules():
    found = [component for component in cycles(import_graph()) if component not in ALLOWED_CYCLES]
    assert not found, f"import cycles: {[sorted(c) for c in found]}"


def test_no_room_imports_a_room_above_it():
    upward = sorted((module, target) for module, targets in import_graph().items() for target in targets
                    if ROOMS.index(room(target)) > ROOMS.index(room(module))
                    and (module, target) not in ALLOWED_UPWARD)
    assert not upward, "upward imports (ROOMS order): " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_the_allow_lists_hold_only_what_still_exists():
    """An exception that was fixed leaves its allow-list (so the lists only shrink)."""
    graph = import_graph()
    assert all(component in cycles(graph) for component in ALLOWED_CYCLES)
    assert all(target in graph[module] for module, target in ALLOWED_UPWARD)
    assert all(len((SRC / path).read_text(encoding="utf-8").splitlines()) > MAX_LINES for path in ALLOWED_LONG)


def test_no_python_file_over_400_lines():
    long = sorted(f"{path.relative_to(SRC)} ({lines})" for path in PACKAGE.rglob("*.py")
                  if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
                  and str(path.relative_to(SRC)) not in ALLOWED_LONG)
    assert not long, f"files over {MAX_LINES} lines: {long}"
