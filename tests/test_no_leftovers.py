"""Measurement leaves nothing on a model: the dynamic side of ``test_hooks.py``.

``test_hooks.py`` lists, statically, the modules that hook or override a model's forward; most
of the non-runtime ones are measurement (the meter, the planner's profile, its gradient-error
runs and reformulation candidates, the compiled planner's root options, the rank capture, the
benchmark's anchors, ``describe``, ``plan_of``), whose hooks must live for one measured step
and be gone after it, also when that step raises. Here each entry point runs on a fresh model
and ``leftovers(model)`` must be empty afterwards: no module hook, no instance ``forward``, no
global module hook, no router state, no slimact state. ``apply`` then ``revert`` of every
strategy that runs on CPU must leave nothing either.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals

import slimact
from slimact import sites
from slimact.codecs.offload import using_streams
from slimact.models import build_model
from slimact.state import peek
from test_hooks import RUNTIME

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
BAD = (RuntimeError, TypeError)  # float token ids: refused by the model, or by the embedding
ROUTER_LISTS = ("stack", "listeners", "cast_listeners", "policies", "roles")


def leftovers(model: nn.Module) -> list[str]:
    """Everything slimact (or anything) left on ``model`` and in the process's global hooks."""
    out = []
    for path, m in model.named_modules():
        name = path or "<root>"
        for d in HOOK_DICTS:
            if getattr(m, d, None):
                out.append(f"{name}: {d} {list(getattr(m, d).values())}")
        if "forward" in m.__dict__:
            out.append(f"{name}: instance forward {m.__dict__['forward']!r}")
        if m in sites._COMPILED:
            out.append(f"{name}: sealed as compiled")
        if peek(m) is not None:
            out.append(f"{name}: slimact state {peek(m)}")
    for g in GLOBAL_HOOKS:
        if getattr(module_globals, g, None):
            out.append(f"global {g}")
    st = sites._state
    if st.depth or st.probing or st.tracked or st.blocks:
        out.append(f"router still entered (depth {st.depth}, probing {st.probing})")
    out += [f"router {k}: {getattr(st, k)}" for k in ROUTER_LISTS if getattr(st, k)]
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        out.append("saved-tensor hooks still entered")
    return out


def fingerprint(model: nn.Module) -> list:
    """The model's structure and values: what ``describe`` and ``plan_of`` must not change."""
    types = [(p, type(m)) for p, m in model.named_modules()]
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return [types, values, [id(p) for p in model.parameters()]]


