"""Trust in today's plan features, used as a user would: a ``filter_fn`` written into the plan's
rules (``SiteRule.modules``), the plan's settings (``Plan.settings``), PRAC on the preset path,
a compiled spec's eager part (``CompiledPlan.eager``) and the traced outlier codec's old name.

Each check holds a result against an exact reference: a copy of a model trains bit for bit as
the original (and leaves it alone), a saved plan applied to a fresh model and a resumed training
run repeat the uninterrupted ones, ``apply(spec)`` and ``apply(plan_of(spec))`` agree under
gradient accumulation and autocast, codecs never change a no-grad forward, and what is not a
plan is refused naming the bad value and what is valid."""

from __future__ import annotations

import copy
import gc
import json
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import slimact
from slimact.cli import main
from slimact.models import build_model
from slimact.patching import overrides
from slimact.planner.apply import runtime_of
from slimact.planner.compiled_plan import CompiledPlan
from slimact.planner.plan import Plan, SiteRule
from slimact.planner.settings import InvActSettings, RecomputeSettings
from slimact.sites import block_paths
from slimact.state import state_of
from slimact.strategies.compiled_presets import compiled_plan_of
from slimact.strategies.recompute import RecomputeConfig
from slimact.train import TrainConfig, read_metrics, train
from slimact.train.resume import PLAN_FILE

pytestmark = pytest.mark.usefixtures("one_thread")


def first_block(module, path: str) -> bool:
    """Everything but the second block (``layers.1``, GPT-2's ``h.1``, HF's ``model.layers.1``)."""
    return not path.startswith(("layers.1", "h.1", "model.layers.1"))


def _ids(shape=(2, 32), seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _step(model, ids, seed: int | None = None):
    """One forward+backward: (loss, grads by name)."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    loss = model(ids, targets=ids).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _same(a, b) -> bool:
    """Nested dicts / lists / tensors equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _assert_same_step(one, other) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = one, other
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for k, g in grads_a.items():
        assert torch.equal(g, grads_b[k]), k


def _sgd(model) -> None:  # (torch.optim would import dynamo: slow)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.5)


def _snapshot(model) -> dict:
    st = state_of(model).stateful
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "prac": copy.deepcopy(st["prac"].state_dict()) if "prac" in st else None,
    }


# --- 1. copies ---------------------------------------------------------------------------------

COPIES = [  # (spec, dtype, filter_fn, batch shape)
    ("int4", torch.float32, first_block, (2, 32)),
    ("invact@bf16=exact-near-branch+int4", torch.bfloat16, None, (2, 32)),
    ("chunked-ce@16,precompute+int8", torch.float32, first_block, (2, 32)),
    ("prac", torch.float32, first_block, (2, 128)),
]


@pytest.mark.parametrize(
    ("spec", "dtype", "filter_fn", "shape"),
    COPIES,
    ids=["int4-filtered", "invact-bf16", "chunked-ce", "prac-filtered"],
)
def test_a_copy_trains_as_the_original_and_leaves_it_alone(spec, dtype, filter_fn, shape):
    """``copy.deepcopy`` after ``apply`` (and a first step: PRAC's state, deferred encodes):
    the copy's plan is the original's, settings and rule modules included; over two steps with
    an SGD update the copy's losses and gradients equal the original's bit for bit, and the
    copy's training changes neither the original's weights nor its PRAC state."""
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny", dtype=dtype), spec, filter_fn)
    ids = [_ids(shape, seed=s) for s in range(3)]
    _step(model, ids[0])
    twin = copy.deepcopy(model)
    plan, plan_c = runtime_of(model).plan, runtime_of(twin).plan
    assert plan_c == plan and plan_c.settings == plan.settings and plan_c.rules == plan.rules
    if filter_fn is not None:
        assert all(
            r.modules and not any(p.startswith("layers.1") for p in r.modules) for r in plan_c.rules
        )
    if "bf16=" in spec:  # the copy's inverted activations run with the plan's setting
        assert plan_c.setting("invact") == InvActSettings(bf16="exact-near-branch")
        acts = [m for n, m in twin.named_modules() if n.endswith("act_fn")]
        assert acts and all("exact-near-branch" in o.args for m in acts for o in overrides(m))
    if "prac" in spec:
        assert state_of(twin).stateful["prac"] is not state_of(model).stateful["prac"]
    coded = set()
    for x in ids[1:]:
        before = _snapshot(model)
        with slimact.measure(twin) as meter:
            step_c = twin(x, targets=x).loss
        twin.zero_grad(set_to_none=True)
        step_c.backward()
        step_c = (step_c.detach(), {n: p.grad.clone() for n, p in twin.named_parameters()})
        coded |= {s.site for s in meter.report.sites if s.action.startswith("codec:")}
        _sgd(twin)
        assert _same(_snapshot(model), before), "the copy's step changed the original"
        step_o = _step(model, x)
        _assert_same_step(step_o, step_c)
        _sgd(model)
    assert coded and not any(s.startswith("layers.1") for s in coded if filter_fn is not None)
    assert _same(_snapshot(model), _snapshot(twin))


