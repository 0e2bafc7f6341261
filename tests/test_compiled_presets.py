"""The compiled strategies as plans (``compiled_plan_of``): applying the ``CompiledPlan`` of a
``compiled-*`` strategy, or of an eager one under ``compile=True``, does what applying the
strategy does: the same choice per block, the same changes, the same saved bytes and action per
site, and bit-identical losses and gradients over two steps; an eager spec's compile-safe eager
parts (``invact``, ``chunked-ce``) are the plan's eager part. Blocks compile with the fast test
backend (conftest); one compiled graph per choice serves both models of a case."""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext

import pytest
import torch

import slimact
from slimact import sites
from slimact.codecs.offload import using_streams
from slimact.compiled.blocks import BlockChoice, compiled_choice
from slimact.compiled.strategies import PRESETS
from slimact.models import build_model
from slimact.planner.apply import runtime_of
from slimact.planner.compiled import CompiledPlan
from slimact.planner.compiled_root import RootOption
from slimact.registry import applied_strategies, compiled_form_of, compiled_spec, strategy_names
from slimact.state import state_of
from slimact.strategies.compiled_presets import CompiledPlanConfig, compiled_plan_of
from slimact.strategies.presets import plan_of

IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
# PRAC codes a tensor only where its subspaces are smaller than it: not at 64 tokens
LONG = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))

# every fixed compiled strategy, a budget and stochastic rounding; every eager strategy with a
# fixed compiled form (compile=True) and the merge of a codec with recompute
COMPILED = [n for n in strategy_names() if n in PRESETS]
COMPILED += ["compiled-int8@0.25", "compiled-int4@sr"]
EAGER = [n for n in strategy_names() if compiled_form_of(n) in PRESETS]
EAGER += ["int8+recompute", "int4@sr"]
# eager specs whose compiled form has compile-safe eager parts before the blocks (plan.eager)
WITH_EAGER = ["invact", "invact+int4", "chunked-ce+int8", "invact-act+recompute"]
OFFLOADING = ("compiled-offload", "offload")  # CUDA only: here with the streams stubbed
# The tests of invact's eager part beside the blocks run llama-tiny with one block: under invact
# each block compiles a graph of its own (its patched norms are guarded by id) and compiled-auto
# profiles a kind's first and last block, so one block halves their compiles. What they test
# (the eager part, the choices, the root's option, one plan on the runtime) is per model; an
# eager part beside two compiled blocks as one plan stays tested by the chunked-ce+int8 case
# (and invact's norms patched in several compiled blocks by test_compiled_blocks.py).
ONE_BLOCK = {"n_layers": 1}


