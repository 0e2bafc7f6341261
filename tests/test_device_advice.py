"""On CUDA, lead with the peak and warn when the strategy is dominated on the device.

``slimact.compiled.advice``: the documented rule (eager codec policies on CUDA, with its
evidence) and the measured one (``slimact memory --compare-compiled``); ``slimact memory``'s and
``slimact train``'s summaries put the peak first on CUDA. CUDA results are faked here (the
rendering only reads the device string); the measured path runs on CPU in the slow test.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from slimact.cli import main, memory_advice, memory_lines
from slimact.compiled.advice import (
    CUDA_EVIDENCE,
    compiled_rivals,
    documented_dominance,
    measured_dominance,
)
from slimact.timing import RatioStats
from slimact.train.cli import print_summary, side_by_side_rows, summary_rows
from slimact.train.config import TrainConfig
from slimact.train.result import SideBySide, TrainResult

MIB = 2**20


@pytest.mark.parametrize("strategy", ["int4", "int8", "prac", "auto@25%", "invact+int4", "pac"])
def test_documented_rule_names_the_faster_point_and_its_evidence(strategy):
    line = documented_dominance(strategy, "cuda")
    assert line is not None and "\n" not in line
    assert f"eager {strategy} is likely dominated on CUDA" in line
    assert CUDA_EVIDENCE.faster in line and "--strategy recompute --compile" in line
    assert "BENCHMARKS.md §8" in line and "H200" in line and "--compare-compiled" in line
    if strategy == "int4":
        assert "eager int4 took 7.99x (peak 0.467)" in line and "auto@25%" not in line


@pytest.mark.parametrize(
    "strategy, device",
    [("int4", "cpu"), ("recompute", "cuda"), ("invact", "cuda"), ("compiled-int8", "cuda"),
     ("auto@5%", "cuda"), ("auto@2GiB", "cuda"), ("none", "cuda")],
)  # fmt: skip
def test_documented_rule_stays_silent_where_it_has_no_evidence(strategy, device):
    assert documented_dominance(strategy, device) is None


def test_measured_rule_takes_the_fastest_dominating_rival():
    me = {"strategy": "int4", "peak_bytes": 100 * MIB, "saved_bytes": 50 * MIB, "step_time_s": 1.0}
    rivals = [
        {"strategy": "compiled-int4", "peak_bytes": 90 * MIB, "saved_bytes": 60 * MIB,
         "step_time_s": 0.5},
        {"strategy": "compiled-recompute", "peak_bytes": 80 * MIB, "saved_bytes": 10 * MIB,
         "step_time_s": 0.3},
        {"strategy": "faster-but-bigger", "peak_bytes": 200 * MIB, "saved_bytes": 1,
         "step_time_s": 0.1},
        {"strategy": "failed"},
    ]  # fmt: skip
    line = measured_dominance(me, rivals, "cuda", {"compiled-recompute": "--compile"})
    assert line.startswith("warning: int4 is dominated on this device (cuda): compiled-recompute")
    assert "(--compile) peaks at 80.00 MiB (vs 100.00 MiB) in 0.30x its step" in line
    # off CUDA the saved bytes decide: the bigger-peaking rival that saves less wins
    assert "faster-but-bigger" in measured_dominance(me, rivals, "cpu")
    assert measured_dominance(me, rivals[:1], "cpu") is None  # saves more: not dominating
    assert measured_dominance({**me, "step_time_s": None}, rivals, "cuda") is None
    assert compiled_rivals("int4") == ["compiled-int4", "compiled-recompute"]
    assert compiled_rivals("auto@25%") == ["compiled-auto@25%", "compiled-recompute"]
    assert compiled_rivals("pac") == ["compiled-recompute"]  # no compiled form of its own
    assert compiled_rivals("recompute") == ["compiled-recompute"]
    assert compiled_rivals("compiled-recompute") == []


def _memory_result(device: str, rivals=()) -> dict:
    return {
        "model": "llama-20m", "strategy": "int4", "params": 1000, "batch": 16, "seq": 512,
        "device": device, "dtype": "bfloat16", "saved_bytes": 40 * MIB,
        "baseline_saved_bytes": 100 * MIB, "ratio": 0.4, "peak_bytes": 60 * MIB,
        "baseline_peak_bytes": 120 * MIB, "peak_ratio": 0.5, "step_time_s": 0.15,
        "baseline_step_time_s": 0.02, "step_time_ratio": 7.5, "loss": 5.0, "baseline_loss": 5.0,
        "step_time_ratio_spread": {"min": 7.0, "max": 8.0, "n": 10},
        "timing": {"load_before": 1.0}, "grad_cosine": 0.99, "rivals": list(rivals),
    }  # fmt: skip


def test_memory_leads_with_the_peak_on_cuda_and_warns_once():
    res = _memory_result("cuda:0")
    res["advice"] = memory_advice(res)
    lines = memory_lines(res)
    text = "\n".join(lines)
    assert text.index("peak over a step") < text.index("saved activations")
    assert "decides whether a run fits" in lines[2]
    assert lines[-1] == res["advice"] and "BENCHMARKS.md §8" in lines[-1]
    assert sum("warning" in line for line in lines) == 1
    cpu = _memory_result("cpu")
    cpu["advice"] = memory_advice(cpu)
    text = "\n".join(memory_lines(cpu))
    assert text.index("saved activations") < text.index("peak over a step")
    assert cpu["advice"] is None and "warning" not in text and "decides" not in text


def test_memory_measured_rivals_beat_the_documented_rule():
    rival = {"strategy": "compiled-recompute", "saved_bytes": 8 * MIB, "peak_bytes": 20 * MIB,
             "step_time_s": 0.015, "loss": 5.0}  # fmt: skip
    failed = {"strategy": "compiled-int4", "error": "UnverifiedOnDevice: not verified on cuda"}
    res = _memory_result("cuda", [rival, failed])
    res["advice"] = memory_advice(res)
    assert (
        "measured in this run" in res["advice"]
        and "compiled-recompute (--compile)" in res["advice"]
    )
    text = "\n".join(memory_lines(res))
    assert "compiled-recompute" in text.splitlines()[1]  # a column of its own
    assert "compiled-int4: not measured (UnverifiedOnDevice" in text
    # measured, and nothing dominates: no warning, not even the documented one
    slow = {**rival, "step_time_s": 1.0}
    res = _memory_result("cuda", [slow])
    assert memory_advice(res) is None


def _train_result(device: str, strategy: str = "int4") -> TrainResult:
    cfg = TrainConfig(model="llama-tiny", strategy=strategy, steps=2, batch=2, seq=32)
    base = SideBySide("train", 100 * MIB, 120 * MIB, 0.02, 5.0, 4.0, 4.1,
                      RatioStats.of([7.0, 8.0, 7.5]), 3)  # fmt: skip
    return TrainResult(
        config=cfg, run_dir=Path("runs/x"), device=device, params=1000, steps=2,
        final_train_loss=4.0, final_val_loss=4.1, final_val_ppl=60.0, tokens_per_s=1000.0,
        saved_bytes=40 * MIB, history=[], peak_bytes=60 * MIB, first_loss=5.0, step_time_s=0.15,
        baseline=base,
    )  # fmt: skip


def test_train_summary_leads_with_the_peak_on_cuda():
    rows = [k for k, _ in summary_rows(_train_result("cuda"))]
    assert rows[:3] == ["model", "strategy", "peak over fwd+bwd (1st step)"]
    assert "peak over fwd+bwd (1st step)" not in [k for k, _ in summary_rows(_train_result("cpu"))]
    side = [r[0] for r in side_by_side_rows(_train_result("cuda"))]
    assert side[:2] == ["peak over fwd+bwd (1st step)", "saved activations (1st step)"]
    side = [r[0] for r in side_by_side_rows(_train_result("cpu"))]
    assert side[:2] == ["saved activations (1st step)", "peak over fwd+bwd (1st step)"]
    out = io.StringIO()
    print_summary(_train_result("cuda"), Console(file=out, width=100))
    text = out.getvalue()
    warnings = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "BENCHMARKS.md §8" in warnings[0]  # one line, not wrapped
    assert "On CUDA the peak decides whether a run fits" in " ".join(text.split())
    out = io.StringIO()
    print_summary(_train_result("cuda", "recompute"), Console(file=out, width=100))
    assert "warning:" not in out.getvalue()


@pytest.mark.slow
def test_memory_compare_compiled_measures_the_compiled_forms(capsys, one_thread):
    """The measured path on a CPU: int8 beside compiled-int8 and compiled-recompute."""
    argv = ["memory", "--model", "llama-tiny", "--strategy", "int8", "--batch", "2", "--seq",
            "32", "--steps", "3", "--device", "cpu", "--compare-compiled", "--json"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    rivals = {r["strategy"]: r for r in res["rivals"]}
    assert list(rivals) == ["compiled-int8", "compiled-recompute"]
    for r in rivals.values():
        assert "error" not in r and r["step_time_s"] > 0 and r["peak_bytes"] > 0
        assert r["grad_cosine"] > 0.99 and 0 < r["ratio"] < 1
    assert rivals["compiled-recompute"]["saved_bytes"] < res["baseline_saved_bytes"]
    advice = res["advice"]
    assert advice is None or "measured in this run" in advice
