import json
import subprocess
import sys

import pytest

from slimact.cli import main


def test_memory_json_contract(capsys):
    rc = main(
        [
            "memory",
            "--model",
            "llama-tiny",
            "--strategy",
            "recompute",
            "--json",
            "--batch",
            "2",
            "--seq",
            "64",
            "--steps",
            "3",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["model"] == "llama-tiny" and res["strategy"] == "recompute"
    assert res["ratio"] < 0.25 and res["grad_cosine"] > 0.9999
    # peak over a whole step, both models; recompute's is lower (its activations are not kept)
    assert 0 < res["peak_bytes"] < res["baseline_peak_bytes"]
    assert res["baseline_peak_bytes"] > res["baseline_saved_bytes"]
    spread = res["step_time_ratio_spread"]  # interleaved rounds: median with its spread
    assert spread["n"] == 3 and spread["min"] <= res["step_time_ratio"] <= spread["max"]
    assert len(res["timing"]["times_s"]["baseline"]) == 3 and "load_before" in res["timing"]


def test_memory_table(capsys):
    assert (
        main(
            ["memory", "--model", "llama-tiny", "--strategy", "none", "--seq", "32", "--steps", "1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "saved activations" in out and "grad_cosine" in out and "peak over a step" in out
    assert "interleaved rounds" in out


def test_models_lists_counts(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["model"]: r["params"] for r in json.loads(capsys.readouterr().out)}
    assert rows["llama-60m"] == 58_073_600


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["memory", "--model", "nope"], "valid models"),
        (["memory", "--model", "llama-tiny", "--strategy", "nope"], "valid strategies"),
        (["memory", "--model", "llama-tiny", "--batch", "0"], "batch must be >= 1, got 0"),
        (["memory", "--model", "llama-tiny", "--seq", "100000"], "max_seq_len"),
    ],
)
def test_bad_input_is_a_clear_error(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_python_dash_m_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "slimact", "strategies"], capture_output=True, text=True, check=True
    )
    assert "recompute" in out.stdout


def test_budget_flag_maps_to_auto_spec():
    from slimact.registry import with_budget
    from slimact.strategies import resolve

    assert with_budget("auto", "30%") == "auto@30%"
    assert with_budget("invact+auto", "6GiB") == "invact+auto@6GiB"
    assert with_budget("none", None) == "none"
    with pytest.raises(ValueError, match="applies to strategy 'auto'"):
        with_budget("int4", "25%")
    assert str(resolve("auto@30%")[0].budget) == "30%"
