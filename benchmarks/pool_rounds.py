"""Pool the interleaved rounds of several runs of one benchmark and read a bar off the pooled
median's confidence interval (issue 16's two timing bars).

    PYTHONPATH=src python benchmarks/pool_rounds.py                       # the committed runs

A bar such as "compiled invact at <= 1.0x compiled none" sits inside one run's spread on this
shared machine: runs of the same command give 0.99, 1.007, 1.005, 0.986. Each run's rounds are
already paired (both points timed in the same round, ``slimact.timing.interleaved``), so the
per-round ratios of every run are pooled and the median gets a 95% percentile-bootstrap
interval over rounds (``slimact.timing.median_ci``). The verdict (``slimact.timing.verdict``):
met if the whole interval is at or under the bar, missed if it is over, otherwise too close to
call. Runs differ in commit (the compared code unchanged, as each run's reading says) and, for
``compiled-auto``, in the plan the planner picked from its own profile: the pool is what a user
gets, not one plan. Reads ``times_s`` from ``benchmarks/bench_compiled.py``'s JSON; writes
``benchmarks/results/compiled_pooled.{json,md}`` (text below ``<!-- reading -->`` kept).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from slimact.bench.document import write_summary
from slimact.envinfo import machine_info
from slimact.timing import RatioStats, median_ci, verdict

RESULTS = Path(__file__).parent / "results"
RUNS = (
    "compiled_budgets.json",
    "compiled_10pct.json",
    "compiled_10pct_run2.json",
    "compiled_10pct_run3.json",
    "compiled_invact_norms_41.json",
    "compiled_invact_norms_241.json",
)
BARS = (  # point, baseline, bar on the step-time ratio (issue 16's "done when")
    ("compiled-auto@10.00%", "eager-none", 1.05),
    ("compiled-invact-norms", "compiled-none", 1.0),
)


def pool(runs: dict[str, dict], point: str, baseline: str, bar: float) -> dict:
    """Per-run medians, the pooled per-round ratios' median, its 95% interval and the verdict."""
    per_run, pooled = {}, []
    for name, d in runs.items():
        t = d["times_s"]
        if point not in t or baseline not in t:
            continue
        ratios = [a / b for a, b in zip(t[point], t[baseline]) if b > 0]
        r = d["rows"].get(point, {})
        per_run[name] = {
            "commit": d["env"].get("git_commit"),
            "rounds": len(ratios),
            "median": statistics.median(ratios),
            "bytes_ratio": r.get("bytes_ratio"),
        }
        pooled += ratios
    if len(pooled) < 2:
        raise ValueError(f"{point} / {baseline}: fewer than two rounds in {list(runs)}")
    ci = median_ci(pooled)
    return {
        "point": point,
        "baseline": baseline,
        "bar": bar,
        "runs": per_run,
        "pooled": RatioStats.of(pooled).to_dict(),
        "ci95": list(ci),
        "verdict": verdict(ci, bar),
    }


def report(d: dict) -> str:
    e = d["env"]
    lines = [
        "## Issue 16's timing bars, pooled over every run",
        "",
        f"Pooled from the committed runs of `benchmarks/bench_compiled.py` (llama-20m, batch 8 x "
        f"seq 256, fp32, 1 thread; {e['processor']}, {e['cpu_count']} shared cores, torch "
        f"{e['torch']}); pooled at commit {e['git_commit']}, {e['date']}.",
        f"Command: `{e['command']}` -> `benchmarks/results/compiled_pooled.{{json,md}}`.",
        "",
        "| point / baseline | bar | runs: median (rounds) | point's bytes vs eager none | "
        "pooled median [IQR], n | 95% CI of the median | verdict |",
        "| --- | ---: | --- | --- | --- | --- | --- |",
    ]
    for b in d["bars"]:
        runs = ", ".join(f"{r['median']:.3f} ({r['rounds']})" for r in b["runs"].values())
        sizes = [r["bytes_ratio"] for r in b["runs"].values() if r["bytes_ratio"] is not None]
        size = f"{min(sizes):.3f}-{max(sizes):.3f}" if sizes else "n/a"
        p, (lo, hi) = b["pooled"], b["ci95"]
        lines.append(
            f"| {b['point']} / {b['baseline']} | {b['bar']:.2f} | {runs} | {size} | {p['median']:.4f} "
            f"[{p['q1']:.3f}-{p['q3']:.3f}], {p['n']} | {lo:.4f}-{hi:.4f} | **{b['verdict']}** |"
        )
    lines += [
        "",
        "- Runs, in order: " + ", ".join(f"`{r}`" for r in d["files"]) + ".",
        "- A run's median is of its own rounds; the pooled median and its percentile-bootstrap "
        "interval (9999 resamples over rounds, seed 0) are of all rounds together.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), help="JSON files under --results")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    runs = {f: json.loads((args.results / f).read_text()) for f in args.runs}
    env = machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    d = {"env": env, "files": args.runs, "bars": [pool(runs, *b) for b in BARS]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "compiled_pooled.json").write_text(json.dumps(d, indent=1) + "\n")
    print(write_summary(args.out_dir / "compiled_pooled.md", report(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
