"""Adaptive evolution: exponential back-off, drift detection, re-planning within budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import slimact
from slimact.planner import PlanEvolver, backoff_steps, install, profile_model, solve_plan
from slimact.planner.adaptive import is_tracking_step, plan_diff


def test_backoff_schedule():
    assert backoff_steps(8, 40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert backoff_steps(6, 20) == [1, 2, 4, 6, 12, 18]
    assert not is_tracking_step(0, 8) and not is_tracking_step(3, 8)
    with pytest.raises(ValueError, match="cap"):
        backoff_steps(0, 10)


def test_evolver_needs_a_plan():
    with pytest.raises(ValueError, match="no slimact plan"):
        PlanEvolver(slimact.build_model("llama-tiny"))
    assert PlanEvolver.for_model(slimact.build_model("llama-tiny")) is None


def _controlled(prof):
    """Measured bytes, but fixed times: a codec costs 1 ms, a recomputation 50 ms, no invact.

    Byte figures stay measured; fixing the times makes the initial plan encode rather than
    recompute, whatever the machine's load, so the outlier drift must force a change."""
    for kind in prof.kinds:
        for s in kind.storages:
            for c, st in list(s.codecs.items()):
                s.codecs[c] = dataclasses.replace(st, encode_s=5e-4, decode_s=5e-4)
        for m in kind.modules:
            m.recompute_s = 0.05
    return prof


def measured(model, x):
    with slimact.measure(model) as m:
        loss = model(x, targets=x).loss
    loss.backward()
    return m.report.total_bytes


def test_drift_changes_the_plan_and_stays_within_budget(tmp_path):
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    opts = dict(codecs=("int4-outlier",), reform=False, layers="uniform", include_static=False)
    opts["max_grad_err"] = None  # INT4 on llama-tiny costs more than the default gradient cap
    prof = _controlled(profile_model(model, x, codecs=opts["codecs"], repeats=1, reform=False))
    tight = solve_plan(prof, "40%", **opts).predicted_bytes + 1000  # a budget with no slack
    plan = solve_plan(prof, tight, **opts)
    assert any(lp.codecs for lp in plan.layers) and not any(lp.recompute for lp in plan.layers)
    install(model, plan=plan, profile=prof, solve_options=opts)
    ev = PlanEvolver(model, cap=4, time_codecs=False, log_path=tmp_path / "changes.jsonl")
    assert measured(model, x) <= plan.budget_bytes
    assert ev.on_step(1)["applied"] is False  # same data as the profile: no drift
    with torch.no_grad():  # outlier channels appear in every norm's output (adacc.txt Fig. 4)
        for block in model.layers:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.weight[:4] *= 40.0  # 4 of 64 channels: Z-score ~3.9 > 3
        model.norm.weight[:4] *= 40.0
    # step 2 is a tracking step: the evolver samples it. Its first forward stores the new outliers
    # within the codec's bound and counts them on the device; the sites store them exactly (more
    # bytes) from their next save on (codecs.outlier: no sync in a step)
    measured(model, x)
    over = measured(model, x)
    assert over > plan.budget_bytes  # the old plan no longer fits
    event = ev.on_step(2)
    assert event["drift"] > 0.05 and event["applied"] is True
    assert event["changed"] and event["predicted_bytes"] <= plan.budget_bytes
    new = ev.rt.plan
    assert plan_diff(plan, new)
    assert measured(model, x) <= plan.budget_bytes
    assert ev.on_step(3) is None  # not a tracking step
    lines = (tmp_path / "changes.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"applied": true' in lines[1]
