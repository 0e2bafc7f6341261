"""Who may hook or override a model's forward: the runtime lastingly, measurement for one step.

Read statically (every call of ``register_forward_pre_hook``, ``register_forward_hook``,
``register_full_backward_hook``, ``override_forward`` and every assignment to ``.forward`` in
``src/``). A module that does must be listed, with what it hooks and why, in one of two
lists, and a module that no longer does must leave its list, so they can only shrink:

* ``RUNTIME``: what changes a model lastingly, the plan runtime and the patchers it calls (the
  router, checkpointing, the reformulations, the compiled blocks, CoLA-M's registered block
  reformulation). The plan's companions (the first-step budget check, the plan evolver) have
  no hook of their own: they are the runtime's watchers (``PlanRuntime.watch``, checked in
  ``test_planner_budget.py``);
* ``MEASUREMENT``: hooks entered for one measured step and removed after it, also when it
  raises; ``test_no_leftovers.py`` runs every entry point and checks that nothing is left (a
  new measurement entry point belongs there too).

Nothing else hooks a model: compiled-auto's lazy planning is a watcher of its runtime too.
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

RUNTIME = {
    "slimact.planner.apply": "the plan runtime's two root hooks (plan, router, policy, watchers)",
    "slimact.sites": "the router: per-module hooks naming sites while it is entered",
    "slimact.checkpointing": "the checkpoint wrapper and the KV-cache guard",
    "slimact.reformulate.activations": "inverted activations and norms; the consumer probe",
    "slimact.reformulate.head": "the chunked loss head and its root part",
    "slimact.reformulate.norms": "PRAC's fused RMSNorms",
    "slimact.compiled.blocks": "compiled block forwards (slimact's and hf.compile_blocks')",
    "slimact.planner.graph": "compile=True's one-graph root forward (the plan lowered)",
    "slimact.cola.colam": "CoLA-M's rank-r checkpoints, the runtime's block reformulation",
}
MEASUREMENT = {
    "slimact.meter": "the meter's per-module hooks",
    "slimact.planner.profiler": "the planner's per-block profile",
    "slimact.planner.gradstats": "gradient error of a lossy candidate",
    "slimact.planner.reforms": "the planner's reformulation candidates",
    "slimact.planner.compiled_root": "records module inputs for the compiled planner",
    "slimact.train.rank": "effective-rank capture",
    "slimact.bench.anchors": "the benchmark's torch.compile anchor, on the point's own copy",
}
ALLOWED = {**RUNTIME, **MEASUREMENT}


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
