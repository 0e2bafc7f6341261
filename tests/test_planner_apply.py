"""Applying plans: measured bytes within budget and close to predicted; exact when lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact.compare import CompareConfig, compare
from slimact.planner import Plan, plan_for, runtime_of
from slimact.strategies.auto import AutoConfig

FAST = dict(repeats=1, codecs=("int4", "int8", "int4-channel"))


def batch(b=2, s=64, seed=1):
    tok = torch.randint(0, 257, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return tok[:, :-1], tok[:, 1:]


def step(model, x, y):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(x, targets=y)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return m.report.total_bytes, out.loss.item(), grads


def fresh(name="llama-tiny"):
    torch.manual_seed(0)
    return slimact.build_model(name)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMACT_CACHE_DIR", str(tmp_path / "default-cache"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="module")
def baseline():
    x, y = batch()
    return step(fresh(), x, y)


@pytest.mark.parametrize("budget", ["10%", "25%", "50%"])
def test_measured_within_budget_and_prediction(cache, baseline, budget):
    x, y = batch()
    model = fresh()
    plan = plan_for(model, 2, 64, budget, seed=1, cache=cache, **FAST)
    slimact.apply(model, plan)
    got, loss, grads = step(model, x, y)
    assert got <= plan.budget_bytes
    assert abs(got - plan.predicted_bytes) <= 0.05 * plan.predicted_bytes
    base_bytes, base_loss, base_grads = baseline
    assert plan.baseline_bytes == base_bytes
    assert loss == pytest.approx(base_loss, rel=1e-5)
    cos = min(
        F.cosine_similarity(grads[n].flatten(), g.flatten(), 0) for n, g in base_grads.items()
    )
    assert cos > 0.9


def test_lossless_plan_gives_exact_gradients(tmp_path, baseline):
    x, y = batch()
    model = fresh()
    plan = plan_for(model, 2, 64, "30%", seed=1, cache=None, repeats=1, codecs=("bits",))
    assert not any(lp.codecs for lp in plan.layers)
    assert any(lp.recompute for lp in plan.layers)
    slimact.apply(model, plan)
    got, loss, grads = step(model, x, y)
    assert got <= plan.budget_bytes
    base_bytes, base_loss, base_grads = baseline
    assert loss == pytest.approx(base_loss, rel=1e-6)
    for n, g in base_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6)


def test_lazy_auto_plans_on_the_first_batch_without_polluting_the_meter(tmp_path):
    x, y = batch()
    model = fresh()
    slimact.apply(model, AutoConfig(budget="25%", cache=str(tmp_path), **FAST))
    rt = runtime_of(model)
    assert rt.plan is None
    first, _, _ = step(model, x, y)  # plans inside this measured forward
    assert rt.plan is not None and rt.profile is not None
    second, _, _ = step(model, x, y)
    assert first == second <= rt.plan.budget_bytes
    plan = rt.plan
    assert plan.batch == 2 and plan.seq == 64
    slimact.revert(model)
    assert runtime_of(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert step(model, x, y)[0] == plan.baseline_bytes


def test_compare_auto_25_ratio():
    res = compare(CompareConfig(model="llama-tiny", strategy="auto@25%", batch=2, seq=64))
    assert res["ratio"] <= 0.25


def test_plan_json_roundtrip_applies_identically(tmp_path, cache):
    x, y = batch()
    model = fresh()
    plan = plan_for(model, 2, 64, "25%", seed=1, cache=cache, **FAST)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    a = fresh()
    slimact.apply(a, loaded)
    assert step(a, x, y)[0] <= plan.budget_bytes


def test_gpt2_within_budget():
    x, y = batch(s=32)
    model = fresh("gpt2-tiny")
    plan = plan_for(model, 2, 32, "25%", seed=1, cache=None, **FAST)
    slimact.apply(model, plan)
    got = step(model, x, y)[0]
    assert got <= plan.budget_bytes
    assert abs(got - plan.predicted_bytes) <= 0.05 * plan.predicted_bytes


def test_errors(cache):
    model = fresh()
    with pytest.raises(ValueError, match="needs a memory budget"):
        slimact.apply(model, "auto")
    with pytest.raises(ValueError, match="needs a solved Plan"):
        slimact.apply(model, "plan")
    with pytest.raises(ValueError, match="budget"):
        AutoConfig(budget="lots")
    with pytest.raises(ValueError, match="layers"):
        AutoConfig(budget="25%", layers="some")
    with pytest.raises(ValueError, match="smallest feasible"):
        plan_for(model, 2, 64, "0.5%", seed=1, cache=cache, **FAST)
    plan = plan_for(model, 2, 64, "50%", seed=1, cache=cache, **FAST)
    other = fresh("gpt2-tiny")
    with pytest.raises(ValueError, match="not have|not a module"):
        slimact.apply(other, plan)
    assert str(AutoConfig.from_spec("auto@30%").budget) == "30%"
    assert slimact.strategies.resolve("auto@25%")[0] == AutoConfig(budget="25%")


def test_plan_cli(tmp_path, capsys):
    import argparse
    import json

    from slimact.planner import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    argv = ["--model", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "30%",
            "--codecs", "int4,int8", "--repeats", "1", "--cache", str(tmp_path), "--json",
            "--out", str(tmp_path / "plan.json")]  # fmt: skip
    assert cli.run(p.parse_args(argv)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_bytes"] <= out["budget_bytes"]
    assert 0 < out["solve_time_s"] < 60 and 0 < out["profile_time_s"] < 600
    assert out["site_actions"] and Plan.load(tmp_path / "plan.json").budget == "30%"
    assert cli.run(p.parse_args(argv[:-3])) == 0  # the table; the profile comes from the cache
    assert "predicted added time" in capsys.readouterr().out
