"""The import graph of ``src/``: no circle, folders in the order ``docs/architecture.md`` draws, and the pure
algorithm modules reach no gRPC, sockets or processes.

Read from the source: every ``import`` statement, at the top, inside a function or under
``if TYPE_CHECKING:``, so a lazy or a type-only import counts like any other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PURE = (
    "src.compression",
    "src.compressors.registry",
    "src.compressors.error_feedback",
    "src.compressors.policy",
    "src.ps.state.staleness",
    "src.adaptive.controller",
    "src.coordinator",
    "src.ps.state.aggregation",
    "src.ps.state.downlink",
    "src.ps.shards.placement",
    "src.ps.shards.parts",
    "src.ps.shards.sessions",
    "src.ps.shards.shard_zero",
    "src.ps.shards.rounds",
    "src.ps.shards.asynchronous",
    "src.ps.worker.machine",
    "src.ps.worker.calls",
    "src.ps.worker.membership",
    "src.ps.worker.codec",
    "src.common.sessions",
    "src.emulation.event_loop",
    "src.emulation.overlap",
)
"""The spec's algorithms and the virtual clock's: free of I/O, so a unit test or the virtual clock can drive them
alone."""
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
    return _imports_of_text(path.read_text(), name, package=path.name == "__init__.py")


def _imports_of_text(source: str, name: str, package: bool = False) -> set[str]:
    tree = ast.parse(source)
    package = name if package else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
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
    # The library is importable as ``torch_asgc`` too (pyproject's package-dir): the same modules as ``src.torch_asgc``.
    return {f"src.{name}" if name.split(".")[0] == "torch_asgc" else name for name in found}


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


def _layers() -> list[list[str]]:
    """The layers of ``docs/architecture.md``'s drawing, top first: each line's folders (``ps/``, or a folder's own
    subfolder, ``ps/worker/``) and top modules (``config.py``), the names before the first word that is neither."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawing = re.search(r"## Layers\n.*?```\n(.*?)```", text, re.S).group(1)
    layers = []
    for line in drawing.splitlines():
        names = []
        for word in line.replace(",", " ").split():
            if not re.fullmatch(r"[a-z_0-9]+(/[a-z_0-9]+)*(/|\.py)", word):
                break
            names.append(word)
        if names:
            layers.append(names)
    return layers


def _place(module: str, drawn: frozenset[str] = frozenset()) -> str:
    """The layer name of a ``src`` module: at the top, its file (``config.py``); else its folder (``ps/``), or the
    deepest of its folders that ``drawn`` names (``ps/worker/``)."""
    parts = module.split(".")
    if len(parts) == 2 and not (SRC / parts[1]).is_dir():
        return f"{parts[1]}.py"
    folders = parts[1:] if (SRC / Path(*parts[1:])).is_dir() else parts[1:-1]
    deeper = [f"{'/'.join(folders[:n])}/" for n in range(len(folders), 1, -1)]
    return next((name for name in deeper if name in drawn), f"{folders[0]}/")


def test_every_folder_and_top_module_has_one_layer():
    drawn = [name for layer in _layers() for name in layer]
    assert len(drawn) == len(set(drawn)), drawn
    inside, _ = _graph()
    assert {_place(m, frozenset(drawn)) for m in inside if m != "src"} == set(drawn)


def _upward(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """The imports of ``graph`` that leave their folder for one not below it in ``layers`` (top first)."""
    level = {name: index for index, layer in enumerate(reversed(layers)) for name in layer}
    drawn = frozenset(level)

    def place(module: str) -> str:
        return _place(module, drawn)

    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module != "src"
        for target in targets
        if target != "src" and place(target) != place(module) and level[place(target)] >= level[place(module)]
    )


def test_a_folder_imports_only_from_folders_below_it():
    inside, _ = _graph()
    assert _upward(inside, _layers()) == []


def test_the_layer_check_finds_a_planted_upward_or_sideways_import():
    assert (_place("src.ps.server.core"), _place("src.config"), _place("src.torch_asgc")) == (
        "ps/",
        "config.py",
        "torch_asgc/",
    )
    assert _place("src.ps.server.core", frozenset({"ps/", "ps/server/"})) == "ps/server/"
    assert _place("src.ps", frozenset({"ps/", "ps/server/"})) == "ps/"
    layers = [["launch/"], ["ps/", "worker.py"], ["common/"]]
    graph = {"src.ps.server.core": {"src.common.seeds", "src.ps.state.model"}, "src.launch.ps": {"src.ps.server.core"}}
    assert _upward(graph, layers) == []
    graph["src.common.seeds"] = {"src.launch.ps"}
    graph["src.worker"] = {"src.ps.server.core"}
    assert _upward(graph, layers) == ["src.common.seeds -> src.launch.ps", "src.worker -> src.ps.server.core"]
    sides = [["ps/worker/"], ["ps/server/"], ["ps/state/"]]  # a folder's subfolders in their own order
    assert _upward({"src.ps.state.model": {"src.ps.server.core"}, "src.ps.worker.machine": set()}, sides) == [
        "src.ps.state.model -> src.ps.server.core"
    ]


def test_no_import_circle_in_src():
    inside, _ = _graph()
    assert len(inside) > 100
    assert _circles(inside) == []


def test_type_checking_and_lazy_imports_count():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from src.ps.server.core import ServerCore\n"
    source += "def f():\n    from .seeds import derive_seed\n"
    source += "import torch_asgc.server\n"
    found = _imports_of_text(source, "src.common.planted")
    assert {"src.ps.server.core", "src.common.seeds", "src.torch_asgc.server"} <= found


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
    share lives in ``src/``, so no script imports another. (``tests/python_command.py`` sets a forked
    command's ``sys.path[0]`` to what ``python`` would give it: the script's folder, not an import path.)"""
    files = [p for folder in ("src", "scripts", "tests") for p in (ROOT / folder).rglob("*.py")] + list(
        ROOT.glob("*.py")
    )
    edit = "sys" + ".path."  # spelled apart, so this file does not find itself
    interpreter = ROOT / "tests" / "python_command.py"
    edits = [str(p.relative_to(ROOT)) for p in files if edit in p.read_text() and p != interpreter]
    assert edits == [], edits
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    crossing = sorted(
        f"{p.name} imports {m}"
        for p in (ROOT / "scripts").glob("*.py")
        for m in _imports(p, f"scripts.{p.stem}")
        if m.split(".")[0] in scripts or m.startswith("scripts")
    )
    assert crossing == [], crossing
