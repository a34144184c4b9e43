"""The import graph of ``src/``: no circle, and the pure algorithm modules reach no gRPC, sockets or processes.

Read from the source (every ``import`` statement, at the top or inside a function, outside
``if TYPE_CHECKING:`` blocks), so a lazy import counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PURE = ("src.compression", "src.staleness", "src.controller", "src.coordinator", "src.aggregation")
"""The spec's algorithms: free of I/O, so a unit test or the virtual clock can drive them alone."""
IMPURE = (
    "grpc",
    "socket",
    "socketserver",
    "multiprocessing",
    "subprocess",
    "torch.distributed",
    "concurrent.futures.process",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # "from src import x" names a module
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(src module -> the src modules it imports, src module -> everything it imports)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py") if "_pb2" not in p.name}
    everything = {name: _imports(path, name) for name, path in files.items()}
    inside = {name: {m for m in imported if m in files and m != name} for name, imported in everything.items()}
    return inside, everything


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
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


def test_no_import_circle_in_src():
    inside, _ = _graph()
    assert len(inside) > 40
    assert _circles(inside) == []


def test_the_circle_finder_finds_a_planted_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_pure_modules_reach_no_grpc_sockets_or_processes():
    inside, everything = _graph()
    for pure in PURE:
        reached, frontier = {pure}, [pure]
        while frontier:
            for target in inside[frontier.pop()]:
                if target not in reached:
                    reached.add(target)
                    frontier.append(target)
        outside = {m for module in reached for m in everything[module]}
        bad = sorted(m for m in outside if any(m == i or m.startswith(i + ".") for i in IMPURE))
        assert not bad, f"{pure} reaches {bad} (through {sorted(reached - {pure})})"


def test_no_sys_path_edits_and_no_script_imports_another():
    """Scripts and tests import the installed ``src`` (``pip install -r requirements.txt``); what scripts
    share lives in ``src/``, so no script imports another."""
    files = [p for folder in ("src", "scripts", "tests") for p in (ROOT / folder).rglob("*.py")] + list(
        ROOT.glob("*.py")
    )
    edit = "sys" + ".path."  # spelled apart, so this file does not find itself
    edits = [str(p.relative_to(ROOT)) for p in files if edit in p.read_text()]
    assert edits == [], edits
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    crossing = sorted(
        f"{p.name} imports {m}"
        for p in (ROOT / "scripts").glob("*.py")
        for m in _imports(p, f"scripts.{p.stem}")
        if m.split(".")[0] in scripts or m.startswith("scripts")
    )
    assert crossing == [], crossing