def same(a: list, b: list) -> bool:
    return (
        a[0] == b[0]
        and a[2] == b[2]
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


def tiny(name: str = "llama-tiny") -> nn.Module:
    torch.manual_seed(0)
    return build_model(name)


def ids(model: nn.Module, batch: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x, targets=x).loss.backward()


def boom_after(module: nn.Module, calls: int, exc: type[BaseException] = RuntimeError) -> None:
    """``module`` raises ``exc`` on its call number ``calls`` + 1 and after (its class swapped
    for a subclass: nothing on the instance, so ``leftovers`` does not see it)."""
    seen = [0]

    def forward(self, *args, **kwargs):
        seen[0] += 1
        if seen[0] > calls:
            raise exc("boom")
        return type(self).__mro__[1].forward(self, *args, **kwargs)

    module.__class__ = type(f"Boom{type(module).__name__}", (type(module),), {"forward": forward})


@pytest.fixture(autouse=True)
def _clean_process():
    assert not leftovers(nn.Module()), "an earlier test left global state"
    yield


# --- the meter -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_measure_and_measure_step(name):
    model = tiny(name)
    x = ids(model)
    with slimact.measure(model) as m:
        step(model, x)
    assert m.report.total_bytes > 0 and not leftovers(model)
    slimact.measure_step(model, x)
    assert not leftovers(model)


def test_the_meter_leaves_nothing_when_the_forward_raises():
    model = tiny()
    x = ids(model)
    with pytest.raises(BAD):  # float token ids: the embedding refuses them
        slimact.measure_step(model, x.float())
    assert not leftovers(model)
    boom_after(model.layers[1].mlp, 0)
    with pytest.raises(RuntimeError, match="boom"):
        with slimact.measure(model):
            step(model, x)
    assert not leftovers(model)


def test_compare_leaves_its_models_clean(monkeypatch):
    from slimact import compare as C

    built = []

    def build(*args, **kwargs):
        built.append(build_model(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(C, "build_model", build)
    cfg = C.CompareConfig(model="llama-tiny", strategy="int8", batch=1, seq=16, steps=1,
                          warmup=0, rivals=("recompute",))  # fmt: skip
    C.compare(cfg)
    base, strat, rival = built
    assert not leftovers(base)
    for m in (strat, rival):
        slimact.revert(m)
        assert not leftovers(m)
    model = tiny()
    with pytest.raises(BAD):
        C.measured_step(model, ids(model).float(), ids(model))
    assert not leftovers(model)


# --- the planner's profile: the meter, gradstats' runs, reforms' candidates ----------------


def _profile(model, x):
    from slimact.planner.profile import profile_model

    return profile_model(model, x, codecs=["int8"], repeats=1)


def _calls(model) -> int:
    """How often the profile calls layers[0]'s attention (each phase calls it)."""
    n = [0]
    h = model.layers[0].self_attn.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    try:
        _profile(model, ids(model))
    finally:
        h.remove()
    return n[0]


def test_the_profile_leaves_nothing():
    model = tiny()
    before = fingerprint(model)
    prof = _profile(model, ids(model))
    assert prof.kinds and not leftovers(model) and same(before, fingerprint(model))


def test_the_profile_leaves_nothing_when_any_of_its_runs_raises():
    """The attention raises on its k-th call, for every k the profile reaches: in the metered
    forward, in a module's timing, in a reformulation's or a gradient-error run."""
    n = _calls(tiny())
    assert n > 8
    for k in sorted({0, 1, 2, 3, n // 2, n - 3, n - 2, n - 1}):
        model = tiny()
        boom_after(model.layers[0].self_attn, k)
        with pytest.raises(RuntimeError, match="boom"):
            _profile(model, ids(model))
        assert not leftovers(model), k


# --- the compiled planner's root options -------------------------------------------------


def test_root_options_leave_nothing():
    from slimact.planner.compiled_root import capture_inputs, profile_root

    model = tiny()
    x = ids(model)
    before = fingerprint(model)
    options = profile_root(model, x, x, root_bytes=1, repeats=1)
    assert len(options) > 1 and not leftovers(model) and same(before, fingerprint(model))
    with pytest.raises(BAD):
        capture_inputs(model, x.float(), x, ["lm_head", "norm"])
    assert not leftovers(model)
    boom_after(model.lm_head, 1)  # the head raises after the reforms' probe
    with pytest.raises(RuntimeError, match="boom"):
        profile_root(model, x, x, root_bytes=1, repeats=1)
    assert not leftovers(model)


# --- rank capture, the benchmark's anchors -------------------------------------------------


def test_rank_capture_leaves_nothing():
    from slimact.train.rank import activation_spectra

    model = tiny()
    assert activation_spectra(model, [ids(model)]) and not leftovers(model)
    with pytest.raises(BAD):
        activation_spectra(model, [ids(model).float()])
    assert not leftovers(model) and model.training


@pytest.mark.parametrize("anchor", ["torch-checkpoint", "compile-block", "compile-budget",
                                    "save-on-cpu"])  # fmt: skip
def test_an_anchor_restores_its_model(anchor):
    from slimact.bench.anchors import prepare
    from slimact.compare import _default_forward

    model = tiny()
    x = ids(model)
    prep = prepare(anchor, model, _default_forward, torch.device("cpu"), backend="eager")
    prep.forward(prep.model, x, x).backward()
    with pytest.raises(BAD):
        prep.forward(prep.model, x.float(), x)
    prep.restore()
    assert not leftovers(model)


# --- describe, plan_of, compiled_plan_of: the model untouched ------------------------------


@pytest.mark.parametrize("spec", ["int8", "recompute+invact"])
def test_describe_and_plan_of_leave_the_model_untouched(spec):
    from slimact.strategies.describe import describe

    model = tiny()
    before = fingerprint(model)
    describe(model, spec, ids(model))
    slimact.plan_of(model, spec)
    slimact.compiled_plan_of(model, "compiled-int8")
    assert not leftovers(model) and same(before, fingerprint(model))


def test_plan_of_auto_leaves_the_model_untouched(tmp_path):
    model = tiny()
    x = ids(model)
    before = fingerprint(model)
    slimact.plan_of(model, _auto(tmp_path), example=(x, x))
    assert not leftovers(model) and same(before, fingerprint(model))


# --- apply then revert ---------------------------------------------------------------------


def _auto(tmp_path, budget="25%") -> str:
    return (
        f"auto@{budget},cache={tmp_path},repeats=1,layers=uniform,codecs=int8-asym,"
        "max_rel_err=none,max_grad_err=none"
    )


NEEDS_MORE = {"plan", "compiled-plan", "compiled-auto", "auto"}  # a plan or a budget: below
EAGER = [
    s
    for s in slimact.strategy_names()
    if s not in NEEDS_MORE and "compiled" not in s and not s.startswith("auto@")
]
COLA = {"cola", "cola-m"}  # on a CoLA model
COMPILED = ["compiled-int8", "compiled-prac"]


def _hook_owners(model: nn.Module) -> set[str]:
    """The modules of the functions hooked on ``model`` and its submodules."""
    owners = set()
    for m in model.modules():
        for d in HOOK_DICTS[:1] + HOOK_DICTS[2:3] + HOOK_DICTS[5:]:  # the dicts of functions
            for fn in getattr(m, d, {}).values():
                for attr in ("fn", "func", "__func__"):  # NotCopyable, partial, bound method
                    fn = getattr(fn, attr, fn)
                owners.add(getattr(fn, "__module__", repr(fn)))
    return owners


def _apply_step_revert(model, spec, x, streams=None, **kwargs):
    cuda_only = "offload" in spec  # its code path with CUDA's streams stubbed
    with using_streams(streams) if cuda_only else nullcontext():
        slimact.apply(model, spec, **kwargs)
        step(model, x)
        with slimact.measure(model):
            step(model, x)
    # between steps, what hooks the model lastingly is the runtime's code (test_hooks.RUNTIME)
    assert _hook_owners(model) <= set(RUNTIME), _hook_owners(model)
    slimact.revert(model)
    return leftovers(model)


@pytest.mark.parametrize("spec", EAGER)
def test_apply_then_revert_leaves_nothing(spec, fake_streams):
    model = tiny("cola-tiny" if spec in COLA else "llama-tiny")
    assert _apply_step_revert(model, spec, ids(model), fake_streams) == []


@pytest.mark.parametrize("spec", [*COMPILED, "int8:compile", "invact:compile"])
def test_compiled_apply_then_revert_leaves_nothing(spec):
    model = tiny()
    spec, _, compile_ = spec.partition(":")
    assert _apply_step_revert(model, spec, ids(model), compile=bool(compile_)) == []


def test_auto_apply_then_revert_leaves_nothing(tmp_path):
    """``auto`` plans on its first training forward and checks its budget there (hooks removed
    by revert); the planning step raising first must leave nothing either."""
    model = tiny()
    x = ids(model)
    assert _apply_step_revert(model, _auto(tmp_path), x) == []
    slimact.apply(model, _auto(tmp_path))
    with pytest.raises(BAD):
        step(model, x.float())
    slimact.revert(model)
    assert not leftovers(model)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_the_budget_check_and_the_evolver_leave_nothing_when_a_step_raises(tmp_path, exc):
    """The first-step budget check (``auto``) and the evolver's tracking enter a listener in a
    root pre-hook and leave it in a root post-hook: a step that raises, an interrupt included
    (torch runs ``always_call`` hooks for an ``Exception`` only), must not leave it entered."""
    from slimact.planner.evolve import PlanEvolver

    model = tiny()
    x = ids(model)
    slimact.apply(model, _auto(tmp_path))
    ev = PlanEvolver(model, cap=2, time_codecs=False)
    with torch.no_grad():
        model(x, targets=x)  # (no training step: nothing planned, nothing checked yet)
    boom_after(model.layers[1].mlp, 100, exc)  # after auto's first-step profile
    step(model, x)
    boom_after(model.layers[1].mlp, 0, exc)
    with pytest.raises(exc, match="boom"):
        step(model, x)
    ev.remove()
    slimact.revert(model)
    assert not leftovers(model)


def test_compiled_auto_leaves_nothing_when_its_planning_raises():
    """compiled-auto plans in its pre-hook on the first training forward; a failed planning
    keeps the hook (every training forward raises until revert), which revert removes."""
    spec = "compiled-auto@50%,codecs=none/int8,budgets=1/0,rounds=1,cache=none"
    model = tiny()
    x = ids(model)
    slimact.apply(model, spec)
    boom_after(model.layers[1].mlp, 0)
    with pytest.raises(RuntimeError, match="boom"):
        step(model, x)
    slimact.revert(model)
    assert not leftovers(model)


def test_a_failed_apply_leaves_nothing():
    model = tiny()
    with pytest.raises(ValueError):
        slimact.apply(model, "int8+no-such-strategy")
    assert not leftovers(model)


def test_the_evolver_leaves_nothing_once_removed():
    from slimact.planner.evolve import PlanEvolver

    model = tiny()
    slimact.apply(model, slimact.plan_of(model, "int8"))
    ev = PlanEvolver(model, cap=2, time_codecs=False)
    with pytest.raises(BAD):
        step(model, ids(model).float())
    ev.remove()
    slimact.revert(model)
    assert not leftovers(model)


def test_leftovers_sees_what_it_should():
    model = tiny()
    h = model.layers[0].register_forward_hook(lambda *a: None, always_call=True)
    model.norm.forward = model.norm.forward
    assert len(leftovers(model)) == 3  # the hook (and its always-called entry), the forward
    h.remove()
    del model.norm.forward
    with sites.tracking(model):
        assert leftovers(model)
    assert not leftovers(copy.deepcopy(model))


def router_state() -> list[str]:
    """The router's and autograd's thread state alone (the model's own hooks aside)."""
    return [x for x in leftovers(nn.Module()) if not x.startswith("global")]


@pytest.mark.parametrize("spec", ["int8", "auto"])
def test_the_next_call_closes_what_an_interrupted_call_left_entered(spec, tmp_path):
    """A Ctrl-C inside a training step skips the root's post-hooks (torch runs ``always_call``
    hooks for an ``Exception`` only), leaving the router and the plan's policy entered. The
    model's next call closes them first (``sites.RootCalls``), so its own step ends with the
    thread as a finished step leaves it, and another model trained afterwards, with no slimact,
    stores and differentiates exactly as without the interrupted one."""
    from slimact.planner.evolve import PlanEvolver

    model = tiny()
    x = ids(model)
    slimact.apply(model, _auto(tmp_path) if spec == "auto" else spec)
    ev = PlanEvolver.for_model(model, cap=2, time_codecs=False)
    step(model, x)  # (auto: planned, its budget checked)
    boom_after(model.layers[1].mlp, 0, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        step(model, x)
    assert router_state(), "the interrupt left nothing entered: the test shows nothing"
    model.layers[1].mlp.__class__ = type(model.layers[1].mlp).__mro__[1]  # no longer raises
    step(model, x)
    assert router_state() == []
    other, ref = tiny(), tiny()
    with slimact.measure(other) as m:
        step(other, x)
    step(ref, x)
    assert m.report.total_bytes > 0 and not any(s.action != "keep" for s in m.report.sites)
    for (n, p), q in zip(other.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    if ev is not None:
        ev.remove()
    slimact.revert(model)
    assert not leftovers(model)