def test_presets_applied_in_either_order_are_the_one_spec():
    """``apply(m, "recompute")`` then ``apply(m, "invact")`` is ``apply(m, "recompute+invact")``
    (the runtime applies a plan in its one order, whatever the order of the parts): invact's
    probe sees through the checkpoints already applied, so it inverts what it would on the
    plain model; the two train bit for bit alike."""
    base = build_model("llama-tiny")
    twice = slimact.apply(copy.deepcopy(base), "recompute")
    slimact.apply(twice, "invact")
    once = slimact.apply(copy.deepcopy(base), "recompute+invact")
    assert (
        runtime_of(twice).plan == slimact.plan_of(base, "recompute+invact") == runtime_of(once).plan
    )
    x = _ids(seed=0)
    _assert_same_step(_step(twice, x, seed=0), _step(once, x, seed=0))


# --- 2. saved plans and resumed runs ------------------------------------------------------------


def test_a_saved_plan_with_settings_and_rule_modules_trains_the_same():
    """A plan with settings of every family and a rule restricted by a ``filter_fn``, saved to
    JSON and applied to a fresh model, trains bit for bit as the strategies applied to it (a
    spec with the ``filter_fn``, then a config merged into its preset plan), dropout redrawn in the recomputation
    (``preserve_rng_state=False``) as the runtime's checkpoints are told."""
    torch.manual_seed(0)
    base = build_model("gpt2-tiny", dropout=0.1)
    spec = "invact@mode=paper+chunked-ce@16,precompute+int4"
    no_rng = RecomputeConfig(preserve_rng_state=False)
    plan = slimact.plan_of(base, spec, first_block) + slimact.plan_of(base, no_rng)
    assert plan.setting("recompute") == RecomputeSettings(preserve_rng_state=False)
    assert dict(plan.settings).keys() == {"recompute", "invact", "chunked-ce"}
    (rule,) = plan.rules
    assert rule.modules and not any(p.startswith("h.1") for p in rule.modules)
    saved = Plan.from_dict(json.loads(plan.to_json()))
    assert saved == plan
    by_strategy = slimact.apply(copy.deepcopy(base), spec, first_block)
    slimact.apply(by_strategy, no_rng)  # merged into its runtime's plan
    resumed = slimact.apply(copy.deepcopy(base), saved)
    assert runtime_of(by_strategy).plan == plan == runtime_of(resumed).plan
    assert runtime_of(resumed).plan.rules == (rule,)
    blocks = [resumed.get_submodule(p) for p in block_paths(resumed)]
    assert blocks and all(o.args[-1] is False for b in blocks for o in overrides(b))
    for s in range(2):
        x = _ids(seed=s)
        _assert_same_step(_step(by_strategy, x, seed=s), _step(resumed, x, seed=s))
        for m in (by_strategy, resumed):
            _sgd(m)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("".join(f"class Thing{i}:\n    value = {i * 31 % 97}\n\n" for i in range(400)))
    return str(path)


def _train(data, out, **kw):
    base = dict(
        model="llama-tiny", steps=4, batch=2, seq=32, grad_accum=2, eval_every=0, eval_batches=1,
        data=data, out=str(out), progress=False, ckpt_every=0, baseline="off",
    )  # fmt: skip
    return train(TrainConfig(**{**base, **kw}))


