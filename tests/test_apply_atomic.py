"""``slimact.apply`` is all-or-nothing, and composition is ``Plan.merge`` (issue 14.7).

A composite apply that fails part-way leaves the model exactly as it was (module attributes,
hooks, state_dict, forward output, ``applied``); parts whose plans conflict (two codec rules on
the same modules, a compiled block and recompute) are refused, naming the modules or sites,
with nothing changed (see ``slimact.registry``'s docstring).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import slimact
from slimact import build_model
from slimact.codecs.offload import using_streams
from slimact.patching import overrides
from slimact.planner.apply import runtime_of
from slimact.registry import (
    AppliedChange,
    StrategyConfig,
    applied_strategies,
    codec_policy_names,
    register_strategy,
    resolve,
    strategy_names,
    unregister_strategies,
)


def _snapshot(model: nn.Module) -> dict:
    """Everything a transform could leave behind: per-module attributes and hooks, the
    state_dict, the forward output, the recorded changes and strategies."""
    torch.manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        out = model(x).logits.clone()
    mods = {}
    for path, m in model.named_modules():
        hooks = {k: list(v) for k, v in m.__dict__.items() if "hooks" in k and isinstance(v, dict)}
        mods[path] = (sorted(m.__dict__), hooks, type(m).__name__)
    return {
        "modules": mods,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "out": out,
        "applied": [(c.path, c.action, c.skipped) for c in slimact.applied(model)],
        "strategies": applied_strategies(model),
    }


def _assert_same(before: dict, after: dict) -> None:
    assert after["modules"] == before["modules"]
    assert after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k
    assert torch.equal(after["out"], before["out"])
    assert after["applied"] == before["applied"]
    assert after["strategies"] == before["strategies"]


@dataclass(frozen=True)
class _BoomConfig(StrategyConfig):
    """A strategy that fails: what any part raising looks like to ``apply``."""

    exc: type = RuntimeError


def _boom(model, config, filter_fn=None):
    raise config.exc("boom: this part failed")


_LOG: list[str] = []


@dataclass(frozen=True)
class _MarkA(StrategyConfig):
    pass


@dataclass(frozen=True)
class _MarkB(StrategyConfig):
    pass


@dataclass(frozen=True)
class _BrokenUndo(StrategyConfig):
    pass


def _mark(model, config, filter_fn=None):
    name = type(config).__name__
    _LOG.append(f"apply {name}")
    return [AppliedChange("", "mark", name, undo=lambda: _LOG.append(f"undo {name}"))]


@pytest.fixture
def test_strategies():
    register_strategy("test-boom", _BoomConfig(), _boom, "fails (tests)")
    register_strategy("test-interrupt", _BoomConfig(KeyboardInterrupt), _boom, "(tests)")
    register_strategy("test-mark-a", _MarkA(), _mark, "(tests)")
    register_strategy("test-mark-b", _MarkB(), _mark, "(tests)")
    _LOG.clear()
    yield
    unregister_strategies({"test-boom", "test-interrupt", "test-mark-a", "test-mark-b"})


def test_failing_composite_leaves_model_untouched():
    """``invact+cola-m`` on a non-CoLA model: cola-m raises after invact patched the model."""
    model = build_model("llama-tiny")
    keys = set(model.__dict__)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="needs a CoLA model"):
        slimact.apply(model, "invact+cola-m")
    assert set(model.__dict__) == keys  # not even an empty change log was added
    _assert_same(before, _snapshot(model))
    copy.deepcopy(model)  # still a plain, copyable model
    slimact.apply(model, "invact")  # and still takes a strategy
    assert slimact.applied(model)


@pytest.mark.usefixtures("test_strategies")
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_any_part_raising_undoes_the_others(exc):
    model = build_model("llama-tiny")
    before = _snapshot(model)
    last = "test-boom" if exc is RuntimeError else "test-interrupt"
    with pytest.raises(exc, match="boom: this part failed"):
        slimact.apply(model, f"invact+recompute+int4+chunked-ce+{last}")
    _assert_same(before, _snapshot(model))
    assert not overrides(model)


@pytest.mark.usefixtures("test_strategies")
def test_undo_runs_newest_first_and_error_is_the_original():
    model = build_model("llama-tiny")
    with pytest.raises(RuntimeError, match="boom") as info:
        slimact.apply(model, "test-mark-a+test-mark-b+test-boom")
    assert _LOG == ["apply _MarkA", "apply _MarkB", "undo _MarkB", "undo _MarkA"]
    assert type(info.value) is RuntimeError


@pytest.mark.usefixtures("test_strategies")
def test_failing_second_apply_keeps_the_first():
    model = slimact.apply(build_model("llama-tiny"), "invact")
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        slimact.apply(model, "recompute+test-boom")
    _assert_same(before, _snapshot(model))
    assert applied_strategies(model) == ["invact"]
    slimact.revert(model)
    assert not slimact.applied(model) and not applied_strategies(model)


@pytest.mark.usefixtures("test_strategies")
def test_failing_undo_is_noted_not_raised():
    """An undo that raises during the roll-back does not hide the original error."""

    def bad_undo():
        raise OSError("undo broke")

    def broken(model, config, filter_fn=None):
        return [AppliedChange("", "mark", "", undo=bad_undo)]

    register_strategy("test-broken-undo", _BrokenUndo(), broken, "(tests)")
    try:
        model = build_model("llama-tiny")
        with pytest.raises(RuntimeError, match="boom") as info:
            slimact.apply(model, "test-mark-a+test-broken-undo+test-boom")
    finally:
        unregister_strategies({"test-broken-undo"})
    assert any("undo broke" in n for n in info.value.__notes__)
    assert _LOG[-1] == "undo _MarkA"  # the roll-back went on past the failing undo


_ROLES = "two rules decide the sites of every module by different roles"
_PLANNED = r"already carries a slimact plan \(rule .* for every module\)"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("int4+prac", _ROLES),
        ("prac+int4", _ROLES),
        ("invact+int8+pac", _ROLES),
        ("int4+auto@25%", _PLANNED),
        ("rac+recompute+int4-plain", _ROLES),
    ],
)
def test_two_codec_policies_rejected(spec, match):
    """Two codec rules on the same modules conflict in the merged plan (or, beside a planner
    that solves every module, at install), named by modules; nothing changes."""
    model = build_model("llama-tiny")
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match) as info:
        slimact.apply(model, spec)
    assert "slimact.revert(model) first" in str(info.value)  # what to do
    _assert_same(before, _snapshot(model))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("int4+int4", "two rules code the sites of every module"),
        ("int4+int8", "the rules give role 'act' two codecs in every module"),
        ("auto@10%+auto@25%", r"already carries a slimact plan \(a planner's"),
    ],
)
def test_duplicates_in_a_spec_rejected(spec, match):
    """Resolving a spec checks its form only; at ``apply`` the parts' plans say whether they
    hold together (two codec rules on one module do not, even the same rule twice)."""
    assert len(resolve(spec)) == 2
    model = build_model("llama-tiny")
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        slimact.apply(model, spec)
    _assert_same(before, _snapshot(model))


@pytest.mark.parametrize("spec", ["recompute+recompute", "invact+invact-act"])
def test_parts_that_agree_merge(spec):
    """Parts whose plans hold together merge: one recompute, the inverted modules' union."""
    one = slimact.apply(build_model("llama-tiny"), spec.split("+")[0])
    both = slimact.apply(build_model("llama-tiny"), spec)
    assert runtime_of(both).plan.layers == runtime_of(one).plan.layers