def _step(model, ids=IDS, seed: int = 1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # compiled PRAC draws its random subspaces from torch's generator
    with slimact.measure(model) as m:
        loss = model(ids, targets=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), m.report, grads


def _same_steps(a, b, ids=IDS, steps: int = 2) -> None:
    for _ in range(steps):
        (loss_a, rep_a, grads_a), (loss_b, rep_b, grads_b) = _step(a, ids), _step(b, ids)
        assert torch.equal(loss_a, loss_b)
        assert rep_a.total_bytes == rep_b.total_bytes and rep_a.host_bytes == rep_b.host_bytes
        assert {s.site: s.action for s in rep_a.sites} == {s.site: s.action for s in rep_b.sites}
        assert grads_a.keys() == grads_b.keys() and grads_a
        assert all(torch.equal(g, grads_b[k]) for k, g in grads_a.items()), "gradients differ"


def _rows(model):
    return [(c.path, c.action, c.detail, c.skipped) for c in slimact.applied(model)]


@pytest.mark.parametrize("name", [*COMPILED, *EAGER])
def test_a_compiled_plan_applies_like_its_strategy(name, request):
    eager = not name.startswith("compiled-")
    stubbed = name.split("@")[0] in OFFLOADING
    streams = using_streams(request.getfixturevalue("fake_streams")) if stubbed else nullcontext()
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    plan = compiled_plan_of(base, name)
    assert slimact.applied(base) == [] and "forward" not in base.layers[0].__dict__  # untouched
    blocks = sites.block_paths(base)
    assert list(plan.choices) == blocks and len(set(plan.choices.values())) == 1
    assert plan.root is None  # a fixed strategy keeps the root eager as it is
    assert CompiledPlan.from_dict(json.loads(plan.to_json())) == plan
    with streams:
        per_block = compiled_spec(name) if eager else name  # (compile=True: one graph, exact)
        by_name = slimact.apply(copy.deepcopy(base), per_block)
        by_plan = slimact.apply(copy.deepcopy(base), plan, compile=eager)
        assert applied_strategies(by_plan) == ["compiled-plan"]
        mods = [dict(m.named_modules()) for m in (by_name, by_plan)]
        assert [compiled_choice(mods[0][p]) for p in blocks] == list(plan.choices.values())
        assert [compiled_choice(mods[1][p]) for p in blocks] == list(plan.choices.values())
        assert _rows(by_name) == _rows(by_plan)
        prac = plan.choices[blocks[0]].codec == "prac"
        _same_steps(by_name, by_plan, LONG if prac else IDS)
    if prac:  # the draws are random: another seed, other gradients (the equality is not moot)
        _, _, grads = _step(by_plan, LONG, seed=2)
        _, _, same = _step(by_plan, LONG)
        assert any(not torch.equal(g, same[k]) for k, g in grads.items())
    for m in (by_name, by_plan):  # both revert to the eager blocks
        slimact.revert(m)
        assert "forward" not in m.layers[0].__dict__ and slimact.applied(m) == []


def test_the_uniform_plans_choices():
    model = build_model("llama-tiny")
    n = len(model.layers)
    want = {
        "int8": BlockChoice(1.0, "int8"),
        "compiled-int8@0.25": BlockChoice(0.25, "int8"),
        "int8+recompute": BlockChoice(0.0, "int8"),  # the codec at region budget 0
        "recompute": BlockChoice(0.0),
        "none": BlockChoice(),
        "int4@sr": BlockChoice(1.0, "int4-sr"),
        "compiled-offload": BlockChoice(0.0, "none", offload=True),
        "prac": BlockChoice(1.0, "prac"),
    }
    for spec, choice in want.items():
        plan = compiled_plan_of(model, spec)
        assert list(plan.choices.values()) == [choice] * n, spec
    plan = compiled_plan_of(model, "compiled-int8@0.25,sr")
    assert plan.summary() == f"blocks {n} x recompute/budget=0.25+codec:compiled-int8-sr; root keep"
    assert "allowed" not in plan.table() and plan.meta["strategy"] == "compiled-int8@0.25,sr"
    plan = compiled_plan_of(model, PRESETS["compiled-int6"][0])  # a config
    assert set(plan.choices.values()) == {BlockChoice(1.0, "int6")}
    assert compiled_plan_of(model, plan) is plan and slimact.compiled_plan_of is compiled_plan_of
    assert compiled_plan_of(model, CompiledPlanConfig(plan)) is plan
    written = compiled_plan_of(model, "invact+compiled-int8")  # as written: activations too
    assert written.eager == plan_of(model, "invact") != plan_of(model, "invact@ops=none")
    saved = plan.to_dict()
    del saved["eager"]  # a plan saved before plans had an eager part
    assert plan.eager is None and CompiledPlan.from_dict(saved) == plan


def test_bad_specs_and_plans_are_refused_in_one_line():
    model = build_model("llama-tiny")
    cases = {
        "cola+compiled-none": "needs a CoLA model",  # (on a CoLA model: a preset, one plan)
        "invact+compiled-plan": "a solved CompiledPlan is the whole plan",
        "cola-m": "has no compiled form",
        "compiled-int3": "unknown strategy",
        "compiled-auto": "needs a memory budget",
        "compiled-auto@25%": "solves its plan on a batch; give one",
        "compiled-int8+compiled-int4": "a block is compiled once",
    }
    for spec, match in cases.items():
        with pytest.raises(ValueError, match=match) as e:
            compiled_plan_of(model, spec)
        assert "\n" not in str(e.value), spec
    # an eager part with settings other than the defaults is a preset: its plan states them
    plan = compiled_plan_of(model, "chunked-ce@256+int8")
    assert plan.eager.setting("chunked-ce").chunk_size == 256
    with pytest.raises(ValueError, match="needs a solved CompiledPlan"):
        slimact.apply(model, "compiled-plan")
    other = CompiledPlan({"blocks.0": BlockChoice()}, "", 0, 0, 0.0, 0)
    with pytest.raises(ValueError, match="solved for another model"):
        slimact.apply(model, other)
    clash = compiled_plan_of(model, "chunked-ce+int8")  # the root's codec where the head is chunked
    clash.root = RootOption("int8", 0, sites=("lm_head:linear#0",))
    with pytest.raises(ValueError, match="(?s)do not compose on the plan runtime.*inside lm_head"):
        slimact.apply(model, clash)
    assert runtime_of(model) is None
    offload = compiled_plan_of(model, "compiled-offload")
    with pytest.raises(ValueError, match="in host memory already"):  # on CPU, unstubbed
        slimact.apply(model, offload, compile=True)
    # refused before anything is compiled: the model is as it was
    assert slimact.applied(model) == [] and "forward" not in model.layers[0].__dict__


def test_a_plan_does_not_stack_on_other_compiled_blocks():
    """A block is compiled once: a plan on a model whose blocks a ``compiled-*`` strategy already
    compiled is refused, and a compiled block is not recomputed by an eager plan (each naming
    the block)."""
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), "compiled-none")
    with pytest.raises(ValueError, match=r"'layers\.0' is already compiled by slimact \(keep\)"):
        slimact.apply(model, compiled_plan_of(model, "int8"))
    plan = slimact.apply(build_model("llama-tiny"), compiled_plan_of(model, "int8+recompute"))
    with pytest.raises(ValueError, match=r"recomputes layers\.0, in block layers\.0"):
        slimact.apply(plan, "int4+recompute")
    assert state_of(plan).compiled_plan is None  # compiled-auto's solved plan only


