"""One install path, read from the code: one module constructs the plan runtime, and the fixed
strategies are presets (``(model, config, filter_fn) -> (Plan, rows)``) with no transform of
their own; the strategies that still keep one are listed below with the reason (a ratchet).
"""

from __future__ import annotations

import ast
from pathlib import Path

import slimact  # noqa: F401  (registers every strategy)
from slimact.registry import _REGISTRY, preset_of, transform_of

SRC = Path(__file__).resolve().parents[1] / "src" / "slimact"

# strategy module -> why its registered strategies still keep a transform of their own
OWN_TRANSFORM: dict[str, str] = {
    "auto.py": "a planner (auto: lazy planning, its budget check) and a solved Plan",
    "compiled_presets.py": "the compiled path (CompiledPlan install), redesigned on its own",
    "compiled_auto.py": "the compiled planner, redesigned with the compiled path",
    "graph.py": "compile=True's one graph; its transform only refuses a part-by-part use",
}
FIXED = (
    *("none", "recompute", "invact", "invact-act", "chunked-ce", "cola", "cola-m"),
    *("int4", "int4-plain", "int4-paper", "int4-naive", "int8", "prac", "pac", "rac", "offload"),
)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name)
    ]


def test_one_module_constructs_the_plan_runtime():
    makers = {
        _module(p) for p in SRC.rglob("*.py") if _calls(ast.parse(p.read_text()), "PlanRuntime")
    }
    assert makers == {"slimact.planner.apply"}


def test_fixed_strategies_register_a_preset_and_no_transform():
    own: dict[str, int] = {}
    for path in sorted((SRC / "strategies").glob("*.py")):
        for call in _calls(ast.parse(path.read_text()), "register_strategy"):
            keywords = {k.arg for k in call.keywords}
            if len(call.args) >= 3 or "transform" in keywords:
                own[path.name] = own.get(path.name, 0) + 1
            else:
                assert "preset" in keywords, f"{path.name}:{call.lineno}"
    assert set(own) <= set(OWN_TRANSFORM), sorted(set(own) - set(OWN_TRANSFORM))
    for name in FIXED:
        entry = _REGISTRY[name]
        assert entry.transform is None and preset_of(entry.default) is not None, name
        assert transform_of(entry.default).func.__name__ == "_install_preset", name
