"""The package's import graph: layers only look down, and nothing imports in a cycle.

Read statically with ``ast`` (every ``import`` anywhere in a module, at module level or inside a
function), so a cycle hidden behind a function-level import counts too. ``from a import b`` is an
edge to ``a.b`` when ``b`` is a module, else to ``a``.

Layers, bottom to top (ARCHITECTURE.md): a module may import its own layer and the layers below.

Imports sit at module level: a function-level import of a slimact module is allowed only where
listed in ``LAZY_SLIMACT`` with its reason, one of another module only for an optional dependency
(``OPTIONAL``). ``import slimact`` already imports torch and every strategy, so a lazy import
saves no start-up time; it only hides an edge of the graph from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# (layer, module prefixes); the longest matching prefix wins.
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("slimact.utils", "slimact.sites", "slimact.patching", "slimact.timing", "slimact.peak")),
    (0, ("slimact.envinfo", "slimact.registry", "slimact.budget", "slimact.state")),
    (0, ("slimact.actions", "slimact.gradcheck", "slimact.spec")),
    (1, ("slimact.meter",)),
    (2, ("slimact.ops", "slimact.codecs", "slimact.modules", "slimact.data", "slimact.classify")),
    (2, ("slimact.hf_inputs",)),
    (
        2,
        (
            "slimact.models",
            "slimact.cola.layers",
            "slimact.cola.flops",
            "slimact.cola.model",
            "slimact.cola.family",
        ),
    ),
    (3, ("slimact.planner.plan", "slimact.planner.milp", "slimact.planner.highs")),
    (3, ("slimact.planner.rules", "slimact.planner.settings", "slimact.planner.jsonread")),
    (3, ("slimact.planner.scope",)),
    (3, ("slimact.planner.solve", "slimact.planner.offload")),
    (3, ("slimact.reformulate", "slimact.checkpointing")),
    (4, ("slimact.planner.apply", "slimact.planner.prac_sites", "slimact.planner.assign")),
    (5, ("slimact.strategies", "slimact.planner", "slimact.cola")),
    (5, ("slimact.compiled",)),
    (6, ("slimact.compare", "slimact.train", "slimact.hf", "slimact.dist", "slimact.bench")),
    (6, ("slimact.cola.cli", "slimact.planner.cli")),
    (7, ("slimact.cli", "slimact.__main__", "slimact")),
]


# (module, imported slimact module) -> why the import cannot sit at module level
LAZY_SLIMACT: dict[tuple[str, str], str] = {
    ("slimact.ops.inv_act", "slimact.ops.inv_act_triton"): (
        "inv_act_triton imports triton (optional: slimact[gpu]) at import, and triton reads "
        "TRITON_INTERPRET then (tests set it before the first Triton call)"
    ),
}
# module prefix -> why a function may import it (optional dependencies only)
OPTIONAL: dict[str, str] = {
    "triton": "slimact[gpu]",
    "transformers": "slimact[hf]",
    "matplotlib": "slimact[plot]",
    "torch.utils.tensorboard": "needs the tensorboard package, which slimact does not require",
    "torch.distributed.fsdp": "fully_shard (FSDP2) is torch >= 2.6; slimact takes torch >= 2.4",
    "torch.distributed.checkpoint": "FSDP2 only; absent from torch builds without distributed",
}
# (module, imported module) of non-optional modules still imported inside a function
LAZY_OTHER: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "slimact").rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _targets(node: ast.Import | ast.ImportFrom, package: str, mods: dict[str, Path]) -> list[str]:
    """The modules an import statement imports (relative imports resolved against
    ``package``; ``from pkg import mod`` names the submodule when it is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
    return subs or [base]


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _targets(node, _package(name, path), mods)
                edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def _function_level_imports(mods: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(module, line, imported module) of every import inside a function or method body."""
    out = []
    for name, path in mods.items():
        seen: set[int] = set()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(fn):
                if id(node) in seen or not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                seen.add(id(node))
                targets = _targets(node, _package(name, path), mods)
                out += [(name, node.lineno, t) for t in targets]
    return out


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


def _folder(module: str) -> str:
    """``slimact.<folder>`` for a module inside a subpackage, else the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else module


def test_folders_only_look_down():
    """No folder imports a folder that imports it back (the package root excepted: it
    re-exports everything)."""
    folders: dict[str, set[str]] = {}
    for m, ts in _package_edges(_edges(_modules())).items():
        if _folder(m) == "slimact":
            continue
        own = folders.setdefault(_folder(m), set())
        for t in ts:
            if _folder(t) not in (_folder(m), "slimact"):
                own.add(_folder(t))
                folders.setdefault(_folder(t), set())
    cycles = _cycles(folders)
    assert cycles == [], "folder cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


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


def test_no_function_level_imports_of_slimact_modules():
    """Imports of slimact modules sit at module level, so the graph above is the one a reader
    sees at the top of each file; the few exceptions are listed with their reasons."""
    found = {
        (m, t): line
        for m, line, t in _function_level_imports(_modules())
        if t == "slimact" or t.startswith("slimact.")
    }
    lazy = sorted(
        f"{m}:{line} imports {t}" for (m, t), line in found.items() if (m, t) not in LAZY_SLIMACT
    )
    assert lazy == [], "move these imports to module level:\n" + "\n".join(lazy)
    stale = sorted(f"{m} -> {t}" for m, t in set(LAZY_SLIMACT) - set(found))
    assert stale == [], f"LAZY_SLIMACT entries no longer needed: {stale}"


def test_functions_import_only_optional_dependencies():
    """A function-level import of anything else is an optional dependency (``OPTIONAL``)."""
    found = {
        (m, t): line
        for m, line, t in _function_level_imports(_modules())
        if t != "slimact" and not t.startswith("slimact.")
    }

    def optional(t: str) -> bool:
        return any(t == p or t.startswith(p + ".") for p in OPTIONAL)

    lazy = sorted(
        f"{m}:{line} imports {t}"
        for (m, t), line in found.items()
        if not optional(t) and (m, t) not in LAZY_OTHER
    )
    assert lazy == [], "move these imports to module level (or list an optional one):\n" + (
        "\n".join(lazy)
    )
    stale = sorted(f"{m} -> {t}" for m, t in set(LAZY_OTHER) - set(found))
    assert stale == [], f"LAZY_OTHER entries no longer needed: {stale}"


def test_the_import_finder_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "slimact"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\n\n\ndef f():\n    from . import b\n    import json\n")
    (pkg / "b.py").write_text("class C:\n    def m(self):\n        from slimact.a import f\n")
    mods = {"slimact": pkg / "__init__.py", "slimact.a": pkg / "a.py", "slimact.b": pkg / "b.py"}
    assert sorted(_function_level_imports(mods)) == [
        ("slimact.a", 5, "slimact.b"),
        ("slimact.a", 6, "json"),
        ("slimact.b", 3, "slimact.a"),
    ]


def test_no_source_file_over_600_lines():
    """Issue 15: files stay readable (the style guide aims at ~400; 600 is the hard limit)."""
    long = {
        str(p.relative_to(SRC)): n
        for p in (SRC / "slimact").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}, long
