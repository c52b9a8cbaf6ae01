"""The library's layers (issue 19, docs/architecture.md): the runtime (`canzona.runtime`) imports
neither the harness (`canzona.harness`: launch, training, verify, calibrate, validate) nor the
single-device references (`reference/`), and no two modules import each other, directly or round
a loop, at load time or inside a function. Read from the sources (every `import` statement,
`if TYPE_CHECKING:` blocks excepted), so a lazy import counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("canzona", "sim", "cli", "reference")
# the one loop left: `ModelSpec.from_module` (torch-free spec) builds a spec from a torch module
# through the runtime's module walker, imported inside the method; the walker builds `ModelSpec`s
KNOWN_LOOPS = [{"canzona.spec", "canzona.runtime.modules", "canzona.runtime.shards"}]


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import submodule` depends on the submodule, not the package's code
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_the_runtime_imports_neither_the_harness_nor_the_references():
    graph = import_graph()
    for module in (m for m in graph if m.startswith("canzona.runtime")):
        bad = [t for t in graph.successors(module) if t.startswith(("canzona.harness", "reference"))]
        assert not bad, (module, bad)


def test_no_import_loops_but_the_known_one():
    loops = [set(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert loops == KNOWN_LOOPS, loops
