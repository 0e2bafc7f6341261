"""planner/describe: every registered strategy yields a Plan in the one action vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

import slimact
from slimact import actions
from slimact.cli import main
from slimact.planner.describe import describe
from slimact.planner.plan import Plan
from slimact.registry import strategy_names

# what each needs besides llama-tiny: cola/cola-m a CoLA model; plan a solved Plan; auto* and
# compiled-* run (profile / compile) for tens of seconds: one of each, marked slow
SPECIAL = {"cola": "cola-tiny", "cola-m": "cola-tiny"}
SLOW = {"auto@10%", "auto@50%", "compiled-none", "compiled-int8", "compiled-int4"}
SLOW |= {"compiled-recompute"}
# need a Plan object / a budget: the auto@25% case covers the first two; compiled-auto is
# tests/test_planner_compiled.py's
SKIP = {"plan", "auto", "compiled-auto"}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return slimact.build_model(name)


def _params():
    for s in strategy_names():
        if s in SKIP:
            continue
        marks = [pytest.mark.slow] if s in SLOW else []
        yield pytest.param(s, marks=marks, id=s)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("spec", [*_params(), pytest.param("invact+int4", id="invact+int4")])
def test_every_strategy_describes_itself_as_a_plan(spec, ids):
    model_name = SPECIAL.get(spec, "llama-tiny")
    if model_name not in slimact.models.model_names():
        pytest.fail(f"{model_name} is not a registered model")
    model = _model(model_name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = describe(model, spec, ids, name=model_name)
    assert isinstance(plan, Plan)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    acts = plan.site_actions()
    assert acts and {actions.parse(a).kind for a in acts.values()} <= set(actions.KINDS)
    if not spec.startswith(("auto", "compiled-")):  # measured: rows add up to the totals
        assert dict(plan.meta)["describes"] == spec
        assert sum(lp.predicted_bytes for lp in plan.layers) == plan.predicted_bytes
        assert sum(lp.baseline_bytes for lp in plan.layers) == plan.baseline_bytes
    m = slimact.apply(_model(model_name), spec)
    with slimact.measure(m) as meter:
        m(ids, targets=ids).loss.backward()
    if not spec.startswith("auto"):
        assert plan.predicted_bytes == meter.report.total_bytes  # the meter's count, not a guess
    assert Plan.from_dict(plan.to_dict()).site_actions() == acts  # JSON round trip
    assert plan.table()


def test_recompute_rows_and_checkpoint_inputs(ids):
    plan = describe(_model("llama-tiny"), "recompute", ids)
    acts = plan.site_actions()
    assert acts["layers.0:"] == "recompute"
    assert acts["layers.0.mlp.act_fn:silu#0"] == "recompute"
    assert acts["layers.0:checkpoint_input#0"] == "keep"
    assert acts["lm_head:linear#0"] == "keep"


def test_invact_rows_name_the_inverted_op(ids):
    acts = describe(_model("llama-tiny"), "invact", ids).site_actions()
    assert acts["layers.0.mlp.act_fn:"] == "reformulate:inv_silu"
    assert acts["layers.0.mlp.act_fn:silu#0"] == "reformulate:inv_silu"  # no longer saved
    assert acts["layers.0.mlp.act_fn:inv_silu#0"] == "reformulate:inv_silu"  # saved instead
    assert acts["layers.0.input_layernorm:"] == "reformulate:inv_rms_norm"


def test_a_described_plan_is_not_applied(ids):
    plan = describe(_model("llama-tiny"), "int4", ids)
    with pytest.raises(ValueError, match="describes what strategy 'int4' does"):
        slimact.apply(_model("llama-tiny"), plan)


def test_a_bad_spec_fails_before_any_work(ids):
    with pytest.raises(ValueError, match="int5"):
        describe(_model("llama-tiny"), "int5", ids)


@pytest.mark.parametrize("spec", ["recompute", "invact+int4"])
def test_plan_cli_prints_any_strategy(spec, capsys):
    argv = ["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "16", "--strategy", spec]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["meta"]["describes"] == spec and out["site_actions"]
    assert {actions.parse(a).kind for a in out["site_actions"].values()} <= set(actions.KINDS)
    assert main(argv) == 0
    assert f"strategy {spec}: activations measured" in capsys.readouterr().out


def test_plan_cli_needs_a_budget_or_a_strategy(capsys):
    assert main(["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "16"]) != 0
    assert "exactly one of --budget" in capsys.readouterr().err
