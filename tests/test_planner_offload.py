"""Offload in the planner: the MILP against brute force with the offload option, the host
budget, the stall model, refusal on CPU, and a solved plan that offloads run exactly (streams
stubbed on CPU)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import slimact
from slimact.budget import BudgetWarning
from slimact.codecs.offload import using_streams
from slimact.planner.auto import AutoConfig
from slimact.planner.milp import Decision, Problem, brute_force
from slimact.planner.offload import OFFLOAD, OffloadOption, link_bandwidth, parse_host_budget
from slimact.planner.profile import profile_model
from slimact.planner.solve import solve_plan
from test_planner_milp import synthetic


def _small(seed: int):
    prof = synthetic(seed)
    kind = prof.kinds[0]
    kind.storages = kind.storages[:4]
    kind.modules = [m for m in kind.modules if m.path in ("", "attn", "norm")]
    kind.reforms = kind.reforms[:1]
    prof.device = "cuda:0"
    return prof


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bw, host", [(1e6, 10**7), (3e5, 10**7), (1e6, 3 * 10**6)])
def test_milp_with_offload_equals_brute_force(seed, bw, host):
    prob = Problem(_small(seed), layers="uniform", offload=OffloadOption(bw, host))
    assert any(OFFLOAD in opts for g in prob.groups for opts in g.options.values())
    for frac in (0.2, 0.5):
        budget = frac * prob.baseline_bytes
        want, arg = brute_force(prob, budget)
        res = prob.solve(budget)
        if want == float("inf"):
            assert res.status == "infeasible"
            continue
        assert res.bytes <= budget and prob.host_bytes(res.decisions) <= host
        assert res.time_s == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_stall_is_what_the_copies_do_not_hide():
    prob = Problem(_small(0), layers="uniform", offload=OffloadOption(1e6, 10**9))
    g = prob.groups[0]
    t_f = prob.hide_s(g)
    sid = next(s.id for s in g.kind.storages if OFFLOAD in g.options[s.id])
    c = prob.copy_s(g, sid)
    want = len(g.blocks) * (max(0.0, c - t_f) + max(0.0, c - 2 * t_f))
    assert prob.stall_s(g, Decision(codecs={sid: OFFLOAD})) == pytest.approx(want)
    fast = Problem(_small(0), layers="uniform", offload=OffloadOption(1e15, 10**9))
    assert fast.stall_s(fast.groups[0], Decision(codecs={sid: OFFLOAD})) == 0.0


def test_offload_frees_device_bytes_within_the_host_budget():
    prof = _small(0)
    base = Problem(prof, layers="uniform")
    fast = Problem(prof, layers="uniform", offload=OffloadOption(1e15, 10**12))
    assert fast.min_bytes().bytes < base.min_bytes().bytes  # offload goes below the floor
    tiny = Problem(prof, layers="uniform", offload=OffloadOption(1e15, 1))
    assert tiny.host_bytes(tiny.min_bytes().decisions) == 0  # nothing fits in 1 byte
    # a free link: any budget down to the offload floor at no added time
    plan = solve_plan(prof, "30%", host_budget=10**12, link_bandwidth=1e15, max_grad_err=None)
    meta = dict(plan.meta)
    assert meta["host_bytes"] > 0 and meta["link_bandwidth"] == 1e15
    assert "offload" in set(plan.site_actions().values())
    assert plan.predicted_time_s == pytest.approx(0.0, abs=1e-6)
    assert "offloaded to host memory" in plan.table()


def test_host_budget_is_refused_on_cpu_and_parsed_once():
    prof = synthetic(0)  # a CPU profile
    with pytest.raises(ValueError, match="in host memory already"):
        solve_plan(prof, "50%", host_budget="1GiB")
    with pytest.raises(ValueError, match="bytes of pinned host memory"):
        AutoConfig(budget="25%", host_budget="25%")
    assert parse_host_budget("1GiB") == 2**30 and parse_host_budget(None) is None
    cfg = AutoConfig.from_spec("auto@25%,host_budget=2GiB")
    assert cfg.host_budget == "2GiB"
    with pytest.raises(ValueError, match="in host memory already"):
        slimact.apply(slimact.build_model("llama-tiny"), "auto@25%,host_budget=2GiB")
    with pytest.raises(ValueError, match="CUDA device"):
        link_bandwidth("cpu")


def test_a_solved_plan_that_offloads_runs_exactly_and_as_predicted(fake_streams):
    """llama-tiny profiled on CPU, solved as if on CUDA at its smallest budget with little host
    memory (offload mixed with recompute; the lossless actions only), run with the streams
    stubbed: bit-identical
    gradients, and the meter's device and host bytes are the plan's."""
    torch.manual_seed(0)
    ref = slimact.build_model("llama-tiny")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    prof = profile_model(copy.deepcopy(ref), ids, ids, codecs=["int8"], repeats=1, grads=False)
    prof = dataclasses.replace(prof, device="cuda:0")
    opts = dict(codecs=(), reform=False, max_grad_err=None)
    off = OffloadOption(1e15, 40_000)  # room for some block inputs: the rest is recomputed
    floor = Problem(prof, "ends", **opts, offload=off).min_bytes().bytes  # timings play no part
    plan = solve_plan(
        prof, floor, host_budget=40_000, link_bandwidth=1e15, include_static=False, **opts
    )
    acts = set(plan.site_actions().values())
    assert acts == {"keep", "recompute", "offload"} and dict(plan.meta)["host_bytes"] > 0
    with using_streams(fake_streams):
        model = slimact.apply(copy.deepcopy(ref), plan)
        with slimact.measure(model) as m:
            loss = model(ids, targets=ids).loss
            loss.backward()
    assert torch.equal(ref(ids, targets=ids).loss.detach(), loss.detach())
    ref(ids, targets=ids).loss.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert m.report.total_bytes == plan.predicted_bytes
    assert m.report.host_bytes == dict(plan.meta)["host_bytes"]


def test_a_small_host_budget_offloads_coded_payloads():
    """Offloading a codec's payload moves fewer bytes: with host memory for the INT4 payloads
    only, the smallest plan offloads coded tensors (offload+<codec>), within the host budget."""
    prof = _small(0)
    kind = prof.kinds[0]
    int4 = sum(kind.bytes_of(b, s.id, "int4") for b in kind.blocks for s in kind.storages
               if s.codecs)  # fmt: skip
    prob = Problem(prof, layers="uniform", offload=OffloadOption(1e15, int4))
    res = prob.min_bytes()
    chosen = {c for d in res.decisions for c in d.codecs.values()}
    assert any(c.startswith("offload+") for c in chosen), chosen
    assert 0 < prob.host_bytes(res.decisions) <= int4


def _without_offload(plan):
    """The same plan with every offload taken back: ``offload+<c>`` -> ``<c>``, ``offload`` ->
    keep (what offloading must not change a single bit of)."""
    layers = []
    for lp in plan.layers:
        codecs = tuple((c.partition("+")[2], n) for c, n in lp.codecs if c.startswith("offload+"))
        codecs += tuple((c, n) for c, n in lp.codecs if not c.startswith("offload"))
        layers.append(dataclasses.replace(lp, codecs=codecs))
    return dataclasses.replace(plan, layers=tuple(layers))


def test_a_solved_plan_with_coded_offload_runs_as_predicted(fake_streams):
    """Without recomputation, at the smallest budget and with little host memory, INT8 payloads
    are offloaded; the
    meter's device and host bytes are the plan's; gradients are the plan's without offload,
    bit for bit."""
    torch.manual_seed(0)
    ref = slimact.build_model("llama-tiny")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    prof = profile_model(copy.deepcopy(ref), ids, ids, codecs=["int8"], repeats=1, grads=False)
    prof = dataclasses.replace(prof, device="cuda:0")
    opts = dict(reform=False, recompute=False, max_grad_err=None)
    off = OffloadOption(1e15, 40_000)
    floor = Problem(prof, "ends", **opts, offload=off).min_bytes().bytes  # timings play no part
    plan = solve_plan(
        prof, floor, host_budget=40_000, link_bandwidth=1e15, include_static=False, **opts
    )
    assert "offload+codec:int8" in set(plan.site_actions().values())
    with using_streams(fake_streams):
        model = slimact.apply(copy.deepcopy(ref), plan)
        with slimact.measure(model) as m:
            loss = model(ids, targets=ids).loss
            loss.backward()
    assert m.report.total_bytes == plan.predicted_bytes
    assert m.report.host_bytes == dict(plan.meta)["host_bytes"] <= 40_000
    assert "offload+codec:int8" in {s.action for s in m.report.sites}
    same = slimact.apply(copy.deepcopy(ref), _without_offload(plan))
    with pytest.warns(BudgetWarning):  # the same plan keeps its offloaded bytes on the device
        assert torch.equal(same(ids, targets=ids).loss.detach(), loss.detach())
    same(ids, targets=ids).loss.backward()
    for (name, p), q in zip(same.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("seed", range(3))
def test_plan_cost_of_an_offloading_plan_is_its_prediction(seed):
    """The evolver compares plans by ``replan.plan_cost``: offload's codec time and stall
    included, costed as the solver predicted them."""
    from slimact.planner.replan import plan_cost

    for bw, budget in ((5e5, "15%"), (1e5, "15%"), (5e5, "30%")):
        plan = solve_plan(_small(seed), budget, host_budget=10**7, link_bandwidth=bw,
                          max_grad_err=None, layers="uniform")  # fmt: skip
        got = plan_cost(plan, _small(seed))
        assert got[0] == plan.predicted_bytes
        assert got[1] == pytest.approx(plan.predicted_time_s, rel=1e-9, abs=1e-12)
