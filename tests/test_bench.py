"""slimact bench: the report generator on a fake results set, suite validation, a tiny real run."""

from __future__ import annotations

import json

import pytest

from slimact.bench.report import (
    load_results,
    model_table,
    pareto_front,
    render,
    shown_suites,
    write_report,
)
from slimact.bench.suites import BenchPoint, ModelCase, Suite, get_suite, suite_names

MIB = 2**20


def _point(model, name, saved_mib, step, loss, cos=1.0, kind="strategy", skipped=None):
    rec = {"model": model, "point": name, "kind": kind, "skipped": skipped, "note": ""}
    if skipped:
        return rec
    base_saved, base_step = 4 * MIB, 0.5
    rec.update(
        params=1000,
        saved_bytes=int(saved_mib * MIB),
        block_saved_bytes=int(saved_mib * MIB) // 2,
        step_time_s=step,
        tokens_per_s=256 / step,
        first_loss=5.0,
        grad_cosine=cos,
        peak_allocated_bytes=None,
        ratio=saved_mib * MIB / base_saved,
        step_time_ratio=step / base_step,
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
    meta = {
        "schema": 1, "processor": "x86_64", "cpu_count": 2, "torch_threads": 1,
        "python": "3.11", "torch": "2.13.0", "platform": "Linux", "git_commit": "abc1234",
        "command": "slimact bench quick", "start": "2026-01-01T00:00:00+00:00", "wall_s": 120.0,
        "complete": complete, "selection": {}, "data": "corpus",
        "suite": {"name": name, "description": "fake", "device": "cpu", "bf16": False, "seed": 0,
                  "compile_budget": 0.5,
                  "cases": [dict(case, model="llama-20m"), dict(case, model="cola-20m")]},
    }  # fmt: skip
    return {"meta": meta, "points": points}


def test_pareto_front_pure_function():
    pts = [(4, 0.5), (1, 0.7), (3, 0.6), (1, 0.65), (5, 0.5), (1, 0.65)]
    # (1, 0.7) is dominated by (1, 0.65); (5, 0.5) by (4, 0.5); equal points both stay
    assert pareto_front(pts) == [0, 2, 3, 5]
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0)]) == [0]


def test_report_tables_plots_and_benchmarks_section(tmp_path):
    res = tmp_path / "results" / "bench"
    res.mkdir(parents=True)
    (res / "quick.json").write_text(json.dumps(_fake()))
    out_md = tmp_path / "results" / "bench.md"
    bench_all = tmp_path / "BENCHMARKS.md"
    written = write_report(res, out_md, benchmarks_md=bench_all)
    md = out_md.read_text()
    # baseline and strategies with their numbers
    assert "| `none` | 4.00 | 1.000 | 0.500 | 1.00 | 512 | 1.00000 | 4.0000 | +0.0000 |" in md
    assert "| `invact` | 3.00 | 0.750 | 0.600 | 1.20 | 427 | 0.98000 | 4.1000 | +0.1000 |" in md
    assert "| anchor `torch-checkpoint` | 1.00 | 0.250 | 0.650 | 1.30 |" in md
    assert "| `cola-m` | | | | | | | | | | skipped: ValueError: needs CoLA |" in md
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
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        load_results(tmp_path)


def test_model_table_without_baseline_loss():
    pts = [_point("m", "none", 2.0, 1.0, 3.0)]
    pts[0]["train"] = {"error": "FloatingPointError: nan"}
    table = model_table(pts, 5)
    assert "loss@5" in table and "training failed: FloatingPointError: nan" in table


def test_suites_registered_and_valid():
    assert suite_names() == ["quick", "full", "gpu"]
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
    gpu = get_suite("gpu")
    assert gpu.device == "cuda" and gpu.bf16
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
        (lambda: ModelCase("llama-tiny", ("none",), train_steps=0), "train_steps must be"),
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


def test_select_keeps_baseline():
    s = get_suite("quick").select(["llama-20m"], ["invact"])
    assert [c.model for c in s.cases] == ["llama-20m"]
    assert [p.name for p in s.cases[0].points] == ["none", "invact"]


def test_tiny_real_run_writes_schema_valid_json(tmp_path, isolated_cache, one_thread):
    from slimact.bench.runner import run_suite

    data = tmp_path / "corpus.jsonl"
    rows = [{"text": f"def f{i}(x):\n    return x * {i} + {i * 7}\n" * 20} for i in range(60)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    case = ModelCase("llama-tiny", ("none", "invact", "cola-m"), batch=2, seq=32,
                     timing_steps=1, warmup=1, train_steps=2, eval_batches=1)  # fmt: skip
    suite = Suite("tiny", "test", (case,))
    path = run_suite(suite, tmp_path / "bench", threads=1, data=str(data), log=lambda s: None)
    assert path == tmp_path / "bench" / "tiny.json"
    res = json.loads(path.read_text())
    meta = res["meta"]
    for key in ("torch", "git_commit", "command", "cpu_count", "start", "end", "wall_s", "suite"):
        assert key in meta
    assert meta["complete"] and meta["suite"]["cases"][0]["model"] == "llama-tiny"
    none, invact, colam = res["points"]
    assert colam["skipped"] and "CoLA" in colam["skipped"]
    for p in (none, invact):
        assert p["skipped"] is None
        for key in ("saved_bytes", "ratio", "step_time_s", "step_time_ratio", "tokens_per_s",
                    "grad_cosine", "peak_allocated_bytes", "sites", "sites_block"):  # fmt: skip
            assert key in p, key
        assert len(p["train"]["losses"]) == 2 and p["train"]["val_loss"] > 0
        assert p["sites"] and all(s["bytes"] > 0 for s in p["sites"])
    assert none["ratio"] == 1.0 and 0 < invact["ratio"] < 1
    assert invact["grad_cosine"] > 0.999
    # the report renders it
    md = render(load_results(tmp_path / "bench"))
    assert "### llama-tiny" in md


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
