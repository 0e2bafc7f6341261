"""The first-step budget check: measured bytes vs the plan's budget, re-plan or a loud warning."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import slimact
from slimact.planner import install, plan_for, runtime_of
from slimact.planner.adaptive import BudgetCheck, BudgetWarning, budget_check_of
from slimact.strategies.auto import AutoConfig

FAST = dict(repeats=1, codecs=("int4", "int8"), reform=False)


def batch(b=2, s=32, seed=1):
    tok = torch.randint(0, 257, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return tok[:, :-1], tok[:, 1:]


def step(model, x, y, amp=False):
    """One forward+backward (under CPU bf16 autocast if ``amp``); the meter's stored bytes."""
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x, targets=y)
    out.loss.backward()
    return m.report.total_bytes


def fresh():
    torch.manual_seed(0)
    return slimact.build_model("llama-tiny")


@pytest.fixture(autouse=True)
def _setup(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("SLIMACT_CACHE_DIR", str(tmp_path / "default-cache"))


def test_fp32_profile_run_under_bf16_autocast_is_replanned_within_budget(tmp_path):
    x, y = batch()
    base_bf16 = step(fresh(), x, y, amp=True)
    model = fresh()
    cfg = AutoConfig(budget="25%", cache=str(tmp_path), **FAST)
    slimact.apply(model, dataclasses.replace(cfg, batch=2, seq=32))  # profiled + cached in fp32
    check = budget_check_of(model)
    fp32_plan, fp32_cache = runtime_of(model).plan, runtime_of(model).profile.meta["cache"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)  # it re-plans instead of warning
        first = step(model, x, y, amp=True)
        second = step(model, x, y, amp=True)
    # the fp32 plan was solved under other conditions: re-planned whatever it measured
    replan, verify = check.events
    assert replan["action"] == "replan" and "autocast None -> bfloat16" in replan["stale"]
    assert replan["measured_bytes"] == first and replan["changed"]
    assert verify["action"] == "ok" and verify["measured_bytes"] == second
    new = runtime_of(model).plan
    assert new != fp32_plan and dict(new.meta)["autocast"] == "bfloat16"
    assert second <= new.budget_bytes * 1.02 and second <= 0.255 * base_bf16
    assert step(model, x, y, amp=True) == second and len(check.events) == 2  # checked once
    assert runtime_of(model).profile.meta["cache"] != fp32_cache


def test_fp32_cache_entry_is_not_reused_under_bf16_autocast(tmp_path):
    x, y = batch()
    base_bf16 = step(fresh(), x, y, amp=True)
    fp32 = plan_for(fresh(), 2, 32, "25%", seed=1, cache=str(tmp_path), **FAST)  # cached
    lazy = fresh()  # the same weights and shapes, planned lazily under autocast
    slimact.apply(lazy, AutoConfig(budget="25%", cache=str(tmp_path), **FAST))
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        assert step(lazy, x, y, amp=True) <= 0.255 * base_bf16
    prof = runtime_of(lazy).profile
    assert prof.meta["cache_hit"] is False and prof.meta["autocast"] == "bfloat16"
    assert dict(fp32.meta)["autocast"] is None and len(list(tmp_path.glob("*.json"))) == 2
    assert [e["action"] for e in budget_check_of(lazy).events] == ["ok"]


def test_over_budget_first_step_triggers_a_replan(tmp_path):
    x, y = batch(s=32)
    model = fresh()
    slimact.apply(model, AutoConfig(budget="25%", batch=2, seq=8, cache=None, **FAST))
    planned = runtime_of(model).plan
    first = step(model, x, y)  # 4x the tokens the plan was solved for
    event = budget_check_of(model).events[0]
    assert first > planned.budget_bytes * 1.02
    assert event["action"] == "replan" and event["gap_bytes"] == first - planned.budget_bytes
    assert "seq 8 -> 32" in event["stale"]
    second = step(model, x, y)
    assert runtime_of(model).plan.seq == 32 and second <= runtime_of(model).plan.budget_bytes
    assert budget_check_of(model).events[-1]["action"] == "ok"


def test_loaded_plan_over_budget_warns_with_the_gap(tmp_path):
    x, y = batch()
    plan = plan_for(fresh(), 2, 32, "50%", seed=1, cache=None, **FAST)
    tight = dataclasses.replace(plan, budget_bytes=plan.predicted_bytes // 2)
    model = fresh()
    slimact.apply(model, tight)
    with pytest.warns(BudgetWarning) as caught:
        measured = step(model, x, y)
    msg = str(caught[0].message)
    gap = measured - tight.budget_bytes
    assert f"({measured} B)" in msg and f"({tight.budget_bytes} B)" in msg
    assert "'50%'" in msg and "over by" in msg and f"{gap / tight.budget_bytes:+.1%}" in msg
    assert budget_check_of(model).events[0]["action"] == "warn"
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        step(model, x, y)  # the first step only
    slimact.revert(model)
    assert budget_check_of(model) is None and not model._forward_pre_hooks


def test_replan_that_still_misses_warns():
    x, y = batch()
    plan = plan_for(fresh(), 2, 32, "50%", seed=1, cache=None, **FAST)
    tight = dataclasses.replace(plan, budget_bytes=plan.predicted_bytes // 2)
    model = fresh()
    install(model, plan=tight)
    calls = []

    def replanner(ids, tgt):
        calls.append(ids.shape)
        return tight, None

    check = BudgetCheck(model, replanner=replanner)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        step(model, x, y)  # over: re-plan before the next forward, no warning yet
    with pytest.warns(BudgetWarning, match="even after re-planning"):
        step(model, x, y)
    assert calls == [x.shape] and [e["action"] for e in check.events] == ["replan", "warn"]


def test_budget_specs():
    with pytest.raises(ValueError, match=r"budget '25' has no unit: use '25%' of the baseline"):
        slimact.strategies.resolve("auto@25")
    assert str(AutoConfig.from_spec("auto@6GiB").budget) == "6GiB"
    assert AutoConfig.from_spec("auto@1234B").budget.total == 1234
    cfg = AutoConfig.from_spec("auto@25%,codecs=int4/int8,repeats=1,reform=0,cache=none")
    assert cfg == AutoConfig(
        budget="25%", codecs=("int4", "int8"), repeats=1, reform=False, cache=None
    )
    assert AutoConfig(budget=4096).budget.total == 4096  # an int from Python: bytes
    with pytest.raises(ValueError, match="key=value"):
        AutoConfig.from_spec("auto@25%,speed")
    with pytest.raises(ValueError, match="bad value for repeats"):
        AutoConfig.from_spec("auto@25%,repeats=many")


class _Watcher:
    def __init__(self, name, log, fail=False):
        self.name, self.log, self.fail = name, log, fail

    def before(self, args, kwargs):
        self.log.append(f"{self.name}.before")

    def after(self, output):
        self.log.append(f"{self.name}.after")
        if self.fail:
            raise RuntimeError(f"{self.name} failed")


def test_the_budget_check_and_evolver_enter_through_the_runtime_only():
    # one entry on the root: the plan's companions are the runtime's watchers, not hooks
    x, y = batch()
    model = fresh()
    slimact.apply(model, plan_for(fresh(), 2, 32, "50%", seed=1, cache=None, **FAST))
    rt = runtime_of(model)
    roots = (len(model._forward_pre_hooks), len(model._forward_hooks))
    evolver = slimact.planner.adaptive.PlanEvolver(model)
    assert budget_check_of(model) in rt.watchers and evolver in rt.watchers
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == roots == (1, 1)
    log = []
    first, second = _Watcher("first", log, fail=True), _Watcher("second", log)
    undo = [rt.watch(first), rt.watch(second)]
    with pytest.raises(RuntimeError, match="first failed"):
        step(model, x, y)  # the newest watcher is first in, last out; a failing after stops none
    assert log[-2:] == ["first.after", "second.after"]
    assert log[:2] == ["second.before", "first.before"] and len(log) == 4
    undo[0]()
    assert rt.watchers[0] is second
    step(model, x, y)
    assert log[4:] == ["second.before", "second.after"]
    assert budget_check_of(model).events and evolver._measured  # both saw the steps
    undo[1]()
    evolver.remove()
    slimact.revert(model)
    assert not model._forward_pre_hooks and not model._forward_hooks and not rt.watchers
