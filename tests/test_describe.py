"""strategies/describe: every strategy with a plan form is described by that plan, applied and
measured on one step, in the one action vocabulary (compiled blocks included), its settings
(``Plan.settings``) included; the others are refused, naming what can be described."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

import slimact
from slimact import actions
from slimact.cli import main
from slimact.codecs.offload import using_streams
from slimact.compiled.blocks import BlockChoice
from slimact.planner.compiled import CompiledPlan
from slimact.planner.plan import LayerPlan, Plan, abs_site
from slimact.registry import strategy_names
from slimact.strategies import presets
from slimact.strategies.describe import describe
from slimact.strategies.recompute import RecomputeConfig

# what each needs besides llama-tiny: cola and cola-m a CoLA model; auto* and compiled-* run
# (profile / compile) for tens of seconds: one of each, marked slow
SPECIAL = {"cola-m": "cola-tiny", "cola": "cola-tiny"}
SLOW = {"auto@10%", "auto@50%", "compiled-none", "compiled-int8", "compiled-int4"}
SLOW |= {"compiled-recompute"}
# registered names that carry no budget or plan of their own: described with one (compiled-auto:
# two options per block, one timing round, ~10 s; its choices depend on measured times, so the
# meter check below does not rerun it)
BUDGETED = {
    "auto": "auto@30%,repeats=1",
    "compiled-auto": "compiled-auto@50%,rounds=1,budgets=1/0,codecs=none/int8",
}
SOLVED = ("auto",)  # solved on measured times: the strategy may solve another plan


def _plan() -> Plan:
    """What strategy ``plan`` applies: a solved plan (here by hand: MLPs recomputed, q_proj's
    input through INT8, in llama-tiny's two blocks)."""
    rows = {"recompute": ("mlp",), "codecs": (("int8", ("self_attn.q_proj:linear#0",)),)}
    blocks = tuple(LayerPlan(block=f"layers.{i}", kind="LlamaBlock", **rows) for i in range(2))
    return Plan("llama-tiny", 2, 32, "float32", budget="1GiB", budget_bytes=2**30, layers=blocks)


def _compiled_plan() -> CompiledPlan:
    """What strategy ``compiled-plan`` applies: a solved compiled plan (here by hand: llama-tiny's
    first block INT8 at region budget 0.5, its second compiled as it is)."""
    choices = {"layers.0": BlockChoice(0.5, "int8"), "layers.1": BlockChoice()}
    return CompiledPlan(choices, "", 0, 0, 0.0, 0)


def _model(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return slimact.build_model(name, **overrides)


# compile=True's one-graph lowering of the parts before it (``planner.graph``): no plan of its
# own, described by the spec it compiles (test_graph_is_described_by_what_it_compiles)
NO_PLAN = {"graph"}


def _params():
    for s in strategy_names():
        if s in NO_PLAN:
            continue
        marks = [pytest.mark.slow] if s in SLOW else []
        yield pytest.param(s, marks=marks, id=s)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


ALL = [*_params(), pytest.param("invact+int4", id="invact+int4")]


@pytest.mark.parametrize("name", ALL)
def test_every_strategy_describes_itself_as_a_plan(name, ids, request):
    # offload runs on CUDA only: here its code path with the streams stubbed
    cuda_only = name in ("offload", "compiled-offload")
    with using_streams(request.getfixturevalue("fake_streams")) if cuda_only else nullcontext():
        _describes_itself(name, ids)


def _describes_itself(name, ids):
    model_name = SPECIAL.get(name, "llama-tiny")
    if model_name not in slimact.models.model_names():
        pytest.fail(f"{model_name} is not a registered model")
    by_name = {"plan": _plan, "compiled-plan": _compiled_plan}
    spec = by_name[name]() if name in by_name else BUDGETED.get(name, name)
    model = _model(model_name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = describe(model, spec, ids, name=model_name)
    assert isinstance(plan, Plan)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    acts = plan.site_actions()
    assert acts and {actions.parse(a).kind for a in acts.values()} <= set(actions.KINDS)
    solved = name in SOLVED or name.startswith("auto@")
    # measured: rows add up to the totals
    assert dict(plan.meta)["describes"] == (spec if isinstance(spec, str) else name)
    assert dict(plan.meta)["measured"] is True
    assert sum(lp.predicted_bytes for lp in plan.layers) == plan.predicted_bytes
    assert sum(lp.baseline_bytes for lp in plan.layers) == plan.baseline_bytes
    if name == "compiled-offload":  # its blocks save nothing in their graphs: the input, offloaded
        blocks = [lp for lp in plan.layers if lp.block]
        assert blocks and all(
            lp.kind.endswith("+offload") and lp.predicted_bytes == 0 for lp in blocks
        )
        assert all((":checkpoint_input#0", "offload", 0, 0) in lp.storages for lp in blocks)
    elif name.startswith("compiled-"):
        _check_compiled_rows(plan)
    if not solved and name != "compiled-auto":  # (its choices follow measured times)
        m = slimact.apply(_model(model_name), spec)
        with slimact.measure(m) as meter:
            m(ids, targets=ids).loss.backward()
        assert plan.predicted_bytes == meter.report.total_bytes  # the meter's count, not a guess
    assert Plan.from_dict(plan.to_dict()).site_actions() == acts  # JSON round trip
    assert plan.table()


def _check_compiled_rows(plan: Plan) -> None:
    """Each compiled block: reformulated as a whole, its eager sites 0 bytes, its graphs' saves
    (``:compiled#k``) carrying the bytes, named by the block's codec where it encodes."""
    blocks = [lp for lp in plan.layers if lp.block]
    assert blocks and all(", compiled " in lp.kind for lp in blocks)
    for lp in blocks:
        assert lp.reform_action("") == "reformulate:compiled" and "" in lp.reform
        graph = [(a, after) for n, a, _, after in lp.storages if n.startswith(":compiled#")]
        eager = [(a, after) for n, a, _, after in lp.storages if not n.startswith(":compiled#")]
        assert graph and sum(b for _, b in graph) == lp.predicted_bytes > 0
        assert eager and all(e == ("reformulate:compiled", 0) for e in eager)
        codec = next((p for p in lp.kind.split("+") if "codec:" in p), None)
        coded = {a for a, _ in graph} - {"keep"}
        expect = {codec.split(" ")[-1]} if codec else set()
        if expect == {"codec:compiled-prac"}:  # PRAC codes a tensor only where Z + P is smaller:
            assert coded <= expect  # never at llama-tiny's 64 tokens (n = 64)
        else:
            assert coded == expect, (lp.kind, coded)


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
    with pytest.raises(
        ValueError, match=r"describes what 'int4' does.*slimact.apply\(model, 'int4'\)"
    ):
        slimact.apply(_model("llama-tiny"), plan)


def test_a_rule_plan_is_described_by_its_measured_rows_and_its_rule(ids):
    """``int4`` is a plan of one lazy rule: described by the rows measured on a step (as every
    fixed-rule strategy) and the rule it runs (role -> codec)."""
    plan = describe(_model("llama-tiny"), "invact+int4", ids)
    (rule,) = plan.rules
    assert rule.codec("act") == "int4-outlier-g16" and rule.codec("scores") == "int4-asym/g16"
    acts = plan.site_actions()
    assert acts["layers.0.mlp.down_proj:linear#0"] == "codec:int4-outlier-g16"
    assert acts["layers.0.mlp.act_fn:"] == "reformulate:inv_silu"
    assert "== rule" in plan.table() and "codec:int8-channel" in plan.table()
    assert Plan.from_dict(json.loads(plan.to_json())).rules == plan.rules


def test_a_bad_spec_fails_before_any_work(ids):
    with pytest.raises(ValueError, match="int5"):
        describe(_model("llama-tiny"), "int5", ids)


def _meter_rows(model, ids) -> dict[str, tuple[str, int]]:
    """site -> (action, bytes) the meter reports for one step of ``model``, owners only."""
    with slimact.measure(model) as meter:
        model(ids, targets=ids).loss.backward()
    shared = {s for r in meter.report.sites for s in r.shared_with}
    return {r.site: (r.action, r.bytes) for r in meter.report.sites if r.site not in shared}


def _described_rows(plan: Plan) -> dict[str, tuple[str, int]]:
    rows = [(lp.block, n, a, after) for lp in plan.layers for n, a, _, after in lp.storages]
    return {abs_site(n, block): (a, after) for block, n, a, after in rows}


def test_rows_are_the_meter_under_the_strategys_plan(ids):
    """``recompute+int4``: every site the meter sees under ``apply(model, plan_of(...))`` is a
    row with the meter's action and bytes; the recomputed blocks are the plan's."""
    described = describe(_model("llama-tiny"), "recompute+int4", ids)
    model = _model("llama-tiny")
    plan = presets.plan_of(model, "recompute+int4")
    rows = _described_rows(described)
    measured = _meter_rows(slimact.apply(model, plan), ids)
    assert measured and {s: rows[s] for s in measured} == measured
    assert all(b == 0 for s, (_, b) in rows.items() if s not in measured)
    assert [(lp.block, lp.recompute) for lp in plan.layers] == [
        (lp.block, lp.recompute) for lp in described.layers if lp.recompute
    ]
    assert described.rules == plan.rules


@pytest.mark.parametrize("spec", ["invact+int4", "prac", "chunked-ce", "recompute+int8"])
def test_a_preset_is_described_as_the_meter_sees_the_strategy(spec, ids):
    """The description's actions and bytes are what the meter reports under ``slimact.apply(
    model, spec)`` (``prac`` installs through its own strategy: the same plan)."""
    described = describe(_model("llama-tiny"), spec, ids)
    measured = _meter_rows(slimact.apply(_model("llama-tiny"), spec), ids)
    rows = _described_rows(described)
    assert {s: rows[s] for s in measured} == measured
    assert described.predicted_bytes == sum(b for _, b in measured.values())


def test_prac_fused_norms_are_its_plans_reformulation(ids):
    """PRAC's plan reformulates the RMSNorms (kind ``rms-norm``): the norm's former saves are
    ``reformulate:rms_norm``, read from the plan (the change rows named no such module)."""
    plan = describe(_model("llama-tiny"), "prac", ids)
    acts = plan.site_actions()
    assert acts["layers.0.input_layernorm:"] == "reformulate:rms_norm"
    assert acts["layers.0.input_layernorm:pow#0"] == "reformulate:rms_norm"
    assert plan.layer("layers.0").reform_kinds == (
        ("input_layernorm", "rms-norm"),
        ("post_attention_layernorm", "rms-norm"),
    )


def test_cola_m_is_a_block_reformulation(ids):
    """``cola-m``'s plan reformulates each CoLA block whole: the block's former saves are
    ``reformulate:cola_m`` and nothing is listed as recomputed."""
    plan = describe(_model("cola-tiny"), "cola-m", ids)
    lp = plan.layer("layers.0")
    assert lp.recompute == () and lp.reform == ("",) and lp.reform_kinds == (("", "cola-m"),)
    acts = plan.site_actions()
    assert acts["layers.0:"] == "reformulate:cola_m"
    assert acts["layers.0.mlp.act_fn:silu#0"] == "reformulate:cola_m"


def test_a_compiled_spec_with_an_eager_part_is_described_by_its_one_plan(ids):
    """``invact@ops=none+compiled-int8``: its ``CompiledPlan`` (the eager part, then the
    blocks), measured: compiled blocks as any compiled strategy's, the eager part's final norm
    reformulated in the root, the meter's bytes of the spec itself. One block: each invact
    block compiles a graph of its own, and the rows checked are per block (two compiled blocks
    are described in test_every_strategy_describes_itself_as_a_plan[compiled-*])."""
    spec = "invact@ops=none+compiled-int8"
    plan = describe(_model("llama-tiny", n_layers=1), spec, ids)
    _check_compiled_rows(plan)
    assert plan.site_actions()["norm:"] == "reformulate:inv_rms_norm"
    assert "input_layernorm" in plan.layer("layers.0").reform
    m = slimact.apply(_model("llama-tiny", n_layers=1), spec)
    with slimact.measure(m) as meter:
        m(ids, targets=ids).loss.backward()
    assert plan.predicted_bytes == meter.report.total_bytes


def test_a_plan_is_described_by_its_measured_step(ids):
    """A solved ``Plan`` is applied and measured like any other: its bytes are the meter's,
    not its own prediction."""
    plan = describe(_model("llama-tiny"), _plan(), ids)
    assert dict(plan.meta) == {"describes": "plan", "measured": True}
    measured = _meter_rows(slimact.apply(_model("llama-tiny"), _plan()), ids)
    assert plan.predicted_bytes == sum(b for _, b in measured.values())
    assert plan.layer("layers.1").recompute == ("mlp",)
    assert plan.site_actions()["layers.1.mlp.act_fn:silu#0"] == "recompute"


@pytest.mark.parametrize(
    "spec, model, settings",
    [
        ("cola", "cola-tiny", {}),
        ("cola+int4", "cola-tiny", {}),
        ("cola+cola-m", "cola-tiny", {}),
        ("invact@bf16=exact-near-branch", "llama-tiny", {"invact": "bf16='exact-near-branch'"}),
        ("chunked-ce@256", "llama-tiny", {"chunked-ce": "chunk_size=256"}),
        ("recompute", "llama-tiny", {}),
    ],
)
def test_cola_and_presets_with_settings_are_described(spec, model, settings, ids):
    """``cola`` (the empty plan on a CoLA model, with what it composes), ``invact`` and
    ``chunked-ce`` with other settings than the defaults: described, their settings the plan's,
    their bytes what the meter counts under ``slimact.apply(model, spec)``."""
    described = describe(_model(model), spec, ids)
    measured = _meter_rows(slimact.apply(_model(model), spec), ids)
    rows = _described_rows(described)
    assert {s: rows[s] for s in measured} == measured
    assert described.predicted_bytes == sum(b for _, b in measured.values())
    assert {f for f, _ in described.settings} == set(settings)
    for family, text in settings.items():
        assert f"== settings of {family}: {text}" in described.table()
    assert Plan.from_dict(json.loads(described.to_json())) == described


def test_a_recompute_without_a_preserved_rng_state_is_described(ids):
    spec = RecomputeConfig(preserve_rng_state=False)
    described = describe(_model("llama-tiny"), spec, ids)
    assert described.setting("recompute").preserve_rng_state is False
    assert described.site_actions()["layers.0:"] == "recompute"


@pytest.mark.parametrize(
    "spec, model, named",
    [
        ("auto", "llama-tiny", "'auto' needs a memory budget"),
    ],
)
def test_a_strategy_without_a_plan_form_is_refused(spec, model, named, ids):
    with pytest.raises(ValueError, match="describable are the presets") as err:
        describe(_model(model), spec, ids)
    assert f"describe({spec!r})" in str(err.value) and named in str(err.value)


@pytest.mark.parametrize("spec", ["recompute", "invact+int4", "int4"])
def test_plan_cli_prints_any_strategy(spec, capsys):
    argv = ["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "16", "--strategy", spec]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["meta"]["describes"] == spec and out["site_actions"]
    assert {actions.parse(a).kind for a in out["site_actions"].values()} <= set(actions.KINDS)
    assert main(argv) == 0
    assert f"strategy {spec}: activations measured" in capsys.readouterr().out


def test_plan_cli_refuses_a_strategy_without_a_plan(capsys):
    argv = ["plan", "--model", "llama-tiny", "--batch", "1", "--seq", "8", "--strategy", "auto"]
    assert main(argv) != 0
    assert "describe('auto')" in capsys.readouterr().err


def test_plan_cli_needs_a_budget_or_a_strategy(capsys):
    assert main(["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "16"]) != 0
    assert "exactly one of --budget" in capsys.readouterr().err


def test_graph_is_described_by_what_it_compiles(ids):
    with pytest.raises(ValueError, match="'graph' has no plan form"):
        describe(_model("llama-tiny"), "graph", ids)
