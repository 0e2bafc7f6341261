"""The MILP against brute-force enumeration, budgets, and the infeasible-budget error."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from slimact.planner.milp import Decision, Problem, brute_force
from slimact.planner.plan import (
    ROOT,
    CodecStat,
    KindProfile,
    ModuleProfile,
    Plan,
    Profile,
    ReformProfile,
    StorageProfile,
    parse_budget,
)
from slimact.planner.solve import solve_plan


def synthetic(seed: int, n_blocks: int = 2) -> Profile:
    """A small block with the structures that matter: nesting, a shared storage, a checkpoint
    input nobody saves (virtual), a reformulation that adds a saver, a saver in another block."""
    rng = random.Random(seed)

    def codecs(nbytes: int) -> dict[str, CodecStat]:
        out = {}
        for name, rate in (("int4", 0.15), ("int8", 0.27)):
            t = rng.uniform(0.1, 2.0) * nbytes / 1e6
            out[name] = CodecStat(int(nbytes * rate), t, t / 2, rate / 2, 20.0)
        return out

    def st(i, sites, nbytes, lossy=True):
        return StorageProfile(i, sites[0] if sites else f"v{i}", sites, nbytes, [1], "float32",
                              lossy, codecs(nbytes) if lossy else {})  # fmt: skip

    sizes = [rng.choice([1, 2, 4]) * 10**6 for _ in range(8)]
    storages = [
        st(0, ["norm:pow#0", "norm:mul#1"], sizes[0]),  # block input, saved twice
        st(1, ["norm:mul#2"], sizes[1]),
        st(2, ["attn.q:linear#0", "attn.k:linear#0"], sizes[2]),  # norm output, shared
        st(3, ["attn:sdpa#0"], sizes[3]),
        st(4, ["mlp.act:silu#0"], sizes[4]),
        st(5, ["mlp:mul#0", "!extern"], sizes[5], lossy=False),
        st(6, ["mlp.down:linear#0"], sizes[6]),
        st(7, [], sizes[7]),  # input of "mlp" that nobody saves
    ]
    modules = [
        ModuleProfile("", "Block", [0], rng.uniform(3, 6), 0),
        ModuleProfile("attn", "Attn", [2], rng.uniform(1, 3), 0),
        ModuleProfile("mlp", "MLP", [7], rng.uniform(1, 3), 0),
        ModuleProfile("norm", "Norm", [0], rng.uniform(0.1, 0.5), 0),
    ]
    reforms = [
        ReformProfile(
            "norm",
            "invnorm:rms",
            ["norm:mul#1", "norm:mul#2", "norm:pow#0"],
            [2],
            1000,
            rng.uniform(-0.1, 0.3),
            {"2": ["norm:inv#0"]},
        ),  # fmt: skip
        ReformProfile(
            "mlp.act", "invact:silu", ["mlp.act:silu#0"], [], sizes[4] // 32, rng.uniform(0, 0.5)
        ),  # fmt: skip
    ]
    blocks = [f"layers.{i}" for i in range(n_blocks)]
    kind = KindProfile("Block-x", blocks, storages, modules, reforms)
    for b in blocks:  # per-block payloads differ (outliers)
        kind.per_block[b] = {
            str(s.id): {"raw": s.bytes, **{c: int(v.bytes * rng.uniform(1, 1.5))
                                         for c, v in s.codecs.items()}}
            for s in storages if s.sites
        }  # fmt: skip
    root = KindProfile(ROOT, [""], [st(0, [":cross_entropy#0"], 10**6, lossy=False)], [], [])
    base = sum(s.bytes for s in storages if s.sites) * n_blocks + 10**6
    static = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    return Profile("toy", 1, 1, "float32", "cpu", base, static, [kind, root])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("frac", [0.15, 0.35, 0.6, 0.9])
def test_milp_equals_brute_force_uniform(seed, frac):
    prof = synthetic(seed)
    prob = Problem(prof, layers="uniform")
    budget = frac * prob.baseline_bytes
    want, _ = brute_force(prob, budget)
    res = prob.solve(budget)
    if want == float("inf"):
        assert res.status == "infeasible"
        return
    assert res.status == "optimal"
    assert res.bytes <= budget
    assert res.time_s == pytest.approx(want, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("seed", range(2))
def test_milp_equals_brute_force_per_layer_and_quality_cap(seed):
    prof = synthetic(seed, n_blocks=2)
    prof.kinds[0].storages = prof.kinds[0].storages[:3]  # keep the 2-group product small
    prof.kinds[0].modules = [m for m in prof.kinds[0].modules if m.path in ("attn", "norm")]
    prof.kinds[0].reforms = prof.kinds[0].reforms[:1]
    prob = Problem(prof, layers="each")
    assert len(prob.groups) == 3
    for frac, cap in ((0.5, None), (0.4, 0.02)):
        budget = frac * prob.baseline_bytes
        want, _ = brute_force(prob, budget, max_quality=cap)
        res = prob.solve(budget, max_quality=cap)
        if want == float("inf"):
            assert res.status == "infeasible"
            continue
        assert res.time_s == pytest.approx(want, rel=1e-6, abs=1e-7)
        assert res.bytes <= budget and (cap is None or res.quality <= cap + 1e-9)


def test_min_bytes_equals_brute_force_minimum():
    prob = Problem(synthetic(1), layers="uniform")
    from slimact.planner.milp import enumerate_group

    best = min(
        prob.evaluate([d, Decision()])[0] for d in enumerate_group(prob, 0)
    )  # root has no options but keep
    assert prob.min_bytes().bytes == best


def test_dropping_is_exact():
    """A storage is dropped iff every saver is silenced and nothing holds it."""
    prob = Problem(synthetic(0), layers="uniform")
    g = prob.groups[0]
    assert prob.dropped(g, Decision()) == {7}  # the virtual input is not stored by default
    assert {1, 3, 4, 6} <= prob.dropped(g, Decision(frozenset({""})))
    whole = prob.dropped(g, Decision(frozenset({""})))
    assert 0 not in whole and 5 not in whole  # checkpoint input; a saver in another block
    mlp = prob.dropped(g, Decision(frozenset({"mlp"})))
    assert 7 not in mlp and 4 in mlp and 6 in mlp
    inv = prob.dropped(g, Decision(frozenset(), frozenset({"norm"})))
    assert 0 in inv and 1 in inv and 2 not in inv


def test_all_keep_is_the_baseline_and_codec_on_dropped_is_refused():
    prof = synthetic(2)
    prob = Problem(prof, layers="each")
    assert prob.baseline_bytes == prof.baseline_bytes
    with pytest.raises(ValueError, match="dropped"):
        prob.evaluate([Decision(frozenset({"mlp"}), codecs={4: "int4"}), Decision(), Decision()])


def test_parse_budget():
    assert parse_budget("25%", 1000) == 250
    assert parse_budget("1GiB", 0, 2**29) == 2**29
    assert parse_budget("1.5MB", 0) == 1_500_000
    assert parse_budget("1234B", 0) == parse_budget("1234b", 0) == 1234
    assert parse_budget(4096, 0) == 4096  # an int from Python is bytes
    for bad in ("abc", "0%", "150%", "-1GiB", "3 parsecs", 0.25, None, True):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad, 100)


@pytest.mark.parametrize("bare", ["25", " 25 ", "6e9", "0.5"])
def test_bare_number_budget_has_no_unit(bare):
    with pytest.raises(ValueError, match="has no unit: use '.*%' of the baseline or a size"):
        parse_budget(bare, 1000)


def test_int_budget_round_trips_through_the_plan():
    prof = synthetic(3)
    floor = Problem(prof).min_bytes().bytes
    plan = solve_plan(prof, floor, include_static=False)
    assert plan.budget == f"{floor}B"  # re-solvable from the plan (the evolver does that)
    assert parse_budget(plan.budget, prof.baseline_bytes) == floor


def test_infeasible_budget_names_the_smallest_feasible():
    prof = synthetic(3)
    floor = Problem(prof).min_bytes().bytes
    with pytest.raises(ValueError, match="smallest feasible") as e:
        solve_plan(prof, "1%")
    assert f"{floor / prof.baseline_bytes:.1%}" in str(e.value)
    plan = solve_plan(prof, floor, include_static=False)  # exactly the floor is feasible
    assert plan.predicted_bytes <= floor


def test_plan_json_roundtrip_and_site_actions(tmp_path):
    prof = synthetic(4)
    plan = solve_plan(prof, "40%", layers="each")
    assert isinstance(plan, Plan) and plan.predicted_bytes <= plan.budget_bytes
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again == plan
    acts = plan.site_actions()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in acts.items())
    assert sum(lp.predicted_bytes for lp in plan.layers) == plan.predicted_bytes
    assert "predicted added time" in plan.table()


def test_profile_json_roundtrip(tmp_path):
    prof = synthetic(5)
    prof.save(tmp_path / "prof.json")
    again = Profile.load(tmp_path / "prof.json")
    assert again.to_dict() == prof.to_dict()
    assert copy.deepcopy(again).kinds[0].storages[0].codecs["int4"].bytes > 0


def test_real_block_milp_equals_brute_force():
    """A small real block: llama-tiny's MLP half (norm, gate/up input, SiLU, products)."""
    import slimact
    from slimact.planner.profile import profile_model

    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 32))
    prof = profile_model(model, x, codecs=("int4", "int8"), repeats=1, per_block=False)
    kind = prof.kinds[0]
    keep = [s for s in kind.storages if s.name.startswith(("post_attention", "mlp"))]
    ids = {s.id: i for i, s in enumerate(keep)}
    for s in keep:
        s.id = ids[s.id]
    kind.storages = keep
    kind.modules = [m for m in kind.modules if m.path in ("mlp", "post_attention_layernorm")]
    for m in kind.modules:
        m.inputs = [ids[i] for i in m.inputs]
    kind.reforms = [r for r in kind.reforms if r.path in ("mlp.act_fn", "post_attention_layernorm")]
    for r in kind.reforms:
        r.added = [ids[i] for i in r.added if i in ids]
    kind.blocks, kind.per_block = kind.blocks[:1], {}
    prof.kinds = [kind]
    prob = Problem(prof, layers="uniform")
    base = prob.baseline_bytes
    for frac in (0.1, 0.3, 0.6):
        want, _ = brute_force(prob, frac * base)
        res = prob.solve(frac * base)
        assert res.time_s == pytest.approx(want, rel=1e-6, abs=1e-7), frac