@pytest.mark.usefixtures("isolated_cache")
@pytest.mark.parametrize(
    "spec", ["invact@mode=paper+chunked-ce@16,precompute+int4", "invact-act@variant=lsb+prac"]
)
def test_a_resumed_run_with_settings_repeats_the_straight_one(tmp_path, text_file, spec):
    """``slimact train`` with a spec of presets with settings (gradient accumulation 2): four
    steps straight and two, resume, two give the same losses and final weights bit for bit;
    the checkpoint's plan states the settings."""
    straight = _train(text_file, tmp_path / "a", strategy=spec)
    _train(text_file, tmp_path / "b", strategy=spec, stop_at=2)
    resumed = _train(text_file, tmp_path / "b", strategy=spec, resume=True)
    assert resumed.resumed_from == 2
    losses = [[r["loss"] for r in read_metrics(tmp_path / run)] for run in ("a", "b")]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert resumed.final_val_loss == straight.final_val_loss
    saved = Plan.load(tmp_path / "b" / "ckpt-2" / PLAN_FILE)
    assert saved.setting("invact") != InvActSettings()
    assert saved.rules and ("chunked-ce" in dict(saved.settings)) == ("chunked-ce" in spec)
    weights = [(tmp_path / run / "ckpt-4" / "model.safetensors") for run in ("a", "b")]
    if all(w.exists() for w in weights):
        assert weights[0].read_bytes() == weights[1].read_bytes()


# --- 3. gradient accumulation and autocast ------------------------------------------------------

ACCUMULATED = [  # (spec, model, options, batch shape)
    ("invact@bf16=exact-near-branch+chunked-ce@16,precompute+int4", "llama-tiny", {}, (2, 32)),
    ("prac@t1=1", "llama-tiny", {}, (2, 64)),
    (RecomputeConfig(preserve_rng_state=False), "gpt2-tiny", {"dropout": 0.1}, (2, 32)),
]


@pytest.mark.parametrize(
    ("spec", "model_name", "options", "shape"),
    ACCUMULATED,
    ids=["invact-chunked-int4", "prac", "recompute-no-rng"],
)
def test_accumulation_under_autocast_applies_the_plan_as_the_spec(spec, model_name, options, shape):
    """Two micro-batches per step under CPU autocast (bf16): ``apply(model, spec)`` (the preset
    path) and ``apply(model, plan_of(model, spec))`` (the plan strategy's install) give the same
    losses and accumulated gradients bit for bit, over two steps."""
    torch.manual_seed(0)
    base = build_model(model_name, **options)
    plan = slimact.plan_of(base, spec)
    models = [slimact.apply(copy.deepcopy(base), s) for s in (spec, plan)]
    assert runtime_of(models[0]).plan == runtime_of(models[1]).plan == plan
    for step in range(2):
        micro = [_ids(shape, seed=10 * step + k) for k in range(2)]
        out = []
        for m in models:
            m.zero_grad(set_to_none=True)
            losses = []
            for k, x in enumerate(micro):
                torch.manual_seed(100 * step + k)  # dropout: the same draws in both
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(x, targets=x).loss / len(micro)
                loss.backward()
                losses.append(loss.detach())
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            out.append((torch.stack(losses), grads))
        _assert_same_step(*out)
        for m in models:
            _sgd(m)


# --- 4. generate and no-grad forwards on a Hugging Face model -----------------------------------


