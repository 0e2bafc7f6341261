"""The offload-under-compile measurement (``bench/offload_check.py``) on llama-tiny, CPU, with
the offload streams stubbed: every number of the GPU check is produced and consistent."""

from __future__ import annotations

import json

import pytest

from slimact.bench.offload_check import OffloadCheckConfig, main, run, table
from slimact.codecs.offload import using_streams


@pytest.mark.usefixtures("young_gc")  # its measurements collect the garbage first
def test_offload_check_on_llama_tiny(fake_streams, tmp_path):
    cfg = OffloadCheckConfig(
        model="llama-tiny", batch=2, seq=32, dtype="float32", device="cpu", budget="40%",
        offload_budget="17%", budgets=(1.0, 0.0), codecs=("none",), host_budget="1GiB",
        link_bw=1e15, rounds=1, seq_start=32, seq_cap=32, mem_cap=None, point_limit_s=30,
        cache=None, root_options=False, maxseq_points=("offload", "anchor:torch-checkpoint"),
    )  # fmt: skip
    with using_streams(fake_streams):
        out = run(cfg, log=lambda s: None)
    pts = out["points"]
    assert set(pts) == {"none", "plan", "offload"}
    # 17% is below what the plan without offload can keep (the root is 14.5% of eager's bytes
    # and each block keeps its input): the offload plan must offload
    assert pts["plan"]["host_bytes"] == 0 < pts["offload"]["host_bytes"]
    assert (
        pts["offload"]["device_bytes"] == pts["plan"]["device_bytes"] - pts["offload"]["host_bytes"]
    )
    assert "offload" in out["plans"]["offload"] and "offload" not in out["plans"]["plan"]
    for p in pts.values():  # float32 on CPU: every point's gradients are none's up to rounding
        assert p["min_grad_cos"] > 1 - 1e-9 and p["step_s"] > 0
        assert p["activation_peak"] > 0
    r = out["offload_vs_plan"]
    assert r["bytes_offloaded"] == pts["offload"]["host_bytes"] and r["step_ratio"] > 0
    ls = out["longest_seq"]
    assert ls["offload"]["longest"] == 32 and ls["offload"]["stopped"] == "cap"
    assert set(ls["offload"]["peaks"]) == {32} and ls["anchor:torch-checkpoint"]["longest"] == 32
    text = table(out)
    assert "| offload |" in text and "longest seq at batch 1" in text
    json.dumps(out, default=str)


def test_offload_check_command_line(tmp_path, monkeypatch):
    """A CPU run without stubbed streams is refused in one line (the link is measured on
    CUDA); with ``--link-bw`` the host budget is (offload needs CUDA). ``--cache none`` is no
    cache, not a folder named ``none``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="CUDA device"):
        main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32"])
    with pytest.raises(ValueError, match="in host memory already"):
        main(["--model", "llama-tiny", "--device", "cpu", "--dtype", "float32",
              "--link-bw", "1e10", "--cache", "none", "--rounds", "1", "--budgets", "0"])  # fmt: skip
    assert list(tmp_path.iterdir()) == []
