"""Planning without building the model: fake-tensor structure, the one-block twin, slots (18.5)."""

from __future__ import annotations

import copy
import itertools
import json
import resource
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import slimact
from slimact.planner import milp
from slimact.planner.milp import Problem, each_parts, slot_sizes
from slimact.planner.plan import ROOT
from slimact.planner.profile import profile_model, profile_shapes
from slimact.planner.scaled import ScaledConfig, profile_scaled, twin_shape
from slimact.planner.solve import solve_plan


def _ids(vocab: int, b: int, s: int) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(0))


def _structure(prof):
    out = []
    for k in prof.kinds:
        st = [(s.id, s.name, s.sites, s.bytes, s.shape, s.dtype) for s in k.storages]
        mods = [(m.path, m.type, m.inputs, m.flops) for m in k.modules]
        out.append((k.kind, k.blocks, st, mods))
    return out


def test_fake_structure_equals_the_real_models_llama_20m():
    """Every site's bytes, shape, sharing, module inputs and FLOPs, the baseline and static
    bytes: identical from fake tensors and from the real llama-20m (and the meter agrees)."""
    ids = _ids(257, 2, 64)
    with FakeTensorMode():
        fake = slimact.build_model("llama-20m").train()
        fids = _ids(257, 2, 64)
        got = profile_shapes(fake, fids[:, :-1], fids[:, 1:])
    torch.manual_seed(0)
    real = slimact.build_model("llama-20m").train()
    want = profile_shapes(real, ids[:, :-1], ids[:, 1:])
    with slimact.measure(real) as m:
        real(ids[:, :-1], targets=ids[:, 1:])
    assert got.baseline_bytes == want.baseline_bytes == m.report.total_bytes
    assert got.static == want.static
    assert _structure(got) == _structure(want)
    assert sum(s.bytes * len(k.blocks) for k in got.kinds for s in k.storages if s.sites) == (
        m.report.total_bytes
    )


def test_shapes_only_profile_has_no_measurements():
    ids = _ids(257, 1, 16)
    prof = profile_shapes(slimact.build_model("llama-tiny").train(), ids[:, :-1], ids[:, 1:])
    assert all(m.recompute_s == 0.0 for k in prof.kinds for m in k.modules)
    assert not any(s.codecs or s.lossy_ok for k in prof.kinds for s in k.storages)


@pytest.mark.parametrize(
    "shape,cap,want",
    [((4, 256), 256, (2, 128)), ((1, 2048), 64, (1, 64)), ((8, 16), 64, (4, 16)),
     ((1, 10), 64, (1, 10)), ((3, 5), 64, (3, 5))],
)  # fmt: skip
def test_twin_shape(shape, cap, want):
    assert twin_shape(*shape, cap) == want


def test_scaled_config_errors_name_the_value():
    with pytest.raises(ValueError, match="max_tokens.*0"):
        ScaledConfig(max_tokens=0)
    with pytest.raises(ValueError, match="repeats.*'3'"):
        ScaledConfig(repeats="3")
    with pytest.raises(ValueError, match="n_layers|unknown model"):
        profile_scaled("no-such-model", 1, 8)


@pytest.fixture(scope="module")
def scaled_tiny():
    cfg = ScaledConfig(max_tokens=32, codecs=("int8", "int4"), repeats=1)
    return profile_scaled("llama-tiny", 4, 64, cfg)


def test_scaled_profile_bytes_are_exact_and_codecs_scale(scaled_tiny):
    """The scaled profile's storages are the real model's (bytes exact); int8 and int4 payloads,
    linear in rows, scale from the 2 x 16 twin to 4 x 64 exactly; the rule is stated."""
    ids = _ids(257, 4, 64)
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny").train()
    real = profile_model(model, ids[:, :-1], ids[:, 1:], codecs=("int8", "int4"), repeats=1)
    prof = scaled_tiny
    assert prof.baseline_bytes == real.baseline_bytes
    assert prof.static == real.static
    assert [k.blocks for k in prof.kinds] == [k.blocks for k in real.kinds]
    for k, rk in zip(prof.kinds, real.kinds):
        by_name = {s.name: s for s in rk.storages}
        for s in k.storages:
            r = by_name[s.name]
            assert (s.bytes, s.shape, s.sites) == (r.bytes, r.shape, r.sites)
            for c in ("int8", "int4"):
                if c in s.codecs and c in r.codecs:
                    assert s.codecs[c].bytes == r.codecs[c].bytes, (k.kind, s.name, c)
        assert {m.path: m.flops for m in k.modules} == {m.path: m.flops for m in rk.modules}
    meta = prof.meta["scaled"]
    assert (meta["twin_batch"], meta["twin_seq"], meta["twin_layers"]) == (2, 16, 1)
    assert "x FLOPs ratio" in meta["rule"] and "2x16" in meta["rule"]


def test_scaled_profile_plans(scaled_tiny):
    plan = solve_plan(scaled_tiny, "25%", layers="each")
    assert plan.predicted_bytes <= plan.budget_bytes
    assert len(plan.layers) == 2 + 1  # two blocks and the root


def test_slot_sizes_express_every_count():
    for n in range(1, 40):
        sizes = slot_sizes(n)
        assert sum(sizes) == n
        sums = {sum(c) for r in range(len(sizes) + 1) for c in itertools.combinations(sizes, r)}
        assert sums == set(range(n + 1))
    assert slot_sizes(32) == [1, 1, 2, 4, 8, 16]


