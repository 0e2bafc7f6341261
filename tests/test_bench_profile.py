"""``slimact bench SUITE --profile POINTS`` (``slimact.bench.profile``): per-step op, kernel and
sync counts of a few profiled eager steps, on CPU here; the CUDA counting on synthetic events."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from slimact.bench import cli as bench_cli
from slimact.bench import profile as bp
from slimact.bench.suites import get_suite


def _tiny_suite():
    return get_suite("gpu").override(
        model="llama-tiny", device="cpu", dtype="float32", batch=2, seq=32, vocab_size=300
    )


def test_profile_on_cpu_counts_the_codecs_ops_and_no_extra_sync(tmp_path, monkeypatch, capsys):
    """``int4`` codes every activation it saves: many more aten ops per step than ``none``, and
    no host read that ``none`` does not do (``none`` reads one: the model's token-id check)."""
    monkeypatch.setattr(bench_cli, "get_suite", lambda name: _tiny_suite())
    argv = ["gpu", "--profile", "int4", "--out-dir", str(tmp_path), "--threads", "1"]
    p = bench_cli.argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    assert bench_cli.run(p.parse_args(argv)) == 0
    res = json.loads((tmp_path / "gpu.profile.json").read_text())
    none, int4 = res["points"]
    assert [none["point"], int4["point"]] == ["none", "int4"] and res["meta"]["complete"]
    assert int4["aten_ops"] > 2 * none["aten_ops"] > 0
    assert none["syncs"] == 1 and none["sync_events"]["aten::_local_scalar_dense"] == 1
    assert int4["syncs"] == none["syncs"]
    assert none["kernels"] is None and none["device_ms"] is None  # no CUDA activity on a CPU
    assert none["step_ratio"] == 1.0 and int4["step_ms"] > 0 and int4["profiled_ms"] > 0
    assert any(r["name"].startswith("aten::") for r in int4["top_cpu"])
    out = capsys.readouterr().out
    assert "| `int4` |" in out and "top by self CPU time" in out


def test_points_put_none_first_and_refuse_what_they_cannot_run():
    assert bp.profile_points(["int4", "none", "compiled-refs:int4", "int4"]) == [
        "none",
        "int4",
        "compiled-refs:int4",
    ]
    assert bp.point_spec("compiled-refs:int4") == ("int4", True)
    with pytest.raises(ValueError, match="not an anchor"):
        bp.profile_points(["compiled-refs:anchor:torch-checkpoint"])
    with pytest.raises(ValueError, match="unknown"):
        bp.profile_points(["int5"])


def _ev(name, start, end, device=DeviceType.CPU, self_us=None, annotation=False):
    tr = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(
        name=name,
        device_type=device,
        time_range=tr,
        self_cpu_time_total=(end - start) if self_us is None else self_us,
        is_user_annotation=annotation,
    )


def test_cuda_figures_count_inside_the_steps_only():
    """Kernels, launches and syncs per step; the device's copy of the step range and the
    synchronize between steps (outside the ranges) are not counted."""
    cuda = DeviceType.CUDA
    events = [
        _ev(bp.STEP_RANGE, 0, 100),
        _ev(bp.STEP_RANGE, 200, 300),
        _ev(bp.STEP_RANGE, 10, 290, cuda, annotation=True),  # the range, on the device
        _ev("aten::mm", 10, 20),
        _ev("aten::mm", 210, 220),
        _ev("aten::item", 30, 40),
        _ev("aten::_local_scalar_dense", 31, 39),
        _ev("cudaLaunchKernel", 11, 12),
        _ev("cuLaunchKernel", 212, 213),
        _ev("cudaLaunchKernel", 214, 215),
        _ev("cudaStreamSynchronize", 33, 38),
        _ev("cudaDeviceSynchronize", 150, 190),  # between the steps: the profiler's own
        _ev("gemm_kernel", 12, 32, cuda),
        _ev("gemm_kernel", 215, 235, cuda),
        _ev("_quant_kernel", 216, 226, cuda),
        _ev("Memcpy DtoH (Device -> Pageable)", 33, 34, cuda),
    ]
    f = bp.step_figures(events)
    assert f["steps"] == 2 and f["profiled_ms"] == pytest.approx(0.1)
    assert f["kernels"] == 1.5 and f["launches"] == 1.5 and f["aten_ops"] == 2  # mm, item, its read
    assert f["launch_count"] == 2.5  # mm twice, item, its read, one Triton launch, in 2 steps
    assert f["syncs"] == 0.5  # cudaStreamSynchronize once in two steps
    assert f["sync_events"]["aten::item"] == 0.5
    assert f["sync_events"]["Memcpy DtoH (Device -> Pageable)"] == 0.5
    assert "cudaDeviceSynchronize" not in f["sync_events"]
    assert f["device_ms"] == pytest.approx(0.025)
    assert [r["name"] for r in f["top_device"]] == ["gemm_kernel", "_quant_kernel"]
    assert f["top_device"][0] == {"name": "gemm_kernel", "count": 1.0, "ms": 0.02}
    md = bp.markdown(
        {
            "meta": {
                "case": "c",
                "batch": 1,
                "seq": 2,
                "dtype": "d",
                "device": "cuda",
                "torch": "t",
            },  # fmt: skip
            "points": [{"point": "none", **f}, {"point": "int4", "skipped": "timed out"}],
        }
    )
    assert "| `none` |" in md and "not run: timed out" in md and "`gemm_kernel`" in md
