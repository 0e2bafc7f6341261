"""``slimact bench gpu``: its point list, and the same runner path end to end on a CPU.

The gpu suite is for a lent GPU (llama-350m, bf16 weights, 8 x 1024 tokens, under 8 minutes).
Here it runs with overrides (llama-tiny, cpu, 2 x 32 tokens, fp32; its compiling anchors through
``aot_eager_decomp_partition``, which partitions under ``activation_memory_budget`` as inductor
does without compiling kernels) through ``run_suite``: timing by pairs, the per-point time limit,
the suite's time budget, the max-batch phase and the peak-first summary table. The compile=True
points (inductor on CPU: minutes) run in the slow test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from slimact.bench.cases import BenchPoint, MaxBatchSpec, ModelCase, Suite
from slimact.bench.deadline import Deadline, PointTimeout, time_limit
from slimact.bench.maxbatch import Bracket, predicted_search
from slimact.bench.report import load_results, render
from slimact.bench.runner import run_suite
from slimact.bench.suites import GPU_AUTO_GRID, get_suite
from slimact.bench.tables import model_table, summary_table
from slimact.strategies import resolve

TINY = dict(model="llama-tiny", device="cpu", batch=2, seq=32, dtype="float32", vocab_size=1000,
            compile_backend="aot_eager_decomp_partition", timing_steps=2)  # fmt: skip
FAST_POINTS = ["anchor:torch-checkpoint", "recompute", "invact", "chunked-ce", "int4",
               "anchor:compile-block@1", "anchor:compile-block@0",
               "anchor:compile-budget@0.1"]  # fmt: skip


def tiny_gpu_suite(points=None, cap="16MiB", **kw) -> Suite:
    """The gpu suite with the CPU overrides (``points``: a selection of its points)."""
    s = get_suite("gpu")
    if points is not None:
        s = s.select(None, points)
    s = s.override(**{**TINY, **kw})
    c = s.cases[0]
    mb = replace(c.maxbatch, cap=cap) if c.maxbatch else None
    return replace(s, time_budget_s=None, cases=(replace(c, maxbatch=mb),))


def test_gpu_suite_is_the_issue_table():
    s = get_suite("gpu")
    assert s.device == "cuda" and s.dtype == "bfloat16" and not s.bf16
    assert s.time_budget_s is not None and s.time_budget_s <= 8 * 60 and s.summary
    (case,) = s.cases
    assert (case.model, case.batch, case.seq, case.vocab_size) == ("llama-350m", 8, 1024, 32000)
    assert case.train_steps == 0 and case.timing == "pairs" and case.timing_steps <= 5
    assert case.point_timeout_s is not None
    names = [p.name for p in case.points]
    blocks = [f"anchor:compile-block@{b}" for b in ("1", "0.5", "0.25", "0.1", "0")]
    for p in ["none", "anchor:torch-checkpoint", *blocks, "anchor:compile-budget@1",
              "anchor:compile-budget@0.1", "recompute", "invact", "chunked-ce", "int4", "auto@25%",
              "invact@ops=none+compiled-none", "compiled-recompute", "compiled-int8",
              f"compiled-auto@25%{GPU_AUTO_GRID}", f"compiled-auto@10%{GPU_AUTO_GRID}"]:  # fmt: skip
        assert p in names, p
    assert names[0] == "none" and names.index("anchor:compile-budget@1") == len(names) - 1
    auto = resolve(f"compiled-auto@10%{GPU_AUTO_GRID}")[0]
    assert auto.budgets == (1.0, 0.25, 0.1, 0.0) and auto.codecs == ("none", "int8")
    mb = case.maxbatch
    assert mb is not None and mb.cap_bytes == 40 * 2**30 and mb.probes <= 3
    assert list(mb.points) == ["none", f"compiled-auto@10%{GPU_AUTO_GRID}",
                               "anchor:compile-block@0", "anchor:torch-checkpoint"]  # fmt: skip
    assert mb.reserve_s < s.time_budget_s
    json.dumps(s.config())
    # a CPU dry run of it: the same points, another model, device and batch
    t = s.override(model="llama-tiny", device="cpu", batch=2, seq=32)
    assert t.device == "cpu" and [p.name for p in t.cases[0].points] == names
    assert t.cases[0].maxbatch == mb


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: BenchPoint("anchor:compile-block@1.5"), "only compile-budget and compile-block"),
        (lambda: BenchPoint("anchor:compile-budget@0"), "only compile-budget and compile-block"),
        (lambda: ModelCase("llama-tiny", ("none",), timing="bursts"), "timing must be one of"),
        (lambda: ModelCase("llama-tiny", ("none",), point_timeout_s=0), "point_timeout_s"),
        (lambda: ModelCase("llama-tiny", ("none",), maxbatch=MaxBatchSpec(("int4",))),
         "max-batch points ['int4'] are not among"),
        (lambda: MaxBatchSpec(("none",), cap="25%"), "is a share"),
        (lambda: MaxBatchSpec(("none",), probes=0), "probes must be an int >= 1"),
        (lambda: Suite("s", "d", (ModelCase("llama-tiny", ("none",)),), dtype="fp8"), "dtype"),
        (lambda: Suite("s", "d", (ModelCase("llama-tiny", ("none",)),), time_budget_s=-1),
         "time_budget_s"),
        (lambda: get_suite("quick").override(model="llama-tiny"), "needs a one-case suite"),
        (lambda: ModelCase("llama-tiny", ("none",), point_timeouts=(("int4", 5),)),
         "point_timeouts names points it does not have: ['int4']"),
        (lambda: ModelCase("llama-tiny", ("none",), point_timeouts=(("none", -1),)),
         "point_timeouts['none'] must be a number > 0"),
    ],
)  # fmt: skip
def test_gpu_suite_validation_errors(make, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        make()


def test_predicted_search_finds_the_cap_in_few_probes():
    def line(per_row, fixed, oom_above=None):
        calls = []

        def measure(b):
            calls.append(b)
            return None if oom_above is not None and b > oom_above else fixed + per_row * b

        return measure, calls

    measure, calls = line(100, 1000)  # budget 10_000 -> 90 rows fit, 91 do not
    got = predicted_search(measure, [(8, 1800)], 10_000, probes=3, intercept=1000)
    assert (got.fits, got.misses, got.exact) == (90, 91, True) and calls == [64, 90, 91]
    measure, calls = line(100, 1000)  # no intercept: the first line overshoots, the next is exact
    got = predicted_search(measure, [(8, 1800)], 10_000, probes=4)
    assert got.exact and got.fits == 90 and len(calls) <= 4
    measure, calls = line(100, 1000, oom_above=50)  # out of memory counts as a miss
    got = predicted_search(measure, [(8, 1800)], 10_000, probes=3, intercept=1000)
    assert got.fits <= 50 and got.misses is not None and got.misses <= 64
    assert any(p is None for _, p in got.probes)
    measure, calls = line(1, 0)  # everything fits: stops at the limit
    got = predicted_search(measure, [(8, 8)], 10**9, probes=5, limit=100)
    assert got.fits == 100 and got.exact and max(calls) == 100
    got = predicted_search(measure, [(8, 10**10)], 10**9, probes=0)  # the known batch misses
    assert (got.fits, got.misses, got.exact) == (0, 8, False)

    def interrupted(b):  # a time limit firing in the second probe: the first one is kept
        if b > 64:
            raise PointTimeout("stop")
        return 1000 + 100 * b

    bracket = Bracket()
    with pytest.raises(PointTimeout):
        predicted_search(interrupted, [(8, 1800)], 10**5, probes=3, intercept=1000, bracket=bracket)
    assert bracket.fits == 64 and bracket.probes == [(64, 7400)] and not bracket.exact


def test_points_not_started_past_the_budget_or_after_a_profile_timed_out():
    from slimact.bench.runner import _why_not_run

    auto = f"compiled-auto@10%{GPU_AUTO_GRID}"
    case = get_suite("gpu").cases[0]
    assert case.timeout_of(auto) > case.timeout_of("int4") == case.point_timeout_s
    assert _why_not_run("int4", 0.0, {}).startswith("not run: the suite's time budget")
    assert _why_not_run("int4", None, {}) is None
    timed_out = {auto: {"skipped": "timed out: point ...: ran past its limit of 240 s"}}
    other = f"compiled-auto@25%{GPU_AUTO_GRID}"
    assert _why_not_run(other, 100.0, timed_out) == (
        f"not run: {auto} timed out profiling the same options"
    )
    assert _why_not_run("compiled-auto@25%", 100.0, timed_out) is None  # another grid
    assert _why_not_run(other, 100.0, {auto: {"skipped": "ValueError: x"}}) is None


def test_time_limit_and_deadline():
    with pytest.raises(PointTimeout, match="spin: ran past its limit"):
        with time_limit(0.05, "spin"):
            while True:
                pass
    with time_limit(None, "nothing"):
        pass
    d = Deadline(100)
    assert 99 < d.remaining() <= 100 and d.limit(10) == 10 and d.limit(None, reserve=30) <= 70
    assert Deadline(None).limit(5) == 5 and Deadline(None).remaining() is None
    with pytest.raises(ValueError, match="time budget must be > 0"):
        Deadline(0)


def test_exit_process_ends_past_a_running_planner_thread():
    # a timed-out point's planner still running in its daemon thread: the process must end at
    # once with the command's code, and with what it printed flushed
    code = (
        "import threading, time\n"
        "from slimact.bench.deadline import PLANNER_THREAD, exit_process\n"
        "threading.Thread(target=time.sleep, args=(60,), name=PLANNER_THREAD, daemon=True).start()\n"
        "print('written', end='')\n"
        "exit_process(3)\n"
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (3, "written") and time.perf_counter() - t0 < 30


def test_gpu_suite_end_to_end_on_cpu(tmp_path, one_thread):
    suite = tiny_gpu_suite(FAST_POINTS)
    names = [p.name for p in suite.cases[0].points]
    assert names == ["none", *FAST_POINTS]  # the gpu suite's order
    lines = []
    path = run_suite(suite, tmp_path, threads=1, log=lines.append)
    res = json.loads(path.read_text())
    meta, pts = res["meta"], {p["point"]: p for p in res["points"]}
    assert meta["complete"] and list(pts) == names
    assert meta["suite"]["dtype"] == "float32" and meta["suite"]["cases"][0]["timing"] == "pairs"
    for name, p in pts.items():
        assert p["skipped"] is None, (name, p["skipped"])
        assert p["step_time_s"] > 0 and p["peak_bytes"] > 0 and p["saved_bytes"] > 0, name
        assert p["grad_cosine"] > 0.99 and "train" not in p, name  # no training run
        assert p["step_time_ratio_spread"]["n"] == (2 if name != "none" else 2 * len(names) - 2)
    timing = meta["timing"]["llama-tiny (V=1000)"]
    assert timing["mode"] == "pairs" and timing["points"] == names and not timing["failed"]
    b = {n: pts[n]["saved_bytes"] for n in names}
    assert b["anchor:compile-block@0"] < b["anchor:compile-block@1"] < b["none"]
    assert b["anchor:compile-budget@0.1"] < b["anchor:compile-block@1"]
    # compile at budget 0 keeps what checkpointing keeps: the blocks' inputs (and the root's)
    assert b["anchor:compile-block@0"] == pytest.approx(b["anchor:torch-checkpoint"], rel=0.05)
    assert pts["anchor:compile-block@0"]["peak_bytes"] < pts["none"]["peak_bytes"]
    # max batch: measured, exact, checkpointing fits more than none under the same cap
    mb = meta["maxbatch"]["llama-tiny (V=1000)"]["points"]
    assert list(mb) == ["none", "anchor:compile-block@0", "anchor:torch-checkpoint"]
    for name, row in mb.items():
        assert row["exact"] and row["max_batch"] == pts[name]["max_batch"] > 0, (name, row)
        assert len(row["probes"]) <= 3 and row["smallest_miss"] == row["max_batch"] + 1
    assert mb["anchor:torch-checkpoint"]["max_batch"] > mb["none"]["max_batch"]
    assert mb["anchor:torch-checkpoint"]["ratio_to_none"] > 1
    # the peak-first table, written as the run went
    table = path.with_suffix(".summary.md").read_text()
    assert table == summary_table(res) and "is what decides whether a run fits" in table
    assert table.index("peak / none") < table.index("act / none")
    for name in names:
        assert f"`{name[len('anchor:') :] if name.startswith('anchor:') else name}`" in table
    assert any("max batch" in line for line in lines)
    md = render(load_results(tmp_path))
    assert "each point against `none` right after it was measured" in md


def test_time_budget_and_point_limit_leave_a_table(tmp_path, one_thread):
    """A point past its limit is recorded as timed out and the next one runs; past the suite's
    budget, points are recorded as not run; the JSON and table hold what was measured."""
    points = ["anchor:torch-checkpoint", "anchor:compile-block@1", "recompute"]
    suite = tiny_gpu_suite(points, compile_backend="inductor")  # inductor: seconds to compile
    # the limit on the compiled anchor alone: a loaded machine may take longer than any short
    # limit for the eager points too
    limits = (("anchor:compile-block@1", 0.2),)
    case = replace(suite.cases[0], point_timeouts=limits, maxbatch=None)
    suite = replace(suite, cases=(case,))
    res = json.loads(run_suite(suite, tmp_path, threads=1, log=lambda s: None).read_text())
    pts = {p["point"]: p for p in res["points"]}
    assert pts["anchor:compile-block@1"]["skipped"].startswith("timed out")
    assert pts["recompute"]["skipped"] is None and pts["recompute"]["step_time_s"] > 0
    assert pts["anchor:torch-checkpoint"]["skipped"] is None
    # a budget spent before the second point: the rest are recorded, not run
    suite = replace(tiny_gpu_suite(["recompute", "invact"]), time_budget_s=1e-3)
    suite = replace(suite, cases=(replace(suite.cases[0], maxbatch=None),))
    res = json.loads(run_suite(suite, tmp_path / "b", threads=1, log=lambda s: None).read_text())
    pts = {p["point"]: p for p in res["points"]}
    assert pts["none"]["skipped"] is None and res["meta"]["complete"]
    assert all(pts[n]["skipped"].startswith("not run: the suite's time budget") for n in
               ("recompute", "invact"))  # fmt: skip
    table = (tmp_path / "b" / "gpu.summary.md").read_text()
    assert "not run: the suite's time budget" in table and "`invact`" in table


def test_peak_first_tables_render_skips_and_bounds():
    base = {"point": "none", "kind": "strategy", "saved_bytes": 4 * 2**20, "peak_bytes": 8 * 2**20,
            "ratio": 1.0, "peak_ratio": 1.0, "grad_cosine": 1.0, "step_time_s": 0.1,
            "step_time_ratio": 1.0, "max_batch": 20, "max_batch_exact": True, "case": "m",
            "model": "m"}  # fmt: skip
    ck = {**base, "point": "anchor:torch-checkpoint", "kind": "anchor", "max_batch": 64,
          "max_batch_exact": False, "peak_ratio": 0.3}  # fmt: skip
    gone = {"point": "int4", "kind": "strategy", "skipped": "timed out: a | b", "case": "m",
            "model": "m"}  # fmt: skip
    md = model_table([base, ck, gone], lead_with_peak=True)
    head = md.splitlines()[0]
    assert head.index("peak MiB") < head.index("max batch") < head.index("saved MiB")
    assert "| ≥ 64 |" in md and "timed out: a \\| b" in md
    assert model_table([base]).splitlines()[0].index("saved MiB") < head.index("peak MiB") + 99
    res = {"meta": {"suite": {"name": "gpu", "device": "cuda", "dtype": "bfloat16",
                              "cases": [{"case": "m", "batch": 8, "seq": 1024}]}},
           "points": [base, ck, gone]}  # fmt: skip
    table = summary_table(res)
    assert "≥ 64" in table and "timed out" in table and "incomplete" not in table
    assert summary_table({"meta": {}, "points": []}).startswith("(no points")


@pytest.mark.slow
def test_gpu_suite_every_point_on_cpu(tmp_path, one_thread):
    """Every point of the gpu suite, compile=True ones included (inductor on CPU), and the
    max-batch phase of its best points, on llama-tiny."""
    suite = tiny_gpu_suite(compile_backend="inductor", cap="8MiB")
    path = run_suite(suite, tmp_path, threads=1, log=lambda s: None)
    res = json.loads(path.read_text())
    pts = {p["point"]: p for p in res["points"]}
    assert list(pts) == [p.name for p in get_suite("gpu").cases[0].points]
    for name, p in pts.items():
        assert p["skipped"] is None, (name, p["skipped"])
        assert p["step_time_s"] > 0 and p["grad_cosine"] > 0.99, name
    auto10, auto25 = (pts[f"compiled-auto@{b}%{GPU_AUTO_GRID}"] for b in (10, 25))
    assert auto10["saved_bytes"] <= auto25["saved_bytes"] < pts["none"]["saved_bytes"]
    mb = res["meta"]["maxbatch"]["llama-tiny (V=1000)"]["points"]
    assert all(row.get("max_batch", 0) > 0 for row in mb.values()), mb
    assert torch.get_num_threads() == 1
