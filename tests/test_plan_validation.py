"""A plan does what it says, or is refused naming what is wrong (issue 43, items 5, 7, 8).

A ``Plan`` read from JSON is checked against the model at ``apply``: every entry names a real
module or a site the planned model saves (else the error names it and the nearest valid names),
its actions and codecs are known, its budget is a budget; what ``applied()`` reports is what the
runtime codes. ``auto`` on a model that is not a language model is refused at ``apply``. The
messages of a repeated codec policy, a negative ``--budget`` and a damaged checkpoint plan file
name the value and the way out."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import slimact
from slimact.budget import Budget
from slimact.cli import main as slimact_main
from slimact.models import build_model
from slimact.planner.apply import runtime_of
from slimact.planner.plan import Plan
from slimact.registry import applied_strategies, compiled_spec
from slimact.strategies.compiled_presets import compiled_plan_of
from slimact.train.checkpoint import CheckpointError
from slimact.train.resume import COMPILED_PLAN_FILE, PLAN_FILE, restore_planner

pytestmark = pytest.mark.usefixtures("one_thread")

V = 257  # llama-tiny's vocabulary


def _layer(**kw) -> dict:
    row = {"block": "layers.0", "kind": "LlamaBlock", "recompute": [], "reform": []}
    return {**row, "codecs": [], "storages": [], **kw}


def _plan(*layers: dict, **fields) -> Plan:
    """A plan's JSON as a user writes it, read back."""
    return Plan.from_dict(
        json.loads(json.dumps({"model": "llama-tiny", **fields, "layers": layers}))
    )


