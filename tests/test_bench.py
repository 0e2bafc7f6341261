"""slimact bench: the report generator on fake results (schema 2 and 1), suite validation, the
timing phase, and tiny real runs (interleaved timing, peaks, a real-vocabulary case)."""

from __future__ import annotations

import json

import pytest

from slimact.bench.cases import BenchPoint, ModelCase, Suite
from slimact.bench.report import (
    load_results,
    model_table,
    pareto_front,
    render,
    shown_suites,
    write_report,
)
from slimact.bench.suites import get_suite, suite_names

MIB = 2**20


def _spread(r, base):
    if base:
        return {"median": 1.0, "min": 1.0, "max": 1.0, "q1": 1.0, "q3": 1.0, "n": 3}
    return {"median": r, "min": r - 0.1, "max": r + 0.1, "q1": r - 0.05, "q3": r + 0.05, "n": 3}


def _point(model, name, saved_mib, step, loss, cos=1.0, kind="strategy", skipped=None):
    rec = {"model": model, "case": model, "point": name, "kind": kind, "skipped": skipped,
           "note": ""}  # fmt: skip
    if skipped:
        return rec
    base_saved, base_step, base_peak = 4 * MIB, 0.5, 6 * MIB
    rec.update(
        params=1000,
        vocab_size=257,
        saved_bytes=int(saved_mib * MIB),
        block_saved_bytes=int(saved_mib * MIB) // 2,
        head_saved_bytes=MIB // 2,
        head_share=0.5 / saved_mib,
        step_time_s=step,
        tokens_per_s=256 / step,
        first_loss=5.0,
        grad_cosine=cos,
        peak_bytes=int((saved_mib + 2) * MIB),
        peak_ratio=(saved_mib + 2) * MIB / base_peak,
        ratio=saved_mib * MIB / base_saved,
        step_time_ratio=step / base_step,
        step_time_ratio_spread=_spread(step / base_step, name == "none"),
        sites_block="layers.1",
        sites=[
            {
                "site": "mlp.act_fn:silu#0",
                "module": "mlp.act_fn",
                "op": "silu",
                "action": "keep",
                "bytes": int(saved_mib * MIB) // 4,
            },
            {
                "site": "self_attn:sdpa#0",
                "module": "self_attn",
                "op": "sdpa",
                "action": "keep",
                "bytes": int(saved_mib * MIB) // 4,
            },
        ],  # fmt: skip
        train={"steps": 3, "losses": [5.0, 4.5, loss], "final_train_loss": loss, "val_loss": loss},
        wall_s=1.0,
    )
    return rec


def _fake(name="quick", complete=True):
    points = []
    for model in ("llama-20m", "cola-20m"):
        points += [
            _point(model, "none", 4.0, 0.5, 4.0),
            _point(model, "recompute", 1.0, 0.7, 4.0),
            _point(model, "invact", 3.0, 0.6, 4.1, cos=0.98),
            _point(model, "anchor:torch-checkpoint", 1.0, 0.65, 4.0, kind="anchor"),
        ]
    points.insert(3, _point("llama-20m", "cola-m", 0, 0, 0, skipped="ValueError: needs CoLA"))
    case = {"points": [], "batch": 2, "seq": 128, "timing_steps": 3, "warmup": 1,
            "train_steps": 3, "eval_batches": 1, "lr": 3e-3}  # fmt: skip
    timing = {"rounds": 3, "warmup": 1, "points": ["none", "recompute", "invact"],
              "load_before": 1.5, "load_after": 2.25, "wall_s": 3.0, "failed": {}}  # fmt: skip
    meta = {
        "schema": 2, "processor": "x86_64", "cpu_count": 2, "torch_threads": 1,
        "python": "3.11", "torch": "2.13.0", "platform": "Linux", "git_commit": "abc1234",
        "command": "slimact bench quick", "start": "2026-01-01T00:00:00+00:00", "wall_s": 120.0,
        "complete": complete, "selection": {}, "data": "corpus",
        "suite": {"name": name, "description": "fake", "device": "cpu", "bf16": False, "seed": 0,
                  "compile_budget": 0.5,
                  "cases": [dict(case, model="llama-20m", case="llama-20m", vocab_size=None),
                            dict(case, model="cola-20m", case="cola-20m", vocab_size=None)]},
        "timing": {"llama-20m": dict(timing, case="llama-20m"),
                   "cola-20m": dict(timing, case="cola-20m")},
    }  # fmt: skip
    return {"meta": meta, "points": points}


