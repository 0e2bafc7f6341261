"""Who may hook or override a model's forward: a ratchet towards "only the runtime does".

Read statically (every call of ``register_forward_pre_hook``, ``register_forward_hook``,
``register_full_backward_hook``, ``override_forward`` and every assignment to ``.forward`` in
``src/``). Each module that does is listed in ``ALLOWED`` with what it hooks and why; a new one
fails this test, so the list can only shrink. The runtime's own modules come first; the rest
are the reformulations and checkpointing it calls (applied through it for a plan), measurement
(hooks entered for one measured step and removed), and the strategies not yet presets.

This test only says who may hook; that the measurement modules (and ``apply`` then ``revert``
of every strategy) leave nothing behind, also when the measured step raises, is checked
dynamically by ``test_no_leftovers.py``: a new measurement entry point belongs there too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CALLS = {
    "register_forward_pre_hook",
    "register_forward_hook",
    "register_full_backward_hook",
    "override_forward",
}

ALLOWED = {
    # the runtime and the router it enters
    "slimact.planner.apply": "the plan runtime's root hooks (plan, router, policy)",
    "slimact.sites": "the router: per-module hooks naming sites while it is entered",
    # what the runtime applies (also called by the strategies not yet presets)
    "slimact.checkpointing": "the checkpoint wrapper and the KV-cache guard",
    "slimact.reformulate.activations": "inverted activations and norms; the consumer probe",
    "slimact.reformulate.head": "the chunked loss head and its root part",
    "slimact.reformulate.norms": "PRAC's fused RMSNorms",
    # the first-step checks and re-planning around a runtime (removed by revert; dynamically:
    # test_no_leftovers)
    "slimact.planner.adaptive": "the first-step budget check and re-plan",
    "slimact.planner.evolve": "the plan evolver's tracking steps",
    # compiled blocks (torch.compile per block) and compiled-auto's lazy planning
    "slimact.compiled.blocks": "compiled block forwards",
    "slimact.strategies.compiled_auto": "plans on the first training forward (then unhooks)",
    "slimact.planner.compiled_root": "records module inputs for the compiled planner (measured)",
    "slimact.hf": "compile_blocks for Hugging Face models",
    # CoLA-M: not a preset yet
    "slimact.cola.colam": "CoLA-M's rank-r checkpoints",
    # measurement: hooks entered for a measured step and removed after it, also when it raises
    # (each entry point is run and checked for leftovers in test_no_leftovers)
    "slimact.meter": "the meter's per-module hooks",
    "slimact.planner.profiler": "the planner's per-block profile",
    "slimact.planner.gradstats": "gradient error of a lossy candidate",
    "slimact.planner.reforms": "the planner's reformulation candidates",
    "slimact.train.rank": "effective-rank capture",
    "slimact.bench.anchors": "the benchmark's torch.utils.checkpoint anchor",
}


def _hookers() -> dict[str, int]:
    found: dict[str, int] = {}
    for p in sorted((SRC / "slimact").rglob("*.py")):
        mod = ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        n = 0
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                n += name in CALLS
            elif isinstance(node, ast.Assign):
                n += any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in node.targets)
        if n:
            found[mod] = n
    return found


def test_only_listed_modules_hook_or_override_a_model():
    found = _hookers()
    new = sorted(set(found) - set(ALLOWED))
    assert not new, f"modules hooking or overriding forwards, not in ALLOWED: {new}"


def test_the_list_holds_no_module_that_no_longer_hooks():
    gone = sorted(set(ALLOWED) - set(_hookers()))
    assert not gone, f"ALLOWED lists modules that no longer hook (remove them): {gone}"