def _raises(named: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _refused_at_apply(plan: Plan, named: str) -> str:
    """``apply`` refuses ``plan`` naming ``named``, and leaves the model as it was."""
    model = build_model("llama-tiny")
    before = {n: type(m) for n, m in model.named_modules()}
    msg = _raises(named, slimact.apply, model, plan)
    assert runtime_of(model) is None and slimact.applied(model) == []
    assert {n: type(m) for n, m in model.named_modules()} == before
    return msg


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, targets=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# -- #43.5: entries that name nothing of the model ------------------------------------------------


def test_codec_on_a_module_that_does_not_exist():
    plan = _plan(_layer(codecs=[["int8", ["mlp.ghost:linear#0"]]]))
    msg = _refused_at_apply(plan, "'layers.0.mlp.ghost:linear#0'")
    assert "not a module of the model" in msg and "'layers.0.mlp" in msg  # nearest modules


def test_codec_on_an_op_the_module_never_saves():
    plan = _plan(_layer(codecs=[["int8", ["mlp.down_proj:matmul#0"]]]))
    msg = _refused_at_apply(plan, "'layers.0.mlp.down_proj:matmul#0'")
    assert "never saves" in msg and "'layers.0.mlp.down_proj:linear#0'" in msg  # its real site


def test_codec_on_a_name_that_is_no_site():
    plan_d = {"model": "llama-tiny", "layers": [_layer(codecs=[["int8", ["mlp.down_proj"]]])]}
    msg = _raises("'mlp.down_proj'", Plan.from_dict, plan_d)
    assert "<module>:<op>#<k>" in msg


def test_codec_inside_a_recomputed_module():
    plan = _plan(_layer(recompute=["mlp"], codecs=[["int8", ["mlp.down_proj:linear#0"]]]))
    msg = _refused_at_apply(plan, "'layers.0.mlp.down_proj:linear#0'")
    assert "inside layers.0.mlp, which the plan recomputes" in msg
    plan = _plan(_layer(codecs=[["int8", ["mlp:checkpoint_input#0"]]]))  # mlp not recomputed
    _refused_at_apply(plan, "the plan does not recompute 'layers.0.mlp'")
    plan = _plan(_layer(recompute=["mlp"], codecs=[["int8", ["mlp:checkpoint_input#9"]]]))
    msg = _refused_at_apply(plan, "'layers.0.mlp:checkpoint_input#9', which 'layers.0.mlp'")
    assert "'layers.0.mlp:checkpoint_input#0'" in msg  # the input its checkpoint saves


def test_a_storage_listed_with_sharers_a_recomputation_hides():
    """A solved plan lists a storage with every site that saves it: a recomputed block's input
    with its norm's saves of the same tensor, which the recomputation hides; the entry is valid
    (the checkpoint input saves it), an entry of hidden sites alone is not."""
    shared = [":checkpoint_input#0", "input_layernorm:pow#0", "input_layernorm:mul#1"]
    model = build_model("llama-tiny")
    slimact.apply(model, _plan(_layer(recompute=[""], codecs=[["int8", shared]])))
    alone = _plan(_layer(recompute=[""], codecs=[["int8", shared[1:]]]))
    _refused_at_apply(alone, "inside layers.0, which the plan recomputes")


def test_codec_on_a_reformulated_op():
    plan = _plan(_layer(reform=["mlp.act_fn"], codecs=[["int8", ["mlp.act_fn:silu#0"]]]))
    _refused_at_apply(plan, "inside layers.0.mlp.act_fn, which the plan reformulates")


def test_every_bad_site_named_at_once():
    plan = _plan(
        _layer(recompute=["mpl"], codecs=[["int8", ["mlp.ghost:linear#0", "mlp:relu#0"]]]),
        _layer(block="layers.7"),
    )
    msg = _refused_at_apply(plan, "'layers.7'")
    assert "'layers.0.mpl'" in msg and "mlp.ghost" in msg
    plan = _plan(_layer(codecs=[["int8", ["mlp.up_proj:relu#0", "self_attn.q_proj:mul#0"]]]))
    msg = _refused_at_apply(plan, "'layers.0.mlp.up_proj:relu#0'")
    assert "'layers.0.self_attn.q_proj:mul#0'" in msg


@pytest.mark.parametrize("action", ["zap", "codec:int3", "offload+codec:nope"])
def test_unknown_storage_action(action):
    msg = _raises(repr(action), _plan, _layer(storages=[["s0", action, 1, 1]]))
    assert "'s0'" in msg


def test_legacy_storage_actions_still_read():
    plan = _plan(_layer(storages=[["s0", "int8", 1, 1], ["s1", "dropped", 1, 0]]))
    assert plan.site_actions() == {"layers.0.s0": "codec:int8", "layers.0.s1": "recompute"}


@pytest.mark.parametrize("key, field", [("lyaers", "layers"), ("bugdet", "budget")])
def test_misspelled_key(key, field):
    plan_d = {"model": "llama-tiny", key: [_layer(recompute=[""])] if field == "layers" else "25%"}
    _raises(f"did you mean {field!r}", Plan.from_dict, plan_d)


def test_a_budget_with_no_actions_is_refused():
    """A key far from every field is carried beside a plan (``slimact plan --json``'s timings),
    so layers under another name leave a plan of no actions: refused where it has a budget."""
    plan = Plan.from_dict({"model": "llama-tiny", "budget": "25%", "plan_layers": [_layer()]})
    _refused_at_apply(plan, "budget '25%' but no layers and no rules")


def test_unknown_codec_named_before_any_forward():
    msg = _raises("'int3'", _plan, _layer(codecs=[["int3", ["mlp.down_proj:linear#0"]]]))
    assert "layers.0" in msg and "mlp.down_proj:linear#0" in msg and "int8" in msg  # valid


@pytest.mark.parametrize(
    "layer, named",
    [
        (_layer(recompute="mlp"), "got 'mlp'"),
        (_layer(reform="mlp.act_fn"), "got 'mlp.act_fn'"),
        (_layer(codecs=[[5, ["mlp.down_proj:linear#0"]]]), "codec 5"),
        (_layer(codecs=[["int8", "mlp.down_proj:linear#0"]]), "list of sites"),
        (_layer(codecs="int8"), "got 'int8'"),
    ],
)
def test_fields_of_the_wrong_shape(layer, named):
    _raises(named, _plan, layer)


@pytest.mark.parametrize("budget", ["-5%", "0%", "150%", "-2GiB", "0B"])
def test_plan_budget_out_of_range(budget):
    _raises(repr(budget), _plan, _layer(recompute=["mlp"]), budget=budget)


def test_a_valid_hand_written_plan_codes_what_it_names():
    """Codecs on real sites, one of them a recomputed module's input: applied, reported and
    coded as written (the meter's action per site), gradients close to exact autograd."""
    codec_sites = ["mlp.down_proj:linear#0", "self_attn:checkpoint_input#0"]
    layers = [
        _layer(block=b, recompute=["self_attn"], codecs=[["int8", codec_sites]])
        for b in ("layers.0", "layers.1")
    ]
    model = build_model("llama-tiny")
    ref = copy.deepcopy(model)
    slimact.apply(model, _plan(*layers))
    policy = [c for c in slimact.applied(model) if c.action == "codec-policy"]
    assert [c.detail for c in policy] == ["4 site(s) through codecs"]
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    with slimact.measure(model, n_tokens=ids.numel()) as m:
        loss, grads = _step(model, ids)
    coded = {s.site for s in m.report.sites if s.action == "codec:int8"}
    assert coded == {f"layers.{i}.{s}" for i in (0, 1) for s in codec_sites}
    ref_loss, ref_grads = _step(ref, ids)
    assert torch.allclose(loss, ref_loss, rtol=1e-2)
    for n, g in ref_grads.items():
        cos = torch.nn.functional.cosine_similarity(grads[n].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, (n, cos)


# -- #43.7: auto on a model that is not a language model ------------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))


def test_auto_refuses_a_model_that_is_not_a_language_model():
    model = _mlp()
    msg = _raises("Sequential.forward takes no targets", slimact.apply, model, "auto@25%")
    assert "input_ids" in msg and "recompute" in msg
    assert runtime_of(model) is None and slimact.applied(model) == []
    x = torch.ones(2, 8)
    _raises(
        "Sequential.forward takes no targets", slimact.plan_of, _mlp(), "auto@25%", example=(x, x)
    )


def test_a_plan_on_a_model_that_is_not_a_language_model_checks_its_modules():
    root = {"block": "", "kind": "(root)"}
    model = _mlp()  # no token ids to probe its sites with: its modules are still checked
    slimact.apply(model, _plan(_layer(**root, codecs=[["int8", ["0:linear#0"]]])))
    assert runtime_of(model) is not None
    bad = _plan(_layer(**root, codecs=[["int8", ["3:linear#0"]]]))
    _raises("its module '3', which is not a module of the model", slimact.apply, _mlp(), bad)


# -- #43.8: messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["int4", "invact+int8"])
def test_same_codec_policy_twice(spec):
    model = slimact.apply(build_model("llama-tiny"), spec)
    policy = spec.split("+")[-1]
    msg = _raises(
        f"already has codec-policy strategy {policy!r} applied", slimact.apply, model, spec
    )
    assert "is another one" not in msg and "slimact.revert(model) first" in msg
    assert applied_strategies(model) == spec.split("+")


def test_same_plan_twice():
    plan = slimact.plan_of(build_model("llama-tiny"), "invact+int4")
    model = slimact.apply(build_model("llama-tiny"), plan)
    msg = _raises("already has codec-policy strategy 'plan' applied", slimact.apply, model, plan)
    assert "is another one" not in msg and "plan_a + plan_b" in msg


def test_same_codec_policy_again_under_compile():
    """The same spec again under ``compile=True`` is skipped block by block where it only
    compiles (``test_compile_trust``); a codec policy's is refused as any second policy, saying
    it is the one applied already."""
    model = slimact.apply(build_model("llama-tiny"), compiled_spec("int4"))  # per block
    msg = _raises(
        "already has codec-policy strategy 'compiled-int4' applied",
        slimact.apply,
        model,
        compiled_spec("int4"),
    )
    assert "is another one" not in msg and "slimact.revert(model) first" in msg
    assert applied_strategies(model) == ["compiled-int4"]


@pytest.mark.parametrize(
    "kw", [{"share": -0.05}, {"share": 0.0}, {"share": 1.5}, {"total": 0}, {"total": -5}, {}]
)
def test_budget_out_of_range(kw):
    with pytest.raises(ValueError, match="budget 'x'|a share or a total"):
        Budget("x", **kw)


@pytest.mark.parametrize("value, named", [("-5%", "(0, 100]"), ("-2GiB", "> 0")])
def test_negative_budget_flag(capsys, value, named):
    argv = ["plan", "--model", "llama-tiny", "--batch", "1", "--seq", "8", "--budget", value]
    with pytest.raises(SystemExit) as info:
        slimact_main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and repr(value) in err and named in err
    assert "expected one argument" not in err


def test_checkpoint_plan_file_named(tmp_path):
    model = build_model("llama-tiny")
    compiled = compiled_plan_of(model, "compiled-int8").to_dict()
    next(iter(compiled["choices"].values()))["codec"] = "int3"
    ckpt = tmp_path / "ckpt-3"
    ckpt.mkdir()
    (ckpt / COMPILED_PLAN_FILE).write_text(json.dumps(compiled))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / COMPILED_PLAN_FILE))) as info:
        restore_planner(model, ckpt, 3, tmp_path, evolve=False)
    assert "'int3'" in str(info.value)
    assert runtime_of(model) is None


def test_checkpoint_eager_plan_file_named(tmp_path):
    model = slimact.apply(build_model("llama-tiny"), "auto@25%")
    ckpt = tmp_path / "ckpt-3"
    ckpt.mkdir()
    bad = {"model": "llama-tiny", "layers": [_layer(codecs=[["int3", ["mlp.up_proj:linear#0"]]])]}
    (ckpt / PLAN_FILE).write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / PLAN_FILE))) as info:
        restore_planner(model, ckpt, 3, tmp_path, evolve=False)
    assert "'int3'" in str(info.value)
