"""``slimact maxbatch``: doubling + bisection over measured step peaks under a memory cap."""

import json

import pytest
import torch

from slimact.bench.maxbatch import (
    MaxBatchConfig,
    max_batch,
    measure_peak,
    parse_cap,
    search,
    static_bytes,
    summary,
)
from slimact.cli import main
from slimact.models import build_model


def counting(limit_ok: int):
    calls = []

    def fits(b: int) -> bool:
        calls.append(b)
        return b <= limit_ok

    return fits, calls


def test_search_doubles_then_bisects():
    fits, calls = counting(37)
    assert search(fits, 1, 4096) == (37, False)
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubling until 64 misses
    assert sorted(set(calls[7:])) == sorted(calls[7:]) and all(32 < b < 64 for b in calls[7:])
    assert len(calls) == 7 + 5  # log2(64 - 32) bisection steps


def test_search_edges():
    assert search(counting(0)[0], 1, 64) == (0, False)  # not even the first batch fits
    assert search(counting(1000)[0], 1, 64) == (64, True)  # still fitting at the limit
    assert search(counting(50)[0], 3, 100) == (50, False)  # any start
    assert search(counting(5)[0], 5, 5) == (5, True)


def test_parse_cap():
    assert parse_cap("2GiB") == 2 * 2**30
    assert parse_cap("512MB") == 512 * 10**6
    assert parse_cap(4096) == 4096
    with pytest.raises(ValueError, match=r"cap '25%' is a share"):
        parse_cap("25%")
    with pytest.raises(ValueError, match=r"cap 'lots' is not a memory size"):
        parse_cap("lots")
    with pytest.raises(ValueError, match=r"cap '2' is not a memory size"):
        parse_cap("2")
    with pytest.raises(ValueError, match=r"cap '-1GiB' is not a memory size"):
        MaxBatchConfig(cap="-1GiB")


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="seq must be an int >= 1, got 0"):
        MaxBatchConfig(model="llama-tiny", seq=0, cap="1MiB")
    with pytest.raises(ValueError, match="unknown model 'llama-9z'"):
        MaxBatchConfig(model="llama-9z", cap="1MiB")
    with pytest.raises(ValueError, match="nonesuch"):
        MaxBatchConfig(model="llama-tiny", cap="1MiB", strategies="none,nonesuch")
    with pytest.raises(ValueError, match="start=9 exceeds limit=8"):
        MaxBatchConfig(model="llama-tiny", cap="1MiB", start=9, limit=8)
    cfg = MaxBatchConfig(model="llama-tiny", cap="1KiB", strategies="none, recompute")
    assert cfg.cap == 1024 and cfg.strategies == ("none", "recompute")


@pytest.mark.usefixtures("young_gc")  # each measured peak collects the garbage first
# the search and its prediction are one code path whatever the strategy (measure_peak applies
# it): recompute runs through max_batch in the fast test_summary_ratio_and_cli_json
@pytest.mark.parametrize("strategy", ["none", pytest.param("recompute", marks=pytest.mark.slow)])
def test_answer_predicted_from_measured_peaks(strategy):
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    probe = MaxBatchConfig(model="llama-tiny", seq=16, cap="1GiB", strategies=(strategy,))
    peaks = {b: measure_peak(base, strategy, b, probe) for b in range(1, 9)}
    assert all(peaks[b] < peaks[b + 1] for b in range(1, 8)), peaks  # grows with the batch
    static = static_bytes(base)
    for target in (3, 5):
        cap = static + (peaks[target] + peaks[target + 1]) // 2
        cfg = MaxBatchConfig(model="llama-tiny", seq=16, cap=cap, strategies=(strategy,), limit=8)
        (res,) = max_batch(cfg)
        assert res.max_batch == target and not res.hit_limit
        assert {t.batch: t.peak_bytes for t in res.trials} == {
            t.batch: peaks[t.batch] for t in res.trials
        }  # the same peaks as measured alone
        assert all(t.fits == (t.batch <= target) for t in res.trials)
    no_static = MaxBatchConfig(
        model="llama-tiny", seq=16, cap=peaks[4], strategies=(strategy,), limit=8,
        include_static=False,
    )  # fmt: skip
    assert max_batch(no_static)[0].max_batch == 4


@pytest.mark.usefixtures("young_gc")
def test_summary_ratio_and_cli_json(capsys):
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    probe = MaxBatchConfig(model="llama-tiny", seq=8, cap="1GiB", strategies=("none",))
    cap = static_bytes(base) + measure_peak(base, "none", 2, probe)
    argv = ["maxbatch", "--model", "llama-tiny", "--seq", "8", "--cap", f"{cap}B"]
    argv += ["--strategies", "none,recompute", "--limit", "4", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in data["results"]}
    assert rows["none"]["max_batch"] == 2 and rows["none"]["ratio_to_none"] == 1.0
    assert rows["recompute"]["max_batch"] >= 2
    assert data["config"]["cap"] == cap and "torch" in data["machine"]
    res = max_batch(MaxBatchConfig(model="llama-tiny", seq=8, cap=cap, strategies=("none",)))
    assert summary(probe, res)["results"][0]["peak_at_max_bytes"] <= cap


def test_cli_bad_cap_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["maxbatch", "--model", "llama-tiny", "--cap", "25%"])
    assert e.value.code == 2
    assert "cap '25%' is a share" in capsys.readouterr().err