def test_compiled_auto_plan_is_the_plan_it_installs(tmp_path):
    """``compiled_plan_of`` of ``auto@<budget>`` (``compiled-auto`` under compile=True) on the
    batch of the first training forward: the plan the strategy solves there (the same cached
    profile, the same solver), and applied it trains bit for bit as the strategy does."""
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    # 15%: below the leanest blocks with the root kept, so the root takes an option of its own
    spec = f"auto@15%,codecs=none/int8,budgets=1/0,rounds=1,cache={tmp_path}"
    with pytest.raises(ValueError, match="solves its plan on a batch"):
        compiled_plan_of(base, spec)
    plan = compiled_plan_of(base, spec, example=(IDS, IDS))
    assert slimact.applied(base) == [] and "forward" not in base.layers[0].__dict__
    assert list(plan.choices) == sites.block_paths(base) and plan.measured_bytes is not None
    assert plan.root is not None
    by_name = slimact.apply(copy.deepcopy(base), spec, compile=True)
    by_plan = slimact.apply(copy.deepcopy(base), plan)
    assert state_of(by_name).compiled_plan is None  # plans on its first training forward
    _same_steps(by_name, by_plan)
    solved = state_of(by_name).compiled_plan
    assert solved.choices == plan.choices and solved.root == plan.root
    assert solved.measured_bytes == plan.measured_bytes
    assert _rows(by_plan) == _rows(by_name)[1:]  # the strategy's rows, less its head


def test_an_eager_part_beside_the_plan_composes_as_in_the_spec():
    """``chunked-ce+int8`` per block (``compiled_spec``) is the eager part, then the compiled blocks: the
    eager part applied, then ``compiled_plan_of(model, "int8")``, trains the same."""
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    by_name = slimact.apply(copy.deepcopy(base), compiled_spec("chunked-ce+int8"))  # per block
    by_plan = slimact.apply(copy.deepcopy(base), "chunked-ce")
    slimact.apply(by_plan, compiled_plan_of(base, "int8"))
    assert applied_strategies(by_plan) == ["chunked-ce", "compiled-plan"]
    assert _rows(by_name) == _rows(by_plan) and any(r[1] == "chunked-ce" for r in _rows(by_plan))
    _same_steps(by_name, by_plan)


def _reformed(model):
    """(path, action) of every module the model's changes reformulate (not its blocks, heads)."""
    return {
        (c.path, c.action)
        for c in slimact.applied(model)
        if c.path and not c.skipped and c.action != "compile"
    }


@pytest.mark.parametrize("spec", WITH_EAGER)
def test_an_eager_part_is_part_of_the_one_compiled_plan(spec):
    """An eager spec whose compiled form has eager parts (``invact`` -> ``invact@ops=none+
    compiled-none``) is one ``CompiledPlan``: those parts' ``plan_of`` as its eager part, the
    compiled part's choices. Applied, it does what ``apply(..., compile=True)`` does: the same
    modules reformulated, choices, bytes, actions per site and gradients; reverted, the model
    is the eager one again. One block where the eager part patches the norms (ONE_BLOCK)."""
    torch.manual_seed(0)
    base = build_model("llama-tiny", **({} if spec == "chunked-ce+int8" else ONE_BLOCK))
    plan = compiled_plan_of(base, spec)
    assert slimact.applied(base) == [] and runtime_of(base) is None  # untouched
    eager_spec, _, blocks_spec = compiled_spec(spec).rpartition("+")
    assert plan.eager is not None and plan.eager == plan_of(base, eager_spec) and plan.eager.layers
    assert plan.choices == compiled_plan_of(base, blocks_spec).choices and plan.root is None
    assert CompiledPlan.from_dict(json.loads(plan.to_json())) == plan
    assert "; eager " in plan.summary() and "reformulate:" in plan.table()
    by_name = slimact.apply(copy.deepcopy(base), compiled_spec(spec))  # per block, as written
    by_plan = slimact.apply(copy.deepcopy(base), plan)
    assert applied_strategies(by_plan) == ["compiled-plan"]
    blocks = sites.block_paths(base)
    for m in (by_name, by_plan):
        mods = dict(m.named_modules())
        assert [compiled_choice(mods[p]) for p in blocks] == list(plan.choices.values())
    assert _reformed(by_name) == _reformed(by_plan) and _reformed(by_plan)
    _same_steps(by_name, by_plan)
    _, eager_report, eager_grads = _step(base)
    for m in (by_name, by_plan):  # both revert to the eager model, reformulations included
        slimact.revert(m)
        assert slimact.applied(m) == [] and runtime_of(m) is None
        assert "forward" not in m.layers[0].__dict__
        _, report, grads = _step(m)
        assert report.total_bytes == eager_report.total_bytes
        assert all(torch.equal(g, grads[k]) for k, g in eager_grads.items())