def test_pareto_front_pure_function():
    pts = [(4, 0.5), (1, 0.7), (3, 0.6), (1, 0.65), (5, 0.5), (1, 0.65)]
    # (1, 0.7) is dominated by (1, 0.65); (5, 0.5) by (4, 0.5); equal points both stay
    assert pareto_front(pts) == [0, 2, 3, 5]
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0)]) == [0]


@pytest.mark.slow
def test_report_tables_plots_and_benchmarks_section(tmp_path):
    res = tmp_path / "results" / "bench"
    res.mkdir(parents=True)
    (res / "quick.json").write_text(json.dumps(_fake()))
    out_md = tmp_path / "results" / "bench.md"
    bench_all = tmp_path / "BENCHMARKS.md"
    written = write_report(res, out_md, benchmarks_md=bench_all)
    md = out_md.read_text()
    # baseline and strategies with their numbers: saved, ratio, head share, peak MiB, peak ratio,
    # step s, step ratio (min-max), tokens/s, grad_cos, loss, Δloss
    assert (
        "| `none` | 4.00 | 1.000 | 12.5% | 6.0 | 1.00 | 0.500 | 1.00 | 512 | 1.00000 | 4.0000 "
        "| +0.0000 |" in md
    )
    assert (
        "| `invact` | 3.00 | 0.750 | 16.7% | 5.0 | 0.83 | 0.600 | 1.20 (1.10-1.30) | 427 | 0.98000 "
        "| 4.1000 | +0.1000 |" in md
    )
    assert "| anchor `torch-checkpoint` | 1.00 | 0.250 | 50.0% | 3.0 | 0.50 | 0.650 | 1.30 (" in md
    assert "| `cola-m` | | | | | | | | | | | | skipped: ValueError: needs CoLA |" in md
    assert "| head share | peak MiB | peak ratio | step s | step ratio (min-max) |" in md
    assert "3 interleaved rounds of 3 points after 1 warm-up" in md
    assert "load average 1.50 -> 2.25 during the rounds" in md
    assert "The loss head (output projection and loss) holds 12.5% of `none`'s saved bytes" in md
    assert md.count("### llama-20m") == 1 and md.count("### cola-20m") == 1
    # Pareto front: recompute (1, 0.7) is dominated by the anchor (1, 0.65); the rest are not
    assert (
        "Pareto front (saved bytes, step time): `none`, `invact`, `anchor:torch-checkpoint`." in md
    )
    assert "`recompute` is dominated by the PyTorch anchor(s) torch-checkpoint" in md
    assert "`invact` changes the first-step gradient" in md
    assert "`cola-m` did not run: ValueError: needs CoLA" in md
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 6
    for p in pngs:
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"
    assert "](bench_quick_llama-20m_pareto.png)" in md
    reading = tmp_path / "results" / "bench_reading.md"
    assert reading.is_file()
    doc = bench_all.read_text()
    assert doc.startswith("# slimact benchmarks")
    assert "## Side by side (slimact bench)" in doc
    assert "](benchmarks/results/bench_quick_llama-20m_loss.png)" in doc
    assert "#### llama-20m" in doc and "To be written by hand" in doc
    # a hand-written reading is kept and included after the tables
    reading.write_text("## Reading\n\nWe fall short on X.\n")
    write_report(res, out_md, benchmarks_md=bench_all)
    doc = bench_all.read_text()
    assert doc.index("We fall short on X.") > doc.index("#### cola-20m")


