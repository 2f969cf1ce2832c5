"""Imports flow one way: the layers of docs/architecture.md, checked on the code's import statements.

Every `import` and `from ... import` of every module under the layered packages counts: those at
the top of a file, those inside functions (lazy ones) and those under `if TYPE_CHECKING:`. A lazy
import is still a dependency, only a hidden one. The checker is tried on planted violations in a
small tree of its own first, then run on the real tree. `python tests/test_import_layers.py`
prints what it finds in the real tree.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("akv_core", "policy_dsl", "akv_stats", "store", "sandbox", "akv_proxy", "evolve", "akv_cli",
            "benchmarks")

# What each package may import besides itself; a name allows that module and everything under it.
# `benchmarks/` sits outside the layers: it may use everything `evolve` may, never `evolve` itself
# (`akv bench evolve` and `akv bench proposals` hand evolve's objects in from akv_cli/bench.py).
ALLOWED: Mapping[str, tuple[str, ...]] = {
    "akv_core": (),
    "policy_dsl": (),
    "akv_stats": (),
    "store": ("akv_core.home",),
    "sandbox": ("akv_core", "policy_dsl", "akv_stats", "store"),
    "akv_proxy": ("akv_core", "policy_dsl", "akv_stats"),
    "evolve": ("akv_core", "policy_dsl", "akv_stats", "store", "sandbox"),
    "benchmarks": ("akv_core", "policy_dsl", "akv_stats", "store", "sandbox"),
    "akv_cli": ("akv_core", "policy_dsl", "akv_stats", "store", "sandbox", "akv_proxy", "evolve", "benchmarks"),
}
# Inside akv_core, bottom to top: a module imports modules of its own tier or lower ones. A module
# not named here is an engine-tier one (requests, batching: beside engine.py).
CORE_TIERS: tuple[tuple[str, ...], ...] = (
    ("akv_core.home", "akv_core.threads", "akv_core.sampling", "akv_core.constrain", "akv_core.call_closing",
     "akv_core.client"),
    ("akv_core.model", "akv_core.kernels", "akv_core.tokenizer", "akv_core.chat"),
    ("akv_core.cache",),
    ("akv_core.engine",),
    ("akv_core.server", "akv_core"),
)
CORE_DEFAULT_TIER = 3
# cache/ is pure Python, so that the replay simulator runs the engine's own planner without a model.
NEVER: Mapping[str, tuple[str, ...]] = {"akv_core.cache": ("akv_core.model", "akv_core.kernels")}


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `path:line`."""

    source: str
    target: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_files(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of `packages` under `root` by dotted name (a package by its __init__.py)."""
    return {_module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module `name` means: itself, or the closest enclosing module we have (a.b.C -> a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: Mapping[str, Path]) -> list[str]:
    """Our modules one import statement names (a `from` of submodules names those, not the package)."""
    if isinstance(node, ast.Import):
        return [t for t in (_known(alias.name, modules) for alias in node.names) if t]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    if len(submodules) == len(node.names):
        return submodules
    return submodules + [t for t in (_known(base, modules),) if t]


def import_edges(root: Path, packages: Iterable[str] = PACKAGES) -> list[Edge]:
    """Every import of one of our modules by another, lazy and TYPE_CHECKING ones included."""
    modules = module_files(root, packages)
    edges = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, path.name == "__init__.py", modules):
                    if target != module:
                        edges.append(Edge(module, target, str(path.relative_to(root)), node.lineno))
    return edges


def _core_tier(module: str) -> int:
    for tier, names in enumerate(CORE_TIERS):
        if module in names:
            return tier
    matches = [(len(name), tier) for tier, names in enumerate(CORE_TIERS) for name in names
               if name != "akv_core" and _within(module, name)]
    return max(matches)[1] if matches else CORE_DEFAULT_TIER


def layer_violations(edges: Iterable[Edge]) -> list[str]:
    """One line per import that goes up or sideways, naming the file, the line and the rule."""
    found = []
    for edge in edges:
        source, target = edge.source.split(".")[0], edge.target.split(".")[0]
        if source != target and not any(_within(edge.target, allowed) for allowed in ALLOWED.get(source, ())):
            rule = ", ".join(ALLOWED.get(source, ())) or "nothing of ours"
            found.append(f"{edge.where()}: {edge.source} imports {edge.target}; {source} may import {rule}")
        elif source == target == "akv_core":
            found += _core_violation(edge)
    return found


def _core_violation(edge: Edge) -> list[str]:
    for below, never in NEVER.items():
        if _within(edge.source, below) and any(_within(edge.target, name) for name in never):
            return [f"{edge.where()}: {edge.source} imports {edge.target}; {below} never imports {', '.join(never)}"]
    if _core_tier(edge.target) > _core_tier(edge.source):
        return [f"{edge.where()}: {edge.source} imports {edge.target}, a higher tier of akv_core "
                f"({_core_tier(edge.source)} < {_core_tier(edge.target)}; CORE_TIERS, docs/architecture.md)"]
    return []


def import_cycles(edges: Sequence[Edge]) -> list[str]:
    """One line per strongly connected component of the import graph: a cycle through it, each
    import with its file and line."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, {}).setdefault(edge.target, edge)
    return [_cycle_line(component, graph) for component in _components(graph) if len(component) > 1]


def _components(graph: Mapping[str, Mapping[str, Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit on a deep graph)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
            elif successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(graph.get(successor, {})))))
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
    return components