def _graph_tensors(before: set[int]) -> int:
    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        if id(o) not in before
        and isinstance(o, torch.Tensor)
        and not isinstance(o, FakeTensor)
        and o.grad_fn is not None
    )


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [("int4", torch.float32), ("invact@bf16=exact-near-branch+int4", torch.bfloat16)],
    ids=["int4-filtered", "invact-bf16+int4-filtered"],
)
def test_generate_and_eval_equal_the_unmodified_model(spec, dtype):
    """An HF ``LlamaForCausalLM`` with a ``filter_fn``-restricted plan (and invact's bf16
    setting): after a training step, its no-grad logits and greedy ``generate`` equal the
    unmodified model's bit for bit (codecs act on saved tensors only), and neither a no-grad
    generate nor a grad-enabled eval forward leaves graph tensors alive."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(dtype)
    model = slimact.apply(copy.deepcopy(ref), spec, first_block)
    (rule,) = runtime_of(model).plan.rules
    assert rule.modules and not any(p.startswith("model.layers.1") for p in rule.modules)
    ids = _ids((2, 16), vocab=128)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # a training step: the codecs are built
    model.zero_grad(set_to_none=True)
    model.eval()
    ref.eval()
    mask = torch.ones_like(ids[:, :8])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:, :8], **kw), ref.generate(ids[:, :8], **kw))
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    with torch.no_grad():
        model.generate(ids[:, :8], attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    logits = model(input_ids=ids).logits  # grad enabled, never backpropagated
    assert torch.equal(logits.detach(), ref(input_ids=ids).logits.detach())
    del logits
    assert _graph_tensors(before) == 0


# --- 5. bad input -------------------------------------------------------------------------------

_COMPILED = None


def _compiled_json() -> dict:
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = json.loads(compiled_plan_of(build_model("llama-tiny"), "invact+int4").to_json())
    return copy.deepcopy(_COMPILED)


def _settings(family: str, type_: str, data) -> dict:
    return {"settings": {family: {"_type": type_, "_data": data}}}


BAD = [
    (lambda: SiteRule(codecs=(("act", "int8"),), modules="layers.0"),
     r"SiteRule.modules must be None \(every module\) or a tuple of module paths \(str\), "
     r"got 'layers.0'"),
    (lambda: Plan(settings={"invakt": InvActSettings()}),
     r"no settings family 'invakt'; families: recompute, invact, chunked-ce"),
    (lambda: Plan.from_dict(_settings("invakt", "InvActSettings", {})),
     r"no family 'invakt'; families: recompute, invact, chunked-ce"),
    (lambda: Plan.from_dict(_settings("invact", "InvActSettings", {"tile": 4})),
     r"unknown field\(s\) \['tile'\]; InvActSettings's fields: mode, variant, .*bf16"),
    (lambda: Plan.from_dict(_settings("invact", "InvActSettings", {"bf16": "fast"})),
     r"bf16 must be one of .*exact-near-branch.*got 'fast'"),
    (lambda: Plan.from_dict(_settings("invact", "InvActSettings", ["bf16"])),
     r"plan settings of 'invact': '_data' is an object of fields, got \['bf16'\]"),
    (lambda: Plan.from_dict({"settings": ["invact"]}),
     r"a plan's 'settings' is an object, got \['invact'\]"),
    (lambda: Plan.from_dict({"rules": [{"codecs": [["act", "int8"]], "module": ["layers.0"]}]}),
     r"'rules' entry .*'module'.* is no SiteRule .*its fields: codecs, .*modules"),
    # a typo'd role or codec in a saved rule: refused, not a rule that silently codes nothing
    (lambda: Plan.from_dict({"rules": [{"codecs": [["actt", "int8"]]}]}),
     r"unknown role\(s\) \['actt'\]; its roles are act, qk, qkv, scores, mask"),
    (lambda: SiteRule(codecs=(("act", "int9"),)), r"unknown codec 'int9'.*valid codecs: .*int8"),
    (lambda: SiteRule(codecs=(("linear", "int8"),), roles="prac"),
     r"role 'linear' takes prac, pac or rac, got 'int8'"),
    (lambda: CompiledPlan.from_dict({**_compiled_json(), "eager": "invact"}),
     r"the compiled plan's eager part .*: a plan's JSON is an object of Plan's fields, "
     r"got 'invact'"),
    (lambda: CompiledPlan.from_dict({**_compiled_json(), "eager": {"layers": [{"block": ""}]}}),
     r"eager part .*'layers' entry \{'block': ''\} is no LayerPlan \(KeyError: 'recompute'\); "
     r"its fields: block, kind, recompute"),
    (lambda: CompiledPlan.from_dict({**_compiled_json(), "eager": _settings("invact", "X", {})}),
     r"eager part .*expected \{'_type': 'InvActSettings'"),
    # a misspelt field would be dropped with what it holds: refused, naming the field meant
    (lambda: Plan.from_dict({"setings": _settings("invact", "InvActSettings", {})["settings"]}),
     r"key 'setings', not a field of Plan: did you mean 'settings'\?"),
    (lambda: Plan.from_dict({"rule": [{"codecs": [["act", "int8"]]}]}), r"did you mean 'rules'"),
]  # fmt: skip


def test_keys_a_plan_carries_beside_its_fields_still_load():
    """``slimact plan --json`` adds its timings and profile mode beside the plan's fields: that
    output loads as the plan."""
    plan = Plan(rules=(SiteRule(codecs=(("act", "int8"),)),))
    extra = {"solve_time_s": 0.1, "profile_time_s": None, "profile": {"mode": "full"}}
    assert Plan.from_dict(plan.to_dict() | extra) == plan


@pytest.mark.parametrize(("make", "message"), BAD, ids=range(len(BAD)))
def test_what_is_not_a_plan_is_refused_naming_it(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --- 6. the traced outlier codec's old name, a compiled spec's eager part -----------------------


def test_an_old_compiled_plan_installs_as_today_and_as_its_spec():
    """``chunked-ce@16,precompute`` (an eager part with settings) with ``compiled-int4-outlier``:
    ``apply(spec, compile=True)``, ``apply(compiled_plan_of(spec))`` and the plan's JSON saved
    with the codec's old name ``outlier-int4`` all train bit for bit alike; the old JSON reads
    as today's plan, its eager part's settings with it."""
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    spec = "chunked-ce@16,precompute+compiled-int4-outlier"
    plan = compiled_plan_of(base, spec)
    assert {c.codec for c in plan.choices.values()} == {"int4-outlier"}
    assert dict(plan.eager.settings)["chunked-ce"].chunk_size == 16
    text = plan.to_json()
    old_text = re.sub(r'"codec": "int4-outlier"', '"codec": "outlier-int4"', text)
    assert old_text != text and '"outlier-int4"' in old_text
    old = CompiledPlan.from_dict(json.loads(old_text))
    assert old == plan
    models = [
        slimact.apply(copy.deepcopy(base), spec, compile=True),
        slimact.apply(copy.deepcopy(base), plan),
        slimact.apply(copy.deepcopy(base), old),
    ]
    for s in range(2):
        steps = [_step(m, _ids(seed=s)) for m in models]
        for other in steps[1:]:
            _assert_same_step(steps[0], other)
    for m in models[1:]:  # the plan's eager part on the runtime, with its settings
        assert runtime_of(m).plan.setting("chunked-ce").chunk_size == 16
    # (the spec applies its eager part by the strategy's own transform, its head row saying so)
    assert "chunk 16" in next(c.detail for c in slimact.applied(models[0]) if c.path == "lm_head")


# --- 7. the CLI ---------------------------------------------------------------------------------


def test_plan_strategy_cli_describes_a_plan_with_settings(capsys, tmp_path):
    """``slimact plan --strategy "invact@bf16=exact-near-branch+int4"`` on a bf16 llama-tiny:
    the table of the plan applied and measured, its settings row, and (``--out``) a plan that
    states the setting; the setting changes what the inverted SiLU saves (a byte per value for
    the exact near-branch, a bit without it)."""
    argv = ["plan", "--model", "llama-tiny", "--batch", "2", "--seq", "16", "--dtype", "bfloat16"]
    spec = "invact@bf16=exact-near-branch+int4"
    out = tmp_path / "plan.json"
    assert main([*argv, "--strategy", spec, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "== settings of invact: bf16='exact-near-branch'" in table
    assert f"strategy {spec}: activations measured" in table
    assert re.search(r"mlp:mul#0\s+codec:int4-outlier-g16", table)
    saved = Plan.load(out)
    assert saved.setting("invact") == InvActSettings(bf16="exact-near-branch")
    assert dict(saved.meta)["describes"] == spec
    assert main([*argv, "--strategy", "invact+int4"]) == 0
    plain = capsys.readouterr().out
    assert "== settings of" not in plain

    def silu_mask(text: str) -> str:
        return re.search(r"mlp\.act_fn:inv_silu#1\s+\S+\s+\S+ B\s+(\S+ \S*B)", text).group(1)

    assert (silu_mask(table), silu_mask(plain)) == ("5.38 KiB", "688 B")