def test_the_eager_part_and_the_roots_option_run_as_one_plan():
    """A plan with an eager part and a root option (here the chunked head) installs both as one
    plan on the runtime (``Plan.merge``, before the blocks compile): it trains as the spec that
    has both as eager parts."""
    torch.manual_seed(0)
    base = build_model("llama-tiny", **ONE_BLOCK)
    plan = compiled_plan_of(base, "invact+int8")
    plan.root = RootOption("none", 0, reform=(("lm_head", "chunked-ce"),))
    assert plan.runtime_plan().layer("").reform == ("norm", "lm_head")
    by_plan = slimact.apply(copy.deepcopy(base), plan)
    by_name = slimact.apply(copy.deepcopy(base), compiled_spec("invact+chunked-ce+int8"))
    assert runtime_of(by_plan).plan == plan.runtime_plan()
    assert _reformed(by_name) == _reformed(by_plan)
    _same_steps(by_name, by_plan)
    slimact.revert(by_plan)
    assert runtime_of(by_plan) is None and "forward" not in by_plan.layers[0].__dict__


def test_compiled_auto_after_an_eager_part_is_one_plan(tmp_path):
    """``invact+auto@<budget>`` under compile=True: the plan ``compiled_plan_of`` solves (on a
    copy that carries the eager part, as the strategy plans) is the eager part, the blocks'
    choices and the root's option, the first and last merged on the runtime; applied, it trains bit
    for bit as the strategy does, planning on its first training forward."""
    torch.manual_seed(0)
    base = build_model("llama-tiny", **ONE_BLOCK)
    spec = f"invact+auto@15%,codecs=none/int8,budgets=1/0,rounds=1,cache={tmp_path}"
    plan = compiled_plan_of(base, spec, example=(IDS, IDS))
    assert slimact.applied(base) == [] and runtime_of(base) is None
    # (whether the root takes an option depends on measured times: the merge of the two is
    # test_the_eager_part_and_the_roots_option_run_as_one_plan's, with the option given)
    assert plan.eager == plan_of(base, "invact@ops=none")
    assert CompiledPlan.from_dict(json.loads(plan.to_json())) == plan
    by_name = slimact.apply(copy.deepcopy(base), spec, compile=True)
    by_plan = slimact.apply(copy.deepcopy(base), plan)
    _same_steps(by_name, by_plan)
    solved = state_of(by_name).compiled_plan
    assert solved.choices == plan.choices and solved.root == plan.root
    assert runtime_of(by_plan).plan == plan.runtime_plan()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["invact+int4", "chunked-ce+int8"])
def test_an_eager_part_is_part_of_the_one_compiled_plan_on_cuda(spec):
    """The CUDA half of the test above, under inductor and bf16: the eager part (inverted
    norms, the chunked head) then the compiled blocks, applied by name and as one plan, store the
    same bytes with the same actions and give the same gradients (to a cosine of 0.999: CUDA's
    attention backward in bf16 is not bit-reproducible from run to run)."""
    torch.manual_seed(0)
    base = build_model("llama-tiny").to("cuda", torch.bfloat16)
    plan = compiled_plan_of(base, spec)
    assert plan.eager is not None and plan.eager.layers
    by_name = slimact.apply(copy.deepcopy(base), spec, compile=True)
    by_plan = slimact.apply(copy.deepcopy(base), plan)
    ids = IDS.to("cuda")
    for _ in range(2):
        (_, rep_a, grads_a), (_, rep_b, grads_b) = _step(by_name, ids), _step(by_plan, ids)
        assert rep_a.total_bytes == rep_b.total_bytes
        assert {s.site: s.action for s in rep_a.sites} == {s.site: s.action for s in rep_b.sites}
        assert grads_a.keys() == grads_b.keys() and grads_a
        for k, g in grads_a.items():
            cos = torch.nn.functional.cosine_similarity(
                g.double().flatten(), grads_b[k].double().flatten(), dim=0
            )
            assert cos >= 0.999 or g.abs().max() < 1e-6, (k, float(cos))
