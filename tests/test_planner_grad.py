"""The training-aware quality model: measured gradient errors per codec, and the MILP's cap."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact import sites
from slimact.budget import Budget
from slimact.codecs.build import build_codec
from slimact.codecs.saving import CodecPolicy
from slimact.planner.gradstats import INPUT, MEASURED_REL_ERR
from slimact.planner.milp import (
    DEFAULT_MAX_GRAD_ERR,
    GRAD_CKPT_KEY,
    GRAD_KEY,
    Decision,
    Problem,
    Result,
    brute_force,
)
from slimact.planner.plan import ROOT, Profile
from slimact.planner.profile import PROFILE_FORMAT, profile_key, profile_model
from slimact.planner.solve import make_plan, solve_plan
from slimact.strategies.auto import AutoConfig
from test_planner_milp import synthetic

CODECS = ("int4", "int8", "int4-outlier-g16", "int8-channel", "bits")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, x, profile_model(model, x, codecs=CODECS, repeats=1)


def _block(prof: Profile):
    return next(k for k in prof.kinds if k.kind != ROOT)


def test_profile_records_a_gradient_error_per_lossy_codec(tiny):
    _, _, prof = tiny
    figs = prof.meta[GRAD_KEY]
    block = _block(prof)
    measured = 0
    for s in block.storages:
        lossy = [c for c, st in s.codecs.items() if 0 < st.rel_err <= MEASURED_REL_ERR]
        if not s.sites or not lossy:
            assert str(s.id) not in figs.get(block.kind, {})
            continue
        row = {c: f for c, f in figs[block.kind][str(s.id)].items() if f is not None}
        assert set(row) == set(lossy)  # int4-outlier-g16, the int4 strategy's codec, included
        assert "int4-outlier-g16" in row
        for f in row.values():
            assert INPUT in f and all(0 <= v <= 2 for v in f.values())
        measured += 1
        worst = {c: max(f.values()) for c, f in row.items()}
        assert worst["int8"] < worst["int4"] / 10  # 16x finer steps: a far smaller error
    assert measured >= 8
    down = next(s for s in block.storages if s.name == "mlp.down_proj:linear#0")
    f = figs[block.kind][str(down.id)]["int4"]
    assert max(f, key=f.get) == "mlp.down_proj.weight"  # dW = dY^T x: its own weight suffers
    assert f["mlp.down_proj.weight"] > 1e-3
    head = next(s for s in prof.kinds[-1].storages if s.name == "lm_head:linear#0")
    assert figs[ROOT][str(head.id)]["int4"]["lm_head.weight"] > 1e-3  # the root is measured
    assert prof.meta["grad_s"] > 0 and prof.meta["profile_s"] > 0


def test_a_figure_matches_the_whole_model_with_that_one_codec(tiny):
    """The block run alone with the captured upstream gradient = the real model's backward with
    int4 on layers.0's down_proj input only (llama-tiny: the whole batch is measured)."""
    model, x, prof = tiny
    block = _block(prof)
    down = next(s for s in block.storages if s.name == "mlp.down_proj:linear#0")
    want = prof.meta[GRAD_KEY][block.kind][str(down.id)]["int4"]["mlp.down_proj.weight"]
    site = "layers.0.mlp.down_proj:linear#0"
    w = model.layers[0].mlp.down_proj.weight

    def grad(codec):
        policy = CodecPolicy(lambda s, t: codec if s == site else None)
        with sites.tracking(model), sites.policy(policy):
            loss = model(x, targets=x).loss
        return torch.autograd.grad(loss, [w])[0]

    exact = grad(None)
    seen = {}
    with sites.tracking(model), sites.listening(lambda ev: seen.setdefault(ev.site, ev.tensor)):
        model(x, targets=x)
    lossy = grad(build_codec("int4", seen[site]))
    got = 1 - float(F.cosine_similarity(exact.flatten().double(), lossy.flatten().double(), 0))
    assert got == pytest.approx(want, rel=0.02, abs=1e-7)
    assert all(p.grad is None for p in model.parameters())


def test_recomputing_from_a_lossy_input_is_measured_jointly(tiny):
    """Recomputing the block from an INT4 copy of its input feeds the copy to every save of the
    re-run: far worse than INT4 on the norm's saved input alone (the old blind spot)."""
    _, _, prof = tiny
    block = _block(prof)
    mods = {m.path: m for m in block.modules}
    sid = str(mods[""].inputs[0])
    alone = max(prof.meta[GRAD_KEY][block.kind][sid]["int4"].values())
    joint = prof.meta[GRAD_CKPT_KEY][block.kind][sid]["int4"]
    assert set(joint) == {m.path for m in block.modules if int(sid) in m.inputs}
    assert max(joint[""].values()) > max(1e-3, 10 * alone)
    assert max(joint[""].values()) > max(joint["input_layernorm"].values())  # more re-run
    int8 = prof.meta[GRAD_CKPT_KEY][block.kind][sid]["int8"][""]
    assert max(int8.values()) < max(joint[""].values()) / 10