def test_full_preferred_over_quick_and_subset_over_nothing(tmp_path):
    (tmp_path / "quick.json").write_text(json.dumps(_fake("quick")))
    (tmp_path / "full.json").write_text(json.dumps(_fake("full")))
    sub = _fake("gpu", complete=False)
    sub["meta"]["selection"] = {"models": ["llama-20m"]}
    (tmp_path / "gpu-subset.json").write_text(json.dumps(sub))
    results = load_results(tmp_path)
    assert shown_suites(results) == (["full", "gpu"], ["quick"])
    md = render(results)  # no plot dir: no plots
    assert "## Suite `full`" in md and "## Suite `quick`" not in md
    assert "A `quick` run also exists" in md and "incomplete run" in md
    newer = _fake("quick")
    newer["meta"]["start"] = "2099-01-01T00:00:00+00:00"  # a quick run after the full one
    (tmp_path / "quick.json").write_text(json.dumps(newer))
    assert shown_suites(load_results(tmp_path)) == (["quick", "full", "gpu"], [])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        load_results(tmp_path)


def test_model_table_without_baseline_loss():
    pts = [_point("m", "none", 2.0, 1.0, 3.0)]
    pts[0]["train"] = {"error": "FloatingPointError: nan"}
    table = model_table(pts, 5)
    assert "loss@5" in table and "training failed: FloatingPointError: nan" in table


def test_schema1_results_render_with_dashes(tmp_path):
    res = _fake("quick")
    res["meta"]["schema"] = 1
    del res["meta"]["timing"]
    for c in res["meta"]["suite"]["cases"]:
        del c["case"], c["vocab_size"]
    for p in res["points"]:
        del p["case"]
        for k in ("peak_bytes", "peak_ratio", "head_saved_bytes", "head_share", "vocab_size",
                  "step_time_ratio_spread"):  # fmt: skip
            p.pop(k, None)
        if not p["skipped"]:
            p["peak_allocated_bytes"] = None
    (tmp_path / "quick.json").write_text(json.dumps(res))
    md = render(load_results(tmp_path))
    assert "| `invact` | 3.00 | 0.750 | - | - | - | 0.600 | 1.20 | 427 | 0.98000 |" in md
    assert "each point timed alone one after another" in md
    assert "The loss head" not in md and "### llama-20m" in md


def test_committed_results_still_render():
    from pathlib import Path

    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "bench"
    if not any(committed.glob("*.json")):
        pytest.skip("no committed bench results")
    md = render(load_results(committed))  # no plot dir: nothing written
    assert "## Suite `" in md and "| point | saved MiB |" in md


def test_time_case_interleaves_baseline_first_and_drops_a_failing_point(monkeypatch):
    import types

    import torch.nn as nn

    import slimact.timing
    from slimact.bench.timing_phase import Live, time_case

    calls: list[str] = []
    clock = [0.0]  # the timer's clock: each step advances it by its seconds (no wall clock)
    monkeypatch.setattr(
        slimact.timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0])
    )

    def step(name, seconds, fail_at=None):
        def call():
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError("boom")
            clock[0] += seconds

        return call

    live = {  # the baseline is not first here: time_case puts it first
        "slow": Live(nn.Linear(1, 1), step("slow", 0.010)),
        "none": Live(nn.Linear(1, 1), step("none", 0.002)),
        "bad": Live(nn.Linear(1, 1), step("bad", 0.0, fail_at=2)),
    }
    records = {n: {"point": n} for n in live}
    case = ModelCase("llama-tiny", ("none",), batch=2, seq=16, timing_steps=3, warmup=1)
    out = time_case(case, live, records, log=lambda s: None)
    assert out["points"] == ["none", "slow"] and list(out["failed"]) == ["bad"]
    assert out["rounds"] == 3 and "load_before" in out and "load_after" in out
    assert calls[-8:] == ["none", "slow"] * 4  # the last attempt: 1 warm-up + 3 rounds
    assert "RuntimeError: boom" in records["bad"]["timing_error"]
    assert records["bad"]["step_time_s"] is None
    sp = records["slow"]["step_time_ratio_spread"]
    assert sp["n"] == 3 and sp["min"] <= sp["median"] <= sp["max"]
    assert records["slow"]["step_time_ratio"] == sp["median"] == pytest.approx(5.0)
    assert records["slow"]["tokens_per_s"] == pytest.approx(32 / records["slow"]["step_time_s"])
    assert records["none"]["step_time_ratio"] == 1.0