def _replicated(prof, n: int):
    prof = copy.deepcopy(prof)
    for kind in prof.kinds:
        if kind.kind != ROOT:
            kind.blocks = [f"layers.{i}" for i in range(n)]
            kind.per_block = {}
    return prof


def test_each_slots_identical_blocks_and_keeps_the_optimum(scaled_tiny, monkeypatch):
    """6 identical blocks: 4 slots (1, 1, 2, 2) instead of 6 groups; same optimum here."""
    prof = _replicated(scaled_tiny, 6)
    kind = next(k for k in prof.kinds if k.kind != ROOT)
    assert [len(p) for p in each_parts(kind)] == [1, 1, 2, 2]
    slotted = Problem(prof, layers="each")
    assert len(slotted.groups) == 4 + 1
    monkeypatch.setattr(milp, "SLOT_FROM", 10**9)
    single = Problem(prof, layers="each")
    assert len(single.groups) == 6 + 1
    base = single.baseline_bytes
    for frac in (0.15, 0.3, 0.6):
        a, b = slotted.solve(frac * base), single.solve(frac * base)
        assert a.time_s == pytest.approx(b.time_s, rel=1e-6, abs=1e-9), frac


def test_each_keeps_distinct_blocks_apart(scaled_tiny):
    kind = next(k for k in _replicated(scaled_tiny, 6).kinds if k.kind != ROOT)
    kind.per_block = {b: {"0": {"raw": i}} for i, b in enumerate(kind.blocks)}
    assert each_parts(kind) == [[b] for b in kind.blocks]


def _plan_cli(*args: str) -> tuple[dict, float, float]:
    """(JSON, CPU seconds user+sys, peak RSS GiB of the children so far) of ``slimact plan``."""
    cmd = [sys.executable, "-W", "ignore", "-m", "slimact", "plan", *args, "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return json.loads(out.stdout), cpu, after.ru_maxrss / 2**20  # GiB (ru_maxrss: KiB)


def test_cli_scaled_profile_reports_mode_and_rule():
    d, _, _ = _plan_cli(
        "--model", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "25%",
        "--profile", "scaled", "--profile-tokens", "16", "--repeats", "1", "--cache", "none",
        "--codecs", "int8", "--threads", "1",
    )  # fmt: skip
    assert d["profile"]["mode"] == "scaled"
    assert (d["profile"]["scaled"]["twin_batch"], d["profile"]["scaled"]["twin_seq"]) == (2, 8)
    assert d["solve_time_s"] > 0 and d["profile_time_s"] > 0


@pytest.mark.slow
def test_cli_plans_llama_7b_in_minutes_and_4_gib():
    """Issue 18.5: llama-7b at 1 x 2048 never built: < 5 min, < 4 GiB RSS, solve <= 0.5 s.
    The time is the process's CPU time (user + sys): on a shared machine its wall time measures
    the other processes too; CPU seconds bound the wall time on an idle 2-core one."""
    d, cpu, rss = _plan_cli(
        "--model", "llama-7b", "--batch", "1", "--seq", "2048", "--budget", "25%",
        "--cache", "none",
    )  # fmt: skip
    assert d["profile"]["mode"] == "scaled"
    assert cpu < 300, cpu
    assert rss < 4.0, rss
    assert d["solve_time_s"] <= 0.5


@pytest.mark.parametrize("codec", ["int8-channel", "int8", "int4"])
def test_scaled_plan_applies_and_the_meter_agrees(codec):
    """A plan from a scaled profile (the model never built for planning), applied to the real
    model: the meter's bytes are the prediction within 1%. int8-channel on storages of several
    widths in one block (64 and 172 channels) exercises one codec per channel count."""
    prof = profile_scaled("llama-tiny", 4, 64, ScaledConfig(max_tokens=32, codecs=(codec,)))
    plan = solve_plan(
        prof, "45%", codecs=(codec,), recompute=False, reform=False, max_grad_err=None
    )  # INT4 on llama-tiny is above the default gradient cap; the bytes are what is tested
    assert any(c == codec for lp in plan.layers for c, _ in lp.codecs)
    ids = _ids(257, 4, 64)
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny").train()
    slimact.apply(model, plan)
    with slimact.measure(model) as m:
        model(ids[:, :-1], targets=ids[:, 1:]).loss.backward()
    assert plan.predicted_bytes == pytest.approx(m.report.total_bytes, rel=0.01)


def test_scaled_profile_skips_gradient_figures_of_big_blocks(monkeypatch):
    """A twin block above GRAD_MAX_BLOCK_BYTES gets no gradient figures (their copies would
    blow a small machine's memory: llama-7b reached 5.6 GB RSS), and the plan says so."""
    from slimact.planner import scaled
    from slimact.planner.milp import GRAD_KEY
    from slimact.planner.solve import solve_plan

    monkeypatch.setattr(scaled, "GRAD_MAX_BLOCK_BYTES", 0)
    prof = scaled.profile_scaled("llama-tiny", 4, 64, scaled.ScaledConfig(max_tokens=32))
    assert "MiB of parameters" in prof.meta["grad_err_skipped"]
    assert not prof.meta.get(GRAD_KEY)
    assert "grad_err_skipped" in dict(solve_plan(prof, "50%").meta)
