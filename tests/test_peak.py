"""Peak memory over a step: exact on known allocations, and ordered as expected on a model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slimact import measure
from slimact.compare import train_step_fn
from slimact.models import build_model
from slimact.peak import peak_and_result, step_peak
from slimact.strategies import apply

MIB = 2**20


def test_cpu_peak_counts_live_bytes_above_the_start():
    keep = torch.ones(4 * MIB // 4)  # live before: never counted

    def fn():
        a = torch.ones(MIB // 4)  # 1 MiB
        b = torch.ones(2 * MIB // 4)  # 3 MiB live
        del a  # 2 MiB live
        c = torch.ones(MIB // 4)  # 3 MiB live again
        return b.numel() + c.numel()

    peak, out = peak_and_result(fn)
    assert peak == 3 * MIB and out == 3 * MIB // 4
    assert keep.numel()


def test_peak_rejects_other_devices():
    with pytest.raises(ValueError, match="cpu and cuda devices, got meta"):
        step_peak(lambda: None, "meta")


@pytest.mark.usefixtures("one_thread")
def test_model_step_peak_bounds_saved_bytes_and_drops_with_recompute():
    x = torch.randint(0, 257, (2, 64))
    peaks = {}
    for name in ("none", "recompute"):
        torch.manual_seed(0)
        model = apply(build_model("llama-tiny", vocab_size=257), name)
        step = train_step_fn(model, x, x)
        step()  # warm (lazy inits)
        peaks[name] = step_peak(step)
    torch.manual_seed(0)
    base = build_model("llama-tiny", vocab_size=257)
    with measure(base) as m:
        loss = base(x, targets=x).loss
    loss.backward()
    # the step's peak holds every saved activation at once, plus gradients and temporaries
    assert peaks["none"] > m.report.total_bytes
    assert peaks["recompute"] < peaks["none"]


def test_cpu_peak_prints_nothing_to_stderr():
    """Kineto's ``USDT: ... profiler_start`` lines must not reach the user's terminal."""
    code = (
        "import torch\n"
        "from slimact.peak import step_peak\n"
        "x = torch.randn(64, 64, requires_grad=True)\n"
        "assert step_peak(lambda: (x @ x).sum().backward()) > 0\n"
        "import sys; print('after', file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "USDT" not in out.stderr and "profiler_start" not in out.stderr
    assert out.stderr.strip().endswith("after")  # stderr itself still works afterwards
