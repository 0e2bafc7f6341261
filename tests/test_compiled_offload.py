"""Offload under compile=True (``compiled/offload.py``): each compiled block keeps only its
input, in host memory, through the offload engine, by an eager wrapper around the compiled
call. On CPU the engine runs with the streams stubbed (``codecs.offload.using_streams``);
blocks compile with the fast test backend (conftest)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import slimact
from slimact.codecs.offload import engine_for, using_streams
from slimact.compiled.blocks import BlockChoice, compile_block, compiled_choice
from slimact.models import build_model

IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def _pair(a: str, b: str):
    torch.manual_seed(0)
    ref = build_model("llama-tiny")
    return slimact.apply(copy.deepcopy(ref), a), slimact.apply(copy.deepcopy(ref), b)


def _step(model):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        loss = model(IDS, targets=IDS).loss
    loss.backward()
    return loss.detach(), m.report


def test_refused_on_cpu_in_one_line_and_choice_rules():
    with pytest.raises(ValueError, match="in host memory already") as e:
        slimact.apply(build_model("llama-tiny"), "offload", compile=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="in host memory already"):
        slimact.apply(build_model("llama-tiny"), "compiled-offload")
    with pytest.raises(ValueError, match=r"valid: BlockChoice\(0, 'none', offload=True\)"):
        BlockChoice(0.5, "none", offload=True)
    with pytest.raises(ValueError, match="takes budget 0 and codec 'none'"):
        BlockChoice(0.0, "int8", offload=True)
    with pytest.raises(ValueError, match="compiled-auto@<budget>,host_budget="):
        slimact.apply(build_model("llama-tiny"), "compiled-offload@0.5")
    c = BlockChoice(0.0, "none", offload=True)
    assert c.label == "recompute/budget=0+offload"
    assert BlockChoice.from_dict(c.to_dict()) == c and c.to_dict()["offload"] is True
    assert BlockChoice.from_dict({"budget": 1.0, "codec": "int8"}) == BlockChoice(1.0, "int8")


def test_exact_against_compiled_recompute_and_host_bytes_metered(fake_streams):
    """The same gradients as the compiled plan without offload (compile's budget-0 partition),
    bit for bit over steps with an optimizer; the block inputs on the host, not the device;
    every buffer back in the pool, none allocated after the first step, one block prefetched
    ahead."""
    with using_streams(fake_streams):
        rec, off = _pair("compiled-recompute", "compiled-offload")
        assert {compiled_choice(b) for b in off.layers} == {BlockChoice(0, "none", True)}
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (rec, off)]
        eng = engine_for(torch.device("cpu"))
        allocated = []
        for _ in range(3):
            (a, mr), (b, mo) = _step(rec), _step(off)
            assert torch.equal(a, b)
            for (name, p), q in zip(rec.named_parameters(), off.parameters()):
                assert torch.equal(p.grad, q.grad), name
            for o in opts:
                o.step()
            allocated.append(eng.pool.allocated)
            assert eng.pool.in_use_bytes == 0
        n = len(off.layers)
        assert allocated == [n] * 3 and eng.fetches == 3 * n and eng.prefetches == 3 * (n - 1)
    held = [s for s in mo.sites if s.op == "checkpoint_input"]
    x_bytes = IDS.numel() * off.config.d_model * 4
    assert [s.site for s in held] == [f"layers.{i}:checkpoint_input#0" for i in range(n)]
    assert {s.action for s in held} == {"offload"} and all(s.bytes == 0 for s in held)
    assert mo.host_bytes == n * x_bytes
    assert mo.total_bytes == mr.total_bytes - n * x_bytes  # compile's budget 0 keeps the input


def test_autograd_grad_sees_the_block_parameters(fake_streams):
    """The parameters are inputs of the wrapper's Function: ``torch.autograd.grad`` returns
    their gradients (the compiled planner measures a block's gradients that way)."""
    torch.manual_seed(0)
    block = build_model("llama-tiny").layers[0]
    x = torch.randn(2, 16, 64, requires_grad=True)
    cos, sin = build_model("llama-tiny").rotary(16, x.dtype)
    ref = compile_block(block, BlockChoice(0.0))
    with using_streams(fake_streams):
        blk = copy.deepcopy(block)
        off = compile_block(blk, BlockChoice(0.0, offload=True))
        g = torch.randn(2, 16, 64)
        want = torch.autograd.grad(ref(x, cos, sin), [x, *block.parameters()], g)
        got = torch.autograd.grad(off(x, cos, sin), [x, *blk.parameters()], g)
    for w, h in zip(want, got):
        assert torch.equal(w, h)
    with torch.no_grad():  # without grad: the compiled call as is, nothing offloaded
        assert torch.equal(off(x, cos, sin), ref(x, cos, sin))


def test_a_block_with_dropout_is_refused():
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    with pytest.raises(ValueError, match="has dropout"):
        compile_block(block, BlockChoice(0.0, offload=True))
    compile_block(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), BlockChoice(0.0, offload=True))


# -- the compiled planner's offload option --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_profile():
    """llama-tiny's compiled profile with the offload option (budgets 1 and 0, no codec), and
    the model it was measured on."""
    from conftest import FakeStreams
    from slimact.planner.compiled import profile_compiled

    torch.manual_seed(0)
    model = build_model("llama-tiny")
    with using_streams(FakeStreams()):
        prof = profile_compiled(model, IDS, IDS, (1.0, 0.0), ("none",), rounds=1, offload=True,
                                root_codecs=(), root_reform=False)  # fmt: skip
    return model, prof


def test_the_offload_option_is_measured_and_charged_by_the_link(tiny_profile):
    from slimact.planner.compiled import OFFLOAD_CHOICE
    from slimact.planner.offload import OffloadOption, stall_s

    model, prof = tiny_profile
    (stats,) = prof.options.values()
    off = next(s for s in stats if s.choice == OFFLOAD_CHOICE)
    rec = next(s for s in stats if s.choice == BlockChoice(0.0))
    x_bytes = IDS.numel() * model.config.d_model * 4
    assert off.bytes == 0 and off.host_bytes == x_bytes == rec.bytes  # the input, moved
    # what is measured is positive; how the link is charged is a function of it (no relation
    # between two measured times is asserted: they move with the machine's load)
    assert off.forward_s > 0 and off.seconds > 0 and off.grad_err < 1e-9
    slow = OffloadOption(x_bytes / (10 * off.forward_s), 2**30)  # copies of 10 forwards
    want = off.seconds + stall_s(10 * off.forward_s, off.forward_s)
    assert off.seconds_with(slow) == pytest.approx(want, rel=1e-12)
    assert off.seconds_with(OffloadOption(1e15, 2**30)) == off.seconds == off.seconds_with(None)


def test_offload_goes_below_the_floor_within_the_host_budget(tiny_profile):
    from slimact.planner.compiled import solve_compiled
    from slimact.planner.offload import OffloadOption

    _, prof = tiny_profile
    n, x_bytes = 2, IDS.numel() * 64 * 4
    floor = min(r.bytes for r in prof.roots()) + n * x_bytes  # budget 0 everywhere
    below = f"{100 * (floor - 1) / prof.baseline_bytes:.6f}%"
    with pytest.raises(ValueError, match="raise the budget"):
        solve_compiled(prof, below, max_grad_err=None)
    plan = solve_compiled(prof, below, None, offload=OffloadOption(1e15, 2**30))
    assert any(c.offload for c in plan.choices.values())
    assert plan.predicted_bytes <= floor - 1 and plan.meta["host_bytes"] > 0
    one = solve_compiled(prof, below, None, offload=OffloadOption(1e15, x_bytes))
    assert sum(c.offload for c in one.choices.values()) == 1  # the host budget: one input
    with pytest.raises(ValueError, match="raise the budget"):
        solve_compiled(prof, below, None, offload=OffloadOption(1e15, x_bytes - 1))
    # a link too slow to hide anything: a budget the others meet takes no offload
    slow = solve_compiled(prof, "60%", None, offload=OffloadOption(1.0, 2**30))
    assert not any(c.offload for c in slow.choices.values())


def test_compiled_auto_with_a_host_budget_runs_its_plan_exactly(tiny_profile, fake_streams):
    """``compiled-auto@<b>,host_budget=...`` below the floor without offload: the plan offloads,
    the meter's device and host bytes are its measured ones, and the gradients are those of
    the same plan with each offload taken back (compile's budget 0), bit for bit."""
    from slimact.compiled.blocks import compile_blocks_with
    from slimact.planner.compiled_root import install_root
    from slimact.state import state_of
    from slimact.strategies.compiled_auto import CompiledAutoConfig, plan_compiled

    ref, prof = tiny_profile
    floor = min(r.bytes for r in prof.roots()) + 2 * IDS.numel() * 64 * 4
    budget = f"{100 * (floor - 1) / prof.baseline_bytes:.6f}%"
    assert CompiledAutoConfig.from_spec("compiled-auto@5%,host_budget=1GiB,link_bw=2e10") == (
        CompiledAutoConfig(budget="5%", host_budget="1GiB", link_bw=2e10)
    )
    with pytest.raises(ValueError, match="bytes of pinned host memory"):
        CompiledAutoConfig(budget="5%", host_budget="50%")
    with using_streams(fake_streams):
        model = copy.deepcopy(ref)
        cfg = CompiledAutoConfig(budget=budget, host_budget="1GiB", link_bw=1e15,
                                 max_grad_err=None)  # fmt: skip
        state_of(model).compiled_plan = None
        plan_compiled(model, cfg, IDS, IDS, profile=prof)
        plan = state_of(model).compiled_plan
        assert any(c.offload for c in plan.choices.values())
        same = copy.deepcopy(ref)
        back = {p: BlockChoice(0.0) if c.offload else c for p, c in plan.choices.items()}
        compile_blocks_with(same, back)
        if plan.root is not None:
            install_root(same, plan.root)
        (a, ma), (b, mb) = _step(model), _step(same)
    assert torch.equal(a, b)
    for (name, p), q in zip(model.named_parameters(), same.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert ma.total_bytes == plan.measured_bytes <= plan.allowed_bytes
    assert ma.host_bytes == plan.meta["measured_host_bytes"] == plan.meta["host_bytes"] > 0
    assert mb.total_bytes == ma.total_bytes + ma.host_bytes
    assert "offloaded to host memory" in plan.summary()


@pytest.mark.gpu
def test_cuda_compiled_offload_exact_against_compiled_recompute():
    """On CUDA with the real streams and pinned buffers: the loss and every parameter's gradient
    of compiled-recompute over 3 SGD steps, to float rounding (the replay compiles the block at
    budget 1, compiled-recompute at budget 0: inductor may fuse them differently), and no pinned
    allocation after the first step."""
    ids = IDS.cuda()
    torch.manual_seed(0)
    ref = build_model("llama-tiny").cuda()
    rec = slimact.apply(copy.deepcopy(ref), "compiled-recompute")
    off = slimact.apply(copy.deepcopy(ref), "compiled-offload")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (rec, off)]
    eng = engine_for(torch.device("cuda", torch.cuda.current_device()))
    allocated = []
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        for _ in range(3):
            losses = []
            for m in (rec, off):
                m.zero_grad(set_to_none=True)
                loss = m(ids, targets=ids).loss
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(rec.named_parameters(), off.parameters()):
                cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0)
                assert cos > 0.99999, (name, float(cos))
            for o in opts:
                o.step()
            allocated.append(eng.pool.allocated)
    assert allocated[1:] == allocated[:1] * 2 and allocated[0] > 0