@pytest.mark.parametrize(
    "name", ["anchor:compile-budget@0", "anchor:compile-budget@x", "anchor:torch-checkpoint@0.5"]
)
def test_anchor_arguments_are_checked(name):
    with pytest.raises(ValueError, match="only compile-budget and compile-block take"):
        BenchPoint(name)


def test_suites_registered_and_valid():
    assert suite_names() == ["quick", "full", "gpu", "compiled"]
    compiled = [p.name for p in get_suite("compiled").cases[0].points]
    assert [p for p in compiled if p.startswith("anchor:")] == [
        f"anchor:compile-budget@{b}" for b in (0.5, 0.25, 0.1)
    ]
    assert sum(p.startswith("compiled-auto@") for p in compiled) == 4
    quick = get_suite("quick")
    llama = quick.cases[0]
    assert llama.model == "llama-20m"
    names = [p.name for p in llama.points]
    for p in ("none", "recompute", "invact", "int4", "prac", "cola-m", "auto@10%", "auto@25%",
              "auto@50%", "invact+int4", "anchor:torch-checkpoint", "anchor:compile-budget",
              "anchor:save-on-cpu"):  # fmt: skip
        assert p in names
    assert {c.model for c in get_suite("full").cases} == {
        "llama-20m", "gpt2-124m", "cola-20m", "hf-bert-base"
    }  # fmt: skip
    vocab = [c for c in quick.cases if c.vocab_size]
    assert [c.label for c in vocab] == ["llama-20m (V=32000)"]
    assert [p.name for p in vocab[0].points] == ["none", "recompute", "invact", "int4", "auto@25%",
                                                 "anchor:torch-checkpoint", "anchor:compile-budget"]  # fmt: skip
    assert [c.label for c in get_suite("full").cases if c.vocab_size == 32000] == [vocab[0].label]
    assert quick.select(["llama-20m (V=32000)"]).cases == (vocab[0],)
    assert [c.label for c in quick.select(["llama-20m"]).cases] == ["llama-20m", vocab[0].label]
    gpu = get_suite("gpu")  # tests/test_bench_gpu_suite.py checks its points
    assert gpu.device == "cuda" and gpu.dtype == "bfloat16"
    json.dumps(quick.config())


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: get_suite("nope"), "valid suites: quick, full, gpu"),
        (lambda: BenchPoint("anchor:magic"), "valid anchors: anchor:torch-checkpoint"),
        (lambda: BenchPoint("turbo"), "unknown strategy 'turbo'"),
        (lambda: ModelCase("llama-99m", ("none",)), "unknown model 'llama-99m'"),
        (lambda: ModelCase("llama-tiny", ("invact", "none")), "first point must be 'none'"),
        (lambda: ModelCase("llama-tiny", ("none", "int4", "int4")), "duplicate points"),
        (lambda: ModelCase("llama-tiny", ("none",), seq=100_000), "seq must be in"),
        (lambda: ModelCase("llama-tiny", ("none",), train_steps=-1), "train_steps must be"),
        (lambda: Suite("s", "d", ()), "has no model cases"),
        (lambda: Suite("s", "d", (ModelCase("llama-tiny", ("none",)),), bf16=True), "bf16"),
        (lambda: Suite("s", "d", (ModelCase("llama-tiny", ("none",)),), device="tpu"), "device"),
        (lambda: get_suite("quick").select(["gpt2-999m"]), "not in suite 'quick'"),
        (lambda: get_suite("quick").select(None, ["int9"]), "not in suite 'quick'"),
    ],
)
def test_suite_validation_errors(make, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        make()


@pytest.mark.parametrize("bad", [1, 0, -3, True, 2.5, "32000"])
def test_model_case_rejects_bad_vocab_size(bad):
    with pytest.raises(ValueError) as e:
        ModelCase("llama-tiny", ("none",), vocab_size=bad)
    assert "vocab_size must be an int >= 2" in str(e.value) and f"got {bad!r}" in str(e.value)
    assert ModelCase("llama-tiny", ("none",), vocab_size=2).label == "llama-tiny (V=2)"
    with pytest.raises(ValueError, match="must exceed its \\[MASK\\] id 103, got 100"):
        ModelCase("hf-bert-base", ("none",), vocab_size=100)


def test_select_keeps_baseline():
    s = get_suite("quick").select(["llama-20m"], ["invact"])  # the model: both its cases
    assert [c.label for c in s.cases] == ["llama-20m", "llama-20m (V=32000)"]
    assert all([p.name for p in c.points] == ["none", "invact"] for c in s.cases)
    s = get_suite("quick").select(["llama-20m (V=32000)"], ["int4"])  # a label: just that case
    assert [(c.label, [p.name for p in c.points]) for c in s.cases] == [
        ("llama-20m (V=32000)", ["none", "int4"])
    ]


def test_compiled_suite_takes_every_strategy_in_its_compiled_form():
    s = get_suite("quick").select(["llama-20m"], ["invact", "int4", "prac", "cola-m", "auto@25%"])
    c = s.compiled()
    assert c.name == "quick-compiled" and "left out (no compiled form): cola-m" in c.description
    names = [p.name for p in c.cases[0].points]
    assert names == ["none", "compiled-none", "invact@ops=none+compiled-none", "compiled-int4",
                     "compiled-prac", "compiled-auto@25%"]  # fmt: skip
    anchors = get_suite("quick").select(["llama-20m"], ["anchor:torch-checkpoint"]).compiled()
    assert [p.name for p in anchors.cases[0].points][-1] == "anchor:torch-checkpoint"


def test_tiny_real_run_writes_schema_valid_json(tmp_path, isolated_cache, one_thread):
    from slimact.bench.runner import run_suite

    data = tmp_path / "corpus.jsonl"
    rows = [{"text": f"def f{i}(x):\n    return x * {i} + {i * 7}\n" * 20} for i in range(60)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    case = ModelCase("llama-tiny", ("none", "invact", "cola-m"), batch=2, seq=32,
                     timing_steps=2, warmup=1, train_steps=2, eval_batches=1)  # fmt: skip
    suite = Suite("tiny", "test", (case,))
    path = run_suite(suite, tmp_path / "bench", threads=1, data=str(data), log=lambda s: None)
    assert path == tmp_path / "bench" / "tiny.json"
    res = json.loads(path.read_text())
    meta = res["meta"]
    for key in ("torch", "git_commit", "command", "cpu_count", "start", "end", "wall_s", "suite"):
        assert key in meta
    assert meta["complete"] and meta["suite"]["cases"][0]["model"] == "llama-tiny"
    assert meta["schema"] == 2
    timing = meta["timing"]["llama-tiny"]
    assert timing["rounds"] == 2 and timing["points"] == ["none", "invact"]  # not the skipped
    assert "load_before" in timing and "load_after" in timing and not timing["failed"]
    none, invact, colam = res["points"]
    assert colam["skipped"] and "CoLA" in colam["skipped"] and "step_time_s" not in colam
    for p in (none, invact):
        assert p["skipped"] is None and p["case"] == "llama-tiny" and p["vocab_size"] == 257
        for key in ("saved_bytes", "ratio", "step_time_s", "step_time_ratio", "tokens_per_s",
                    "grad_cosine", "peak_bytes", "peak_ratio", "head_saved_bytes", "head_share",
                    "sites", "sites_block"):  # fmt: skip
            assert key in p, key
        assert p["peak_bytes"] > 0 and 0 < p["head_share"] <= 1
        assert p["tokens_per_s"] == pytest.approx(64 / p["step_time_s"])
        assert len(p["train"]["losses"]) == 2 and p["train"]["val_loss"] > 0
        assert p["sites"] and all(s["bytes"] > 0 for s in p["sites"])
    spread = invact["step_time_ratio_spread"]
    assert spread["n"] == 2 and spread["min"] <= spread["median"] <= spread["max"]
    assert invact["step_time_ratio"] == spread["median"] > 0
    base_spread = none.get("step_time_ratio_spread")
    assert base_spread is None or base_spread["min"] == base_spread["max"] == 1.0
    assert none["step_time_ratio"] == 1.0 and none["peak_ratio"] == 1.0
    assert invact["peak_ratio"] == pytest.approx(invact["peak_bytes"] / none["peak_bytes"])
    assert none["ratio"] == 1.0 and 0 < invact["ratio"] < 1
    assert invact["grad_cosine"] > 0.999
    # the report renders it
    md = render(load_results(tmp_path / "bench"))
    assert "### llama-tiny" in md


def test_vocab_case_runs_at_that_vocabulary_and_records_head_share(tmp_path, one_thread):
    import torch

    from slimact.bench.runner import build, run_suite

    model = build("llama-tiny", torch.device("cpu"), 0, vocab_size=1000)
    assert model.lm_head.out_features == 1000 and model.config.vocab_size == 1000
    case = ModelCase("llama-tiny", ("none", "int4"), batch=2, seq=32, timing_steps=2, warmup=0,
                     train_steps=1, eval_batches=1, vocab_size=1000)  # fmt: skip
    path = run_suite(
        Suite("voc", "test", (case,)), tmp_path / "bench", threads=1, log=lambda s: None
    )
    res = json.loads(path.read_text())
    assert "random token ids" in res["meta"]["data"]
    assert list(res["meta"]["timing"]) == ["llama-tiny (V=1000)"]
    for p in res["points"]:
        assert (
            p["skipped"] is None
            and p["case"] == "llama-tiny (V=1000)"
            and p["model"] == "llama-tiny"
        )
        assert p["vocab_size"] == 1000 and 0 < p["head_share"] <= 1
        assert p["head_share"] == pytest.approx(p["head_saved_bytes"] / p["saved_bytes"])
    none = res["points"][0]
    assert none["head_saved_bytes"] >= 2 * 32 * 1000 * 4  # at least the fp32 logits the loss keeps
    md = render(load_results(tmp_path / "bench"))
    assert "### llama-tiny (V=1000)" in md and "vocabulary 1,000, random token ids" in md


def test_cli_errors_and_report_only(tmp_path, capsys):
    from slimact.cli import main

    assert main(["bench", "nope"]) == 2
    assert "valid suites: quick, full, gpu" in capsys.readouterr().err
    assert main(["bench", "--report-only", "--out-dir", str(tmp_path / "empty")]) == 2
    res = tmp_path / "bench"
    res.mkdir()
    (res / "quick.json").write_text(json.dumps(_fake()))
    assert main(["bench", "--report-only", "--out-dir", str(res)]) == 0
    assert (tmp_path / "bench.md").is_file() and not (tmp_path / "BENCHMARKS.md").exists()


def test_amended_points_are_reported_in_the_suite_header(tmp_path):
    res = _fake("full")
    res["meta"]["amended"] = {"points": "prac", "models": ["llama-20m"], "git_commit": "def5678",
                              "command": "slimact bench full --only-strategies prac",
                              "reason": "defaults changed"}  # fmt: skip
    (tmp_path / "full.json").write_text(json.dumps(res))
    md = render(load_results(tmp_path))
    assert "Amended: the `prac` points of llama-20m come from a later run at commit `def5678`" in md
    assert "defaults changed" in md
