"""Assemble BENCHMARKS.md from the per-study summaries in benchmarks/results/*.md.

The logic lives in ``slimact.bench.document`` (``slimact bench --report-only`` uses it too, after
regenerating the side-by-side section from ``benchmarks/results/bench/*.json``); this script
only rebuilds BENCHMARKS.md from the summaries as they are.

    python benchmarks/build_report.py
"""

from __future__ import annotations

from pathlib import Path

from slimact.bench.document import INTRO, SECTIONS, demote
from slimact.bench.document import build as _build
from slimact.bench.document import write as _write

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

__all__ = ["INTRO", "RESULTS", "ROOT", "SECTIONS", "build", "demote", "main"]


def build(results: Path = RESULTS) -> str:
    return _build(results)


def main() -> None:
    out = _write(RESULTS, ROOT / "BENCHMARKS.md")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
