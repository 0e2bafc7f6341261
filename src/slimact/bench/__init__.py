"""``slimact bench``: one command reproduces the benchmark report (issue #9).

A *suite* (``quick`` | ``full`` | ``gpu``, :mod:`slimact.bench.suites`) lists models and points
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

_EXPORTS = {
    "SUITES": "slimact.bench.suites",
    "BenchPoint": "slimact.bench.suites",
    "ModelCase": "slimact.bench.suites",
    "Suite": "slimact.bench.suites",
    "get_suite": "slimact.bench.suites",
    "suite_names": "slimact.bench.suites",
    "pareto_front": "slimact.bench.report",
    "render": "slimact.bench.report",
    "write_report": "slimact.bench.report",
    "run_suite": "slimact.bench.runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Lazy exports: ``slimact bench --help`` stays light (no model registry, no matplotlib)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'slimact.bench' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
