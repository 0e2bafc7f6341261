"""The package's import graph: layers only look down, and nothing imports in a cycle.

Read statically with ``ast`` (every ``import`` anywhere in a module, at module level or inside a
function), so a cycle hidden behind a function-level import counts too. ``from a import b`` is an
edge to ``a.b`` when ``b`` is a module, else to ``a``.

Layers, bottom to top (ARCHITECTURE.md): a module may import its own layer and the layers below.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# (layer, module prefixes); the longest matching prefix wins.
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("slimact.utils", "slimact.sites", "slimact.patching", "slimact.timing", "slimact.peak")),
    (0, ("slimact.envinfo", "slimact.registry", "slimact.budget", "slimact.state")),
    (0, ("slimact.actions",)),
    (1, ("slimact.meter",)),
    (2, ("slimact.ops", "slimact.codecs", "slimact.modules", "slimact.data", "slimact.classify")),
    (2, ("slimact.hf_inputs",)),
    (2, ("slimact.models", "slimact.cola.layers", "slimact.cola.flops", "slimact.cola.model")),
    (3, ("slimact.planner.plan", "slimact.planner.milp", "slimact.planner.solve")),
    (3, ("slimact.reformulate", "slimact.checkpointing")),
    (4, ("slimact.planner.apply",)),
    (5, ("slimact.strategies", "slimact.planner", "slimact.cola")),
    (5, ("slimact.compiled",)),
    (6, ("slimact.compare", "slimact.train", "slimact.hf", "slimact.dist", "slimact.bench")),
    (6, ("slimact.cola.rank", "slimact.cola.cli", "slimact.planner.cli")),
    (7, ("slimact.cli", "slimact.__main__", "slimact")),
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "slimact").rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs or [base]
            else:
                continue
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def layer_of(module: str) -> int:
    best, layer = -1, None
    for lvl, prefixes in LAYERS:
        for p in prefixes:
            below = module.startswith(p + ".") and p != "slimact"  # the root: itself only
            if (module == p or below) and len(p) > best:
                best, layer = len(p), lvl
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges without those into a package's own ``__init__`` from inside it (a package's
    ``__init__`` re-exports its modules; its modules importing siblings is not a cycle)."""
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}


def test_every_module_has_a_layer():
    for m in _modules():
        layer_of(m)


def test_no_import_cycles():
    cycles = _cycles(_package_edges(_edges(_modules())))
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_layers_only_look_down():
    up = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, ts in sorted(_package_edges(_edges(_modules())).items())
        for t in sorted(ts)
        if layer_of(t) > layer_of(m)
    ]
    assert up == [], "upward imports:\n" + "\n".join(up)


def test_the_checker_catches_a_cycle_and_an_upward_import():
    edges = {"slimact.sites": {"slimact.meter"}, "slimact.meter": {"slimact.sites"}}
    assert _cycles(edges) == [["slimact.meter", "slimact.sites"]]
    assert layer_of("slimact.meter") > layer_of("slimact.sites")
    assert layer_of("slimact.strategies.int4") > layer_of("slimact.codecs.quant")


def test_no_source_file_over_600_lines():
    """Issue 15: files stay readable (the style guide aims at ~400; 600 is the hard limit)."""
    long = {
        str(p.relative_to(SRC)): n
        for p in (SRC / "slimact").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}, long