def _in_block(block: str):
    return lambda m, path: path == block or path.startswith(block + ".")


def test_codec_parts_on_disjoint_modules_merge():
    """``int4`` on block 0, ``int8`` on block 1 (a ``filter_fn`` each): one plan with both rules,
    each coding its own block; on the same block the second is refused naming the module."""
    model = slimact.apply(build_model("llama-tiny"), "int4", _in_block("layers.0"))
    slimact.apply(model, "int8", _in_block("layers.1"))
    assert len(runtime_of(model).plan.rules) == 2
    assert applied_strategies(model) == ["int4", "int8"]
    x = torch.randint(0, 257, (2, 16))
    with slimact.measure(model) as meter:
        model(x, targets=x).loss.backward()
    acts = {s.site: s.action for s in meter.report.sites}
    assert any(a.startswith("codec:int4") for s, a in acts.items() if s.startswith("layers.0."))
    assert not any("int4" in a for s, a in acts.items() if s.startswith("layers.1."))
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"role 'act' two codecs in modules layers\.1"):
        slimact.apply(model, "int4", _in_block("layers.1"))
    _assert_same(before, _snapshot(model))


@pytest.mark.parametrize(
    "first, second, match",
    [
        ("int4", "prac", "by different roles"),
        ("int4", "int4", "two rules code the sites of every module"),
        ("prac", "int8", "by different roles"),
    ],
)
def test_second_apply_follows_the_codec_rule(first, second, match):
    """A second codec rule on the model's modules conflicts with its plan, even the same one
    again: refused, naming the modules and what to do, and nothing changes."""
    model = slimact.apply(build_model("llama-tiny"), f"invact+{first}")
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match) as info:
        slimact.apply(model, f"recompute+{second}")
    assert "every module" in str(info.value) and "slimact.revert(model)" in str(info.value)
    _assert_same(before, _snapshot(model))
    slimact.revert(model)
    slimact.apply(model, second)  # after a revert the other policy applies
    assert applied_strategies(model) == [second]


