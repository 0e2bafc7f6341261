"""``slimact bench``: one command reproduces the benchmark report.

A *suite* (``quick`` | ``full`` | ``gpu`` | ``compiled``, :mod:`slimact.bench.suites`; what it is
made of, :mod:`slimact.bench.cases`) lists models and points
(strategies, and plain-PyTorch *anchors*, :mod:`slimact.bench.anchors`). The runner
(:mod:`slimact.bench.runner`) measures every point of a model case in one process, baseline
first: saved bytes (meter), the loss head's share, peak memory over a step (:mod:`slimact.peak`),
grad_cosine and a short training run; then it times all surviving points of the case in
interleaved rounds (:mod:`slimact.bench.timing_phase`, :mod:`slimact.timing`): median step-time
ratio with its spread, tokens/s, load average. Cases may set a vocabulary (random token ids,
e.g. llama-20m at V=32000). It writes ``benchmarks/results/bench/<suite>.json``. The report (:mod:`slimact.bench.report`, a pure
function of those files) writes ``benchmarks/results/bench.md`` with tables and PNG plots, then
rebuilds BENCHMARKS.md (:mod:`slimact.bench.document`).

    slimact bench quick
    slimact bench --report-only
"""

from slimact.bench.cases import BenchPoint, ModelCase, Suite
from slimact.bench.report import pareto_front, render, write_report
from slimact.bench.runner import run_suite
from slimact.bench.suites import SUITES, get_suite, suite_names

__all__ = [
    "SUITES",
    "BenchPoint",
    "ModelCase",
    "Suite",
    "get_suite",
    "pareto_front",
    "render",
    "run_suite",
    "suite_names",
    "write_report",
]
