"""Every third-party module the package imports is declared in pyproject.toml; a failed import
of a strategy module leaves no half-filled registry behind."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "slimact"
# import name -> distribution name, where they differ
DIST_OF = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}
# modules that need an optional extra at import time; only ever imported inside functions (on
# first use), so their module-level imports count as optional ones
OPTIONAL_MODULES = {"ops/inv_act_triton.py": "slimact.ops.inv_act_triton"}


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        out = set()
        for r in reqs:
            name = r.split(";")[0].strip()
            for sep in "<>=!~[ ":
                name = name.split(sep)[0]
            out.add(name.lower())
        return out

    extras = set().union(*(names(v) for v in project["optional-dependencies"].values()))
    return names(project["dependencies"]), extras


def _imports() -> tuple[set[str], set[str]]:
    """Third-party top-level modules imported at module level, and inside functions."""
    top, inner = set(), set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        nested = {id(n) for f in funcs for n in ast.walk(f) if n is not f}
        optional = path.relative_to(SRC).as_posix() in OPTIONAL_MODULES
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for m in mods:
                root = m.split(".")[0]
                if root in sys.stdlib_module_names or root == "slimact":
                    continue
                where = inner if optional or id(node) in nested else top
                where.add(DIST_OF.get(root, root).lower())
    return top, inner


def test_module_level_imports_are_core_dependencies():
    core, extras = _declared()
    top, inner = _imports()
    assert top <= core, f"imported at module level but not in [project.dependencies]: {top - core}"
    missing = inner - core - extras
    assert not missing, f"imported (optionally) but declared nowhere: {missing}"
    assert "scipy" in core and "pulp" not in core | extras


def test_optional_modules_are_imported_only_inside_functions():
    """What lets ``OPTIONAL_MODULES`` import an extra at module level: nobody imports them so."""
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        nested = {id(n) for f in funcs for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if id(node) in nested or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = [a.name for a in node.names]
            if isinstance(node, ast.Import):
                full = names
            else:
                full = [node.module or ""] + [f"{node.module}.{n}" for n in names]
            for mod in OPTIONAL_MODULES.values():
                assert mod not in full, f"{path.relative_to(SRC)} imports {mod} at module level"


def test_failed_strategy_import_surfaces_its_own_error_every_time():
    code = (
        "import sys\n"
        "sys.modules['scipy'] = None\n"  # scipy missing: the planner's import fails
        "msgs = []\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        import slimact\n"
        "    except ImportError as e:\n"
        "        msgs.append(str(e))\n"
        "registry = sys.modules['slimact.registry']\n"  # survives the failed import
        "print(len(registry._REGISTRY), '|'.join(msgs))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    n, msgs = out.stdout.strip().split(" ", 1)
    assert n == "0"  # nothing half-registered
    first, second = msgs.split("|")
    assert "scipy" in first and "scipy" in second and "already registered" not in msgs


def test_registering_a_taken_name_with_another_transform_fails():
    import pytest

    from slimact.strategies import NoneConfig, register_strategy

    with pytest.raises(ValueError, match="'none' is already registered by"):
        register_strategy("none", NoneConfig(), lambda m, c, f: [])


def test_missing_optional_dependency_names_the_extra(monkeypatch):
    import pytest

    from slimact.utils import MissingDependency, require

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependency, match=r"plots needs matplotlib.*slimact\[plot\]"):
        require("matplotlib", "plot", "plots")