def _cycle_line(component: list[str], graph: Mapping[str, Mapping[str, Edge]]) -> str:
    """The shortest cycle through the component's first module, as `a -> b (file:line) -> a (file:line)`."""
    members, start = set(component), component[0]
    came_from: dict[str, Edge] = {}
    frontier = [start]
    while frontier and start not in came_from:
        frontier = [_visit(edge, came_from) for node in frontier for edge in graph[node].values()
                    if edge.target in members and edge.target not in came_from]
        frontier = [node for node in frontier if node is not None]
    path, node = [], start
    while not path or node != start:
        edge = came_from[node]
        path.append(f"{edge.target} ({edge.where()})")
        node = edge.source
    return f"cycle among {len(component)} modules: {start} -> " + " -> ".join(reversed(path))


def _visit(edge: Edge, came_from: dict[str, Edge]) -> str | None:
    if edge.target in came_from:
        return None
    came_from[edge.target] = edge
    return edge.target


# ---- the checker, on a tree of its own -------------------------------------------------------------

def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in {p.parent for p in root.rglob("*.py")}:
        if package != root and not (package / "__init__.py").exists():
            (package / "__init__.py").write_text("")
    return root


CLEAN = {
    "akv_core/home.py": "import os\n",
    "akv_core/chat.py": "from akv_core.model.locate import locate\n",
    "akv_core/model/locate.py": "from akv_core.home import akv_home\n",
    "akv_core/cache/ops.py": "from akv_core.chat import content_text\nfrom . import usage\n",
    "akv_core/cache/usage.py": "",
    "akv_core/engine.py": "from akv_core.cache import ops\n",
    "policy_dsl/editor.py": "from policy_dsl.decision import TextEdit\n",
    "policy_dsl/decision.py": "",
    "store/database.py": "from akv_core.home import akv_home\n",
    "sandbox/backends/__init__.py": "from sandbox.backends.base import BackendError\n\n"
                                    "def open_backend():\n    from sandbox.backends.http import HttpBackend\n",
    "sandbox/backends/base.py": "from akv_core.client import ChatError\n",
    "sandbox/backends/http.py": "from .base import BackendError\n",
    "akv_core/client.py": "",
    "akv_proxy/step.py": "from policy_dsl.editor import TextEditor\nfrom akv_core.client import ChatClient\n",
    "evolve/loop.py": "from sandbox.backends import open_backend\nfrom store.database import open_engine\n",
    "akv_cli/evolve.py": "def run():\n    from evolve.loop import run\n",
    "benchmarks/cost.py": "from sandbox.backends.base import BackendError\n",
}


def test_a_clean_tree_has_no_violations_and_no_cycles(tmp_path: Path) -> None:
    edges = import_edges(_tree(tmp_path, CLEAN))
    assert layer_violations(edges) == [] and import_cycles(edges) == []
    # relative imports and `from package import submodule` resolve to the submodule
    assert {(e.source, e.target) for e in edges} >= {("akv_core.cache.ops", "akv_core.cache.usage"),
                                                     ("sandbox.backends.http", "sandbox.backends.base"),
                                                     ("akv_core.engine", "akv_core.cache.ops")}


