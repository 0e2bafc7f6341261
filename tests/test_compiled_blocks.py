"""slimact.compiled.blocks and .strategies: per-block region budgets x traced codecs, the meter
under compile, and ``apply(..., compile=True)``.

Fast tests need no compile (choices, specs, the spec rewrite); the compiled ones use llama-tiny
at 2 x 64, where one block compiles in a few seconds.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch.nn.functional as F

import slimact
from slimact import compiled as C
from slimact.compiled import blocks as compiled_blocks
from slimact.compiled.blocks import compiled_choice
from slimact.compiled.strategies import CompiledCodecConfig
from slimact.models import build_model
from slimact.registry import (
    add_compile_argument,
    applied_strategies,
    cli_spec,
    compiled_spec,
    resolve,
)

X = torch.randint(0, 257, (2, 65), generator=torch.Generator().manual_seed(3))


# ----------------------------------------------------------------------------- no compile
def test_block_choice_validates_and_labels():
    assert C.BlockChoice().label == "keep"
    assert C.BlockChoice(0.25, "int8").label == "recompute/budget=0.25+codec:compiled-int8"
    assert C.BlockChoice(1, "int4").label == "codec:compiled-int4"
    assert C.BlockChoice(0, "none").budget == 0.0
    for bad in (1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="budget"):
            C.BlockChoice(bad)
    with pytest.raises(ValueError, match="codec must be one of"):
        C.BlockChoice(0.5, "int3")


def test_compiled_strategy_specs():
    (cfg,) = resolve("compiled-int8@0.25")
    assert cfg == CompiledCodecConfig("int8", 0.25) and cfg.choice == C.BlockChoice(0.25, "int8")
    (cfg,) = resolve("compiled-recompute")
    assert cfg.choice == C.BlockChoice(0.0, "none")
    with pytest.raises(ValueError, match="region budget"):
        resolve("compiled-int4@half")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        resolve("compiled-int4@2")


@pytest.mark.parametrize(
    "spec, want",
    [
        ("auto@25%", "compiled-auto@25%"),
        ("none", "compiled-none"),
        ("invact", "invact@ops=none+compiled-none"),  # norms only under compile
        ("invact+int4", "invact@ops=none+compiled-int4"),
        ("invact@bf16=exact-near-branch", "invact@bf16=exact-near-branch,ops=none+compiled-none"),
        ("invact@ops=silu+int8", "invact@ops=silu+compiled-int8"),  # asked for: kept
        ("invact-act", "invact-act+compiled-none"),
        ("int8+recompute", "compiled-int8@0"),
        ("recompute", "compiled-recompute"),
        ("prac", "compiled-prac"),
        ("compiled-int4@0.5", "compiled-int4@0.5"),
    ],
)
def test_compiled_spec(spec, want):
    assert compiled_spec(spec) == want
    resolve(want)  # and it is a valid spec


def test_compiled_spec_reads_registration_facts_not_names():
    """How a spec becomes its compiled form is said by each strategy's registration
    (``compile_args``, its config's ``merges_with_recompute``), so a new strategy gets it too."""
    from slimact.registry import register_strategy, unregister_strategies
    from slimact.strategies.none import NoneConfig

    register_strategy(
        "probe-only", NoneConfig(), lambda m, c, f=None: [], compile_safe=True, compile_args="a=1"
    )
    try:
        assert compiled_spec("probe-only+int8") == "probe-only@a=1+compiled-int8"
        assert compiled_spec("probe-only@b=2") == "probe-only@b=2,a=1+compiled-none"
        assert compiled_spec("probe-only@a=3") == "probe-only@a=3+compiled-none"
    finally:
        unregister_strategies({"probe-only"})
    assert compiled_spec("compiled-int4-outlier+recompute") == "compiled-int4-outlier@0"
    assert compiled_spec("none+recompute") == "compiled-none@0"
    with pytest.raises(ValueError, match="compiled once"):  # PRAC takes no region budget
        compiled_spec("prac+recompute")


@pytest.mark.parametrize(
    "spec, match", [("pac", "has no compiled form"), ("int4+auto@25%", "compiled once")]
)
def test_compiled_spec_refuses(spec, match):
    with pytest.raises(ValueError, match=match):
        compiled_spec(spec)


def test_apply_compile_refuses_an_eager_config():
    model = build_model("llama-tiny")
    with pytest.raises(ValueError, match="compile=True"):
        slimact.apply(model, resolve("int4")[0], compile=True)
    assert slimact.applied(model) == []


# ----------------------------------------------------------------------------- compiled
@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return build_model("llama-tiny")


def _step(model):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        loss = model(X[:, :-1], targets=X[:, 1:]).loss
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    return m.report.total_bytes, grads


@pytest.fixture(scope="module")
def eager(base):
    return _step(copy.deepcopy(base))


@pytest.mark.inductor  # the fast suite's traced codec lowered by inductor itself
def test_meter_sees_inside_compiled_blocks(base, eager):
    """The meter reads compiled regions' saves off the autograd graph: its count equals the
    profiler's (what the forward leaves alive, minus the 4-byte loss and the logits' grad_fn
    bookkeeping, within 2 KiB) and is far from the root-only count a hook-blind meter gives."""
    model = slimact.apply(copy.deepcopy(base), "compiled-int8")
    _step(model)  # compile
    metered, grads = _step(model)
    live, loss = C.forward_live_bytes(lambda: model(X[:, :-1], targets=X[:, 1:]).loss)
    assert abs(live - metered) <= 2048
    assert metered < 0.5 * eager[0]
    assert F.cosine_similarity(grads, eager[1], dim=0) > 0.999


def test_invact_under_compile_inverts_the_norms_and_saves_less():
    """compile=True of 'invact': the inverted norms inside compiled blocks (activations left to
    inductor, which already keeps their inputs only): exact gradients, fewer bytes than
    compiled none, as many as with SiLU inverted too. One block: each invact block compiles a
    graph of its own (its norms are guarded by id), and what is compared is per block; invact
    over several compiled blocks is test_more_patched_blocks_than_dynamos_recompile_limit's."""
    torch.manual_seed(0)
    base = build_model("llama-tiny", n_layers=1)
    eager = _step(copy.deepcopy(base))
    model = slimact.apply(copy.deepcopy(base), compiled_spec("invact"))
    assert applied_strategies(model) == ["invact@ops=none", "compiled-none"]
    both = slimact.apply(copy.deepcopy(base), "invact@ops=silu+compiled-none")
    plain = slimact.apply(copy.deepcopy(base), "compiled-none")
    for m in (model, both, plain):
        _step(m)  # compile
    (b0, g0), (b1, _), (b2, _) = _step(model), _step(both), _step(plain)
    assert b0 < b2 and b0 <= b1
    assert F.cosine_similarity(g0, eager[1], dim=0) > 0.999999


def _fallbacks_and_bytes(model):
    """(eager-fallback warnings, meter bytes, profiler bytes) over two steps and a measure."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model), _step(model)
        metered, _ = _step(model)
        live, _ = C.forward_live_bytes(lambda: model(X[:, :-1], targets=X[:, 1:]).loss)
    n = sum(issubclass(w.category, compiled_blocks.CompileFallbackWarning) for w in caught)
    return n, metered, live


def test_more_patched_blocks_than_dynamos_recompile_limit_stay_compiled():
    """invact's norms carry one patched forward per module, which dynamo guards by id: each
    block needs its own graph, and past dynamo's limit per code object (8 by default) it ran
    them eagerly. With the limit at 1, the second block is past it (two blocks compile two
    graphs where three compiled three, for the same overflow). The meter still matches the
    profiler."""
    torch.manual_seed(0)
    with dynamo_config.patch(recompile_limit=1):
        model = slimact.apply(build_model("llama-tiny"), compiled_spec("invact"))
        n, metered, live = _fallbacks_and_bytes(model)
    assert n == 0 and abs(live - metered) <= 2048


def test_meter_counts_a_block_that_fell_back_to_eager(base):
    """A compiled block that dynamo gave up on runs eagerly: it warns, stores raw (its traced
    codec does not apply), and its saves still reach the meter (the router's hooks are entered
    again inside the codec's), so measured and unmeasured runs store the same."""
    model = slimact.apply(copy.deepcopy(base), "invact@ops=none+compiled-int8")
    with dynamo_config.patch(disable=True):  # every compiled call runs eagerly
        n, metered, live = _fallbacks_and_bytes(model)
    eager, _ = _step(slimact.apply(copy.deepcopy(base), "invact@ops=none"))
    assert n > 0 and abs(live - metered) <= 2048 and metered == eager


@pytest.mark.slow
def test_region_budget_zero_is_exact_and_saves_less(base, eager):
    """compile=True of 'recompute': compile's partitioner at region budget 0. Gradients equal
    exact autograd's; bytes below compile's default partition."""
    model = slimact.apply(copy.deepcopy(base), compiled_spec("recompute"))
    assert slimact.applied(model)[0].detail == "recompute/budget=0"
    default = slimact.apply(copy.deepcopy(base), "compiled-none")
    _step(model), _step(default)
    (b0, g0), (b1, _) = _step(model), _step(default)
    assert b0 < 0.5 * b1 < eager[0]
    assert F.cosine_similarity(g0, eager[1], dim=0) > 0.999999
    slimact.revert(model)
    assert "forward" not in model.layers[0].__dict__


@pytest.mark.slow
def test_budget_and_codec_compose(base, eager):
    """A region budget and a codec together keep fewer bytes than either alone."""
    got = {}
    for spec in ("compiled-int8", "compiled-none@0.25", "compiled-int8@0.25"):
        model = slimact.apply(copy.deepcopy(base), spec)
        _step(model)
        got[spec] = _step(model)
    assert got["compiled-int8@0.25"][0] < min(got["compiled-int8"][0], got["compiled-none@0.25"][0])
    assert F.cosine_similarity(got["compiled-int8@0.25"][1], eager[1], dim=0) > 0.999


def test_cli_spec_and_flag():
    assert cli_spec("auto", "25%", compile=True) == "compiled-auto@25%"
    assert cli_spec("auto", "25%") == "auto@25%"
    assert cli_spec("invact+int8", None, True) == "invact@ops=none+compiled-int8"  # per block
    assert cli_spec("invact+chunked-ce", None, True) == "invact+chunked-ce+graph"  # one graph
    assert compiled_spec("invact+int8") == "invact@ops=none+compiled-int8"  # per block
    p = argparse.ArgumentParser()
    add_compile_argument(p)
    assert p.parse_args(["--compile"]).compile and not p.parse_args([]).compile


def _saved_by_dtype(model, loss) -> dict[torch.dtype, int]:
    seen = {t.untyped_storage().data_ptr() for t in model.parameters()}
    by: dict[torch.dtype, int] = {}
    for t in C.compiled_saved_tensors(loss):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            by[t.dtype] = by.get(t.dtype, 0) + t.untyped_storage().nbytes()
    return by


def test_dropout_masks_inside_compiled_blocks_are_stored_as_bits(monkeypatch):
    """With dropout on, a compiled GPT-2 block saves its dropout masks (and SDPA's attention
    dropout mask) as bool, a byte per value: compiled-none keeps them so; the traced codecs
    pack them 8 to a byte, losslessly: the same step with the masks kept as bool gives
    bitwise the same loss and gradients."""
    monkeypatch.setitem(C.CODECS, "int8-bool-masks", C.CompiledCodec(bits=8, masks=False))
    got = {}
    for codec in ("none", "int8", "int8-bool-masks"):
        torch.manual_seed(0)
        model = build_model("gpt2-tiny", dropout=0.1).train()
        C.compile_blocks_with(model, C.BlockChoice(1.0, codec))
        torch.manual_seed(1)  # inductor draws the masks from the global generator
        loss = model(X[:, :-1], targets=X[:, 1:]).loss
        by = _saved_by_dtype(model, loss)
        loss.backward()
        got[codec] = (by, loss.detach(), [p.grad.clone() for p in model.parameters()])
    masks = got["none"][0][torch.bool]
    assert masks > 0 and got["int8-bool-masks"][0][torch.bool] == masks
    left = got["int8"][0].get(torch.bool, 0)  # masks under min_numel values stay bool
    assert left < masks / 8
    packed = got["int8"][0][torch.uint8] - got["int8-bool-masks"][0][torch.uint8]
    assert packed * 8 == masks - left  # one bit per value
    assert torch.equal(got["int8"][1], got["int8-bool-masks"][1])
    for g, r in zip(got["int8"][2], got["int8-bool-masks"][2]):
        assert torch.equal(g, r)


def test_a_block_that_fails_to_compile_leaves_none_compiled(base):
    """All or nothing within one call: the second block is already compiled under another
    choice (an error), so the first one, compiled just before, is put back as it was."""
    model = copy.deepcopy(base)
    first, second = "layers.0", "layers.1"
    C.compile_blocks_with(model, {second: C.BlockChoice(1.0, "none")})
    with pytest.raises(ValueError, match="already compiled by slimact"):
        C.compile_blocks_with(model, C.BlockChoice(0.0, "none"))
    mods = dict(model.named_modules())
    assert "forward" not in mods[first].__dict__
    assert compiled_choice(mods[second]) == C.BlockChoice(1.0, "none")