def test_site_transform_applied_again_is_idempotent():
    """A later call may cover other modules (filter_fn); sites already changed are skipped."""
    model = slimact.apply(build_model("llama-tiny"), "recompute", lambda m, p: p == "layers.0")
    slimact.apply(model, "recompute+int4")
    again = [c for c in slimact.applied(model) if c.action == "recompute"][2:]
    assert [(c.path, c.skipped) for c in again] == [("layers.0", True), ("layers.1", False)]
    assert applied_strategies(model) == ["recompute", "recompute", "int4"]


@pytest.mark.parametrize(
    "spec",
    ["invact+int4", "invact+recompute", "invact+int4+chunked-ce", "recompute+int4", "none+int4"],
)
def test_documented_compositions_apply(spec):
    model = slimact.apply(build_model("llama-tiny"), spec)
    x = torch.randint(0, 257, (2, 16))
    model(x, targets=x).loss.backward()
    assert applied_strategies(model) == spec.split("+")


def _installs_policy(model: nn.Module) -> bool:
    """A policy of its own, or a plan runtime whose plan decides codecs (a lazy plan may): the
    runtime a preset without codecs (``recompute``, ``invact``) installs decides none."""
    rt = runtime_of(model)
    return rt is not None and (
        rt.plan is None
        or bool(rt.plan.rules)
        or any(lp.codecs for lp in rt.plan.layers)
        or "policy" in dict(rt.plan.meta)  # ``install_policy``'s
    )


def test_codec_policy_names_match_what_the_transforms_do():
    """Each strategy's ``codec_policy`` registration fact stays true: exactly the eager
    strategies that install a codec policy say so (a ``compiled-*`` one counts as a codec policy
    for composition, but its codecs are traced hooks inside the compiled blocks)."""
    checked = 0
    for name in strategy_names():
        if name.startswith("test-"):
            continue
        model = build_model("cola-tiny" if name.startswith("cola") else "llama-tiny")
        try:
            slimact.apply(model, name)
        except ValueError:  # 'auto'/'compiled-auto' without a budget, 'plan'/'compiled-plan'
            # without a plan, 'offload' on a CPU (CUDA only)
            assert name.split("@")[0] in (
                "auto",
                "compiled-auto",
                "plan",
                "compiled-plan",
                "offload",
                "compiled-offload",
            ), name
            continue
        if name.startswith("compiled-"):
            continue
        is_codec = name in codec_policy_names()
        assert _installs_policy(model) == is_codec, name
        checked += 1
    assert checked >= 15


_CLASH = r"(recomputes layers\.0, in block layers\.0, which slimact compiled|block 'layers\.0' is recomputed by the model's plan).*slimact\.revert\(model\) first"


@pytest.mark.parametrize(
    "first, second", [("compiled-int8", "recompute"), ("recompute", "compiled-int4")]
)
def test_compiled_blocks_and_checkpointing_are_refused_together(first, second):
    """A compiled block is not recomputed by a plan, nor a recomputed one compiled: refused,
    naming the block, in one spec or across calls, with nothing changed."""
    model = build_model("llama-tiny")
    with pytest.raises(ValueError, match=_CLASH):
        slimact.apply(model, f"{first}+{second}")
    assert applied_strategies(model) == []
    slimact.apply(model, first)
    with pytest.raises(ValueError, match=_CLASH):
        slimact.apply(model, second)  # across calls too
    assert applied_strategies(model) == [first]


@pytest.mark.parametrize("spec", ["offload+compiled-none", "compiled-recompute+offload"])
def test_offload_checkpoints_its_blocks_so_compiled_blocks_are_refused_beside_it(
    spec, fake_streams
):
    """``offload`` recomputes every block, so a compiled strategy beside it is refused naming
    the block (offload on a CPU model through the tests' stand-in streams), nothing changed."""
    model = build_model("llama-tiny")
    with using_streams(fake_streams), pytest.raises(ValueError, match=_CLASH):
        slimact.apply(model, spec)
    assert applied_strategies(model) == []