def test_the_joint_figure_matches_the_plan_runtime(tiny):
    """A plan that recomputes layers.0 from an INT4 copy of its input, applied by the plan
    runtime: layers.0's worst parameter loses what the profile's joint figure says."""
    model, x, prof = tiny
    block = _block(prof)
    sid = next(m for m in block.modules if m.path == "").inputs[0]
    want = prof.meta[GRAD_CKPT_KEY][block.kind][str(sid)]["int4"][""]
    prob = Problem(prof, layers="each", codecs=("int4",), reform=False)
    decisions = [Decision() for _ in prob.groups]
    decisions[0] = Decision(frozenset({""}), frozenset(), {sid: "int4"})
    assert prob.groups[0].blocks == ["layers.0"]
    b, t, q = prob.evaluate(decisions)
    res = Result(decisions, b, t, q, "optimal", 0.0)
    plan = make_plan(prob, res, Budget.parse("100%"), b, 0, b)
    exact = {n: g for n, g in _grads(model, x).items() if n.startswith("layers.0.")}
    planned = copy.deepcopy(model)
    slimact.apply(planned, plan)
    got = _grads(planned, x)
    checked = []
    for name, g in exact.items():
        rel = name.removeprefix("layers.0.")
        if rel in want:
            cos = float(F.cosine_similarity(g.flatten().double(), got[name].flatten().double(), 0))
            checked.append((rel, 1 - cos, want[rel]))
            assert 1 - cos == pytest.approx(want[rel], rel=0.25, abs=2e-5), name
    assert len(checked) >= 7 and max(w for _, _, w in checked) > 1e-3, checked


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x, targets=x).loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def test_profile_format_bumped_so_old_caches_miss(tiny):
    model, x, _ = tiny
    assert PROFILE_FORMAT >= 5 and profile_key(model, x)["format"] == PROFILE_FORMAT


def _with_figures(prof: Profile, seed: int) -> Profile:
    """Give every lossy candidate of the synthetic block a gradient figure on 1-2 parameters."""
    rng = random.Random(seed)
    kind = prof.kinds[0]
    params = ["attn.q.weight", "mlp.down.weight", "norm.weight"]
    figs: dict = {}
    for s in kind.storages:
        if s.sites and s.codecs:
            figs[str(s.id)] = {
                c: {p: rng.uniform(0.5, 3) * (2e-3 if c == "int4" else 1e-4)
                    for p in rng.sample(params, rng.choice((1, 2)))} | {INPUT: 1e-6}
                for c in s.codecs
            }  # fmt: skip
    prof.meta[GRAD_KEY] = {kind.kind: figs}
    ckpt: dict = {}  # recomputing a module from a lossy copy of its input: a bigger error
    for m in kind.modules:
        for sid in m.inputs:
            s = kind.storages[sid]
            for c in s.codecs:
                f = {p: rng.uniform(1, 4) * (2e-3 if c == "int4" else 1e-4) for p in params}
                ckpt.setdefault(str(sid), {}).setdefault(c, {})[m.path] = f
    prof.meta[GRAD_CKPT_KEY] = {kind.kind: ckpt}
    return prof


@pytest.mark.parametrize("seed", range(4))
def test_milp_respects_the_gradient_cap_and_equals_brute_force(seed):
    prof = _with_figures(synthetic(seed), seed)
    capped = Problem(prof, layers="uniform", max_grad_err=3e-3)
    for frac in (0.2, 0.35, 0.6):
        budget = frac * capped.baseline_bytes
        want, _ = brute_force(capped, budget)
        res = capped.solve(budget)
        if want == float("inf"):
            assert res.status == "infeasible"
            continue
        assert res.status == "optimal" and res.bytes <= budget
        assert res.time_s == pytest.approx(want, rel=1e-6, abs=1e-7)
        assert res.grad_err == capped.grad_load(res.decisions) <= 3e-3 + 1e-12