@pytest.mark.parametrize(("path", "text", "expected"), [
    ("akv_proxy/app.py", "def backend():\n    from sandbox.backends.http import HttpBackend\n",
     "akv_proxy/app.py:2: akv_proxy.app imports sandbox.backends.http; akv_proxy may import akv_core, policy_dsl"),
    ("akv_proxy/recorder.py", "import store.database\n", "akv_proxy.recorder imports store.database"),
    ("sandbox/runs/oracle.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from evolve.loop import Loop\n",
     "sandbox/runs/oracle.py:3: sandbox.runs.oracle imports evolve.loop"),
    ("akv_stats/champion.py", "from sandbox.backends.base import BackendError\n",
     "akv_stats.champion imports sandbox.backends.base; akv_stats may import nothing of ours"),
    ("benchmarks/arms.py", "from evolve import loop\n", "benchmarks.arms imports evolve.loop"),
    ("store/traces.py", "from akv_core.chat import content_text\n", "store may import akv_core.home"),
    ("policy_dsl/parser.py", "from akv_core.home import akv_home\n", "policy_dsl may import nothing of ours"),
    ("akv_core/cache/radix.py", "from akv_core.model.locate import locate\n",
     "akv_core.cache never imports akv_core.model"),
    ("akv_core/model/llama.py", "def f():\n    from akv_core.engine import Engine\n",
     "akv_core/model/llama.py:2: akv_core.model.llama imports akv_core.engine, a higher tier of akv_core (1 < 3"),
    ("akv_core/cache/key.py", "from ..server import app\n", "akv_core.cache.key imports akv_core.server.app"),
], ids=["proxy-sandbox-lazy", "proxy-store", "type-checking-evolve", "stats-sandbox", "bench-evolve", "store-core",
        "dsl-core", "cache-model", "core-tier-lazy", "relative-up"])
def test_a_planted_upward_import_is_named_with_its_line(tmp_path: Path, path: str, text: str, expected: str) -> None:
    edges = import_edges(_tree(tmp_path, {**CLEAN, path: text, "akv_core/server/app.py": "",
                                          "evolve/__init__.py": ""}))
    [violation] = layer_violations(edges)
    assert expected in violation


def test_a_cycle_through_a_function_local_import_is_found_with_its_lines(tmp_path: Path) -> None:
    planted = {"sandbox/runs/harness.py": "from sandbox.runs.lanes import Lanes\n",
               "sandbox/runs/lanes.py": "import queue\n\n\ndef run():\n    from sandbox.runs import harness\n"}
    edges = import_edges(_tree(tmp_path, {**CLEAN, **planted}))
    assert import_cycles(edges) == ["cycle among 2 modules: sandbox.runs.harness -> sandbox.runs.lanes "
                                    "(sandbox/runs/harness.py:1) -> sandbox.runs.harness (sandbox/runs/lanes.py:5)"]
    assert layer_violations(edges) == []  # a cycle inside a layer breaks no layer rule: it is found as a cycle


def test_a_package_and_its_submodule_importing_each_other_is_a_cycle(tmp_path: Path) -> None:
    planted = {"sandbox/backends/http.py": "from sandbox.backends import BackendError\n"}
    [cycle] = import_cycles(import_edges(_tree(tmp_path, {**CLEAN, **planted})))
    assert cycle.startswith("cycle among 2 modules: sandbox.backends -> sandbox.backends.http")


def test_a_longer_cycle_is_one_component(tmp_path: Path) -> None:
    planted = {"store/a.py": "from store import b\n", "store/b.py": "from store.c import x\n",
               "store/c.py": "def f():\n    import store.a\n"}
    [cycle] = import_cycles(import_edges(_tree(tmp_path, {**CLEAN, **planted})))
    assert cycle == ("cycle among 3 modules: store.a -> store.b (store/a.py:1) -> store.c (store/b.py:1) "
                     "-> store.a (store/c.py:2)")


# ---- the real tree -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(ROOT)


def test_the_checker_reads_the_whole_tree(edges: list[Edge]) -> None:
    sources = {e.source.split(".")[0] for e in edges}
    assert sources == set(PACKAGES) and len(edges) > 500


def test_every_import_of_the_tree_follows_the_layers(edges: list[Edge]) -> None:
    assert layer_violations(edges) == []


def test_the_tree_has_no_import_cycle_lazy_imports_included(edges: list[Edge]) -> None:
    assert import_cycles(edges) == []


if __name__ == "__main__":
    found = import_edges(ROOT)
    problems = layer_violations(found) + import_cycles(found)
    print("\n".join(problems) or f"{len(found)} imports between {len(module_files(ROOT))} modules: no violation, "
          "no cycle")
    sys.exit(1 if problems else 0)
