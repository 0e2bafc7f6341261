"""``slimact bench``: run a named suite, write its results JSON, regenerate the report.

    slimact bench quick                  # a few minutes on CPU; then bench.md + BENCHMARKS.md
    slimact bench full --threads 2       # about an hour on a 2-core CPU
    slimact bench gpu                    # one lent GPU, <= 8 min: llama-350m bf16, the issue table
    slimact bench gpu --time-budget 300 --no-report   # what is left of a device call
    slimact bench quick --only-models llama-20m --only-strategies invact,int4
    slimact bench quick --compile        # every strategy in its compiled form, beside the anchors
    slimact bench --report-only          # regenerate the report from existing JSON
    slimact bench gpu --profile int4,compiled-refs:int4,invact --time-budget 85 --out-dir D
                                         # where a step's time goes, per point beside none:
                                         # D/gpu.profile.json, markdown on stdout

``python -m slimact.bench ...`` takes the same arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from slimact.bench.profile import markdown, profile_suite
from slimact.bench.report import write_report
from slimact.bench.runner import default_results_dir, run_suite
from slimact.bench.suites import get_suite, suite_names
from slimact.registry import add_compile_argument


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default=None, help="suite to run: quick | full | gpu")
    p.add_argument(
        "--only-models",
        type=_csv,
        default=None,
        help="comma-separated models (all their cases) or case labels, e.g. 'llama-20m (V=32000)'",
    )
    p.add_argument(
        "--only-strategies",
        type=_csv,
        default=None,
        help="comma-separated points (strategies or anchor:NAME); 'none' is always run",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: all cores)"
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="results JSON folder (default benchmarks/results/bench); the report goes to its parent",
    )
    p.add_argument(
        "--report-only", action="store_true", help="regenerate the report from existing JSON"
    )
    p.add_argument("--no-report", action="store_true", help="run and write JSON only")
    p.add_argument(
        "--data", default=None, help="a .txt/.jsonl file or folder instead of the corpus"
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds the run may take (the gpu suite's own: 450); points that would start past "
        "it are recorded as not run, and the max-batch phase keeps its reserve",
    )
    p.add_argument(
        "--profile",
        type=_csv,
        default=None,
        metavar="POINTS",
        help="instead of the suite's table: profile a few warm eager steps of these points "
        "(strategies, anchor:NAME, compiled-refs:STRATEGY; none is added first) on the suite's "
        "first model case and print where the time goes (slimact.bench.profile); writes "
        "<out-dir>/<suite>.profile.json",
    )
    add_compile_argument(p)


def report_paths(out_dir: Path) -> tuple[Path, Path | None]:
    """(bench.md, BENCHMARKS.md or None): the report lives in the results folder's parent; the
    repository's BENCHMARKS.md is rebuilt only when that parent is its benchmarks/results."""
    results = out_dir.parent
    root = results.parent.parent
    is_repo = results.name == "results" and (root / "benchmarks" / "build_report.py").is_file()
    return results / "bench.md", (root / "BENCHMARKS.md") if is_repo else None


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir) if args.out_dir else default_results_dir()
    if args.profile is not None:
        return _run_profile(args, out_dir)
    if not args.report_only:
        if args.suite is None:
            raise ValueError(f"name a suite ({', '.join(suite_names())}) or pass --report-only")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        suite = get_suite(args.suite)
        selection = {}
        if args.only_models or args.only_strategies:
            suite = suite.select(args.only_models, args.only_strategies)
            selection = {"models": args.only_models, "points": args.only_strategies}
        if args.compile:  # after the selection, which names the suite's own points
            suite = suite.compiled()
        if args.time_budget is not None:
            if not args.time_budget > 0:
                raise ValueError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
            suite = suite.override(time_budget_s=args.time_budget)
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
        command = "slimact bench " + " ".join(
            sys.argv[1:] if sys.argv[1:2] != ["bench"] else sys.argv[2:]
        )
        run_suite(
            suite,
            out_dir,
            threads=args.threads,
            data=args.data,
            selection=selection,
            command=command,
        )
    elif args.suite is not None:
        raise ValueError("--report-only takes no suite name")
    if args.no_report:
        return 0
    bench_md, benchmarks_md = report_paths(out_dir)
    for path in write_report(out_dir, bench_md, benchmarks_md=benchmarks_md):
        print(f"wrote {path}")
    return 0


def _run_profile(args: argparse.Namespace, out_dir: Path) -> int:
    """``--profile POINTS``: :func:`slimact.bench.profile.profile_suite` on the suite's first
    case (after ``--only-models``)."""
    if args.suite is None or args.report_only or args.compile or args.only_strategies:
        raise ValueError(
            "--profile takes a suite name and its own points (no --report-only, --compile or "
            "--only-strategies)"
        )
    suite = get_suite(args.suite)
    if args.only_models:
        suite = suite.select(args.only_models)
    if args.time_budget is not None:
        if not args.time_budget > 0:
            raise ValueError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
        suite = suite.override(time_budget_s=args.time_budget)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    path = out_dir / f"{suite.name}.profile.json"
    command = "slimact bench " + " ".join(
        sys.argv[1:] if sys.argv[1:2] != ["bench"] else sys.argv[2:]
    )
    result = profile_suite(suite, args.profile, path, data=args.data, command=command)
    print(markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slimact.bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"slimact bench: error: {e}", file=sys.stderr)
        return 2