def test_a_codec_feeding_a_recomputation_counts_only_with_it():
    prof = _with_figures(synthetic(1), 1)
    prob = Problem(prof, layers="uniform", max_grad_err=3e-3)
    g = prob.groups[0]
    mlp = next(m for m in g.kind.modules if m.path == "mlp")
    sid = mlp.inputs[0]  # the virtual storage: stored only as mlp's checkpoint input
    codec = {sid: "int4"}
    assert prob.grad_load([Decision(frozenset(), frozenset(), codec), Decision()]) == 0
    with_mlp = Decision(frozenset({"mlp"}), frozenset(), codec)
    want = max(prof.meta[GRAD_CKPT_KEY][g.kind.kind][str(sid)]["int4"]["mlp"].values())
    assert prob.grad_load([with_mlp, Decision()]) == pytest.approx(want)
    prof.meta[GRAD_CKPT_KEY][g.kind.kind][str(sid)]["int4"]["mlp"] = None  # left unmeasured
    prob = Problem(prof, layers="uniform", max_grad_err=3e-3)
    assert prob.grad_load([with_mlp, Decision()]) == float("inf")
    for frac in (0.3, 0.5):
        res = prob.solve(frac * prob.baseline_bytes)
        d = res.decisions[0] if res.decisions else Decision()
        assert not ("mlp" in d.recompute and d.codecs.get(sid) == "int4")


def test_the_cap_binds():
    prof = _with_figures(synthetic(0), 0)
    free, capped = (Problem(prof, layers="uniform", max_grad_err=c) for c in (None, 3e-3))
    budget = 0.35 * free.baseline_bytes
    loose, tight = free.solve(budget), capped.solve(budget)
    assert free.grad_load(loose.decisions) > 3e-3  # the fastest plan breaks the cap ...
    assert tight.grad_err <= 3e-3
    assert tight.time_s > loose.time_s  # injected times: the capped one pays


def test_too_lossy_candidates_are_out_under_a_cap():
    prof = _with_figures(synthetic(0), 0)
    kind = prof.kinds[0]
    s, t = [s for s in kind.storages if s.sites and "int4" in s.codecs][:2]
    prof.meta[GRAD_KEY][kind.kind][str(s.id)]["int4"] = None  # too lossy to be measured
    del prof.meta[GRAD_KEY][kind.kind][str(t.id)]["int4"]  # not measured (time ran out)
    capped = Problem(prof, layers="uniform", max_grad_err=1.0)
    assert "int4" not in capped.groups[0].options[s.id]
    assert "int4" in Problem(prof, layers="uniform").groups[0].options[s.id]
    assert "int4" in capped.groups[0].options[t.id]  # bounded by max_rel_err alone
    virtual = next(s for s in kind.storages if not s.sites)  # only a checkpoint stores it
    assert "int4" in capped.groups[0].options[virtual.id]
    prof.meta.pop(GRAD_KEY)  # a profile without figures (old, or shapes-only): no effect
    assert "int4" in Problem(prof, layers="uniform", max_grad_err=0.0).groups[0].options[s.id]


def test_solve_plan_and_auto_default_to_the_cap(tiny):
    _, _, prof = tiny
    assert AutoConfig(budget="25%").max_grad_err == DEFAULT_MAX_GRAD_ERR
    assert AutoConfig.from_spec("auto@25%,max_grad_err=none").max_grad_err is None
    assert AutoConfig.from_spec("auto@25%,max_grad_err=0.01").max_grad_err == 0.01
    with pytest.raises(ValueError):
        AutoConfig(budget="25%", max_grad_err=-1.0)
    opts = dict(max_rel_err=0.25, recompute=False, reform=False, include_static=False)
    floor = Problem(prof, "ends", None, False, False, 0.25).min_bytes()
    free = solve_plan(prof, floor.bytes, max_grad_err=None, **opts)
    assert dict(free.meta)["grad_err"] > DEFAULT_MAX_GRAD_ERR  # INT4 is what fits there ...
    with pytest.raises(ValueError, match="smallest feasible"):
        solve_plan(prof, floor.bytes, **opts)  # ... and the default cap refuses it
    capped = Problem(prof, "ends", None, False, False, 0.25, DEFAULT_MAX_GRAD_ERR).min_bytes()
    plan = solve_plan(prof, capped.bytes, **opts)
    meta = dict(plan.meta)
    assert meta["max_grad_err"] == DEFAULT_MAX_GRAD_ERR
    assert 0 < meta["grad_err"] <= DEFAULT_MAX_GRAD_ERR
    prob = Problem(prof, "ends", None, False, False, 0.25, DEFAULT_MAX_GRAD_ERR)
    res = prob.solve(capped.bytes)
    for g, d in zip(prob.groups, res.decisions):  # INT4 only where it costs the gradient little
        for sid, c in d.codecs.items():
            assert max(prob.grad_terms(g, sid, c).values(), default=0) <= DEFAULT_MAX_GRAD_ERR
