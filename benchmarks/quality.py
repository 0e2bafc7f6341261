"""Lossy actions over a training run: the validation-loss gap to ``none`` (BENCHMARKS.md §3).

    PYTHONPATH=src python benchmarks/quality.py --runs runs/quality            # ~2.5 h, 2 cores
    PYTHONPATH=src python benchmarks/quality.py --runs runs/quality --strategies none,int4

Each strategy trains llama-20m for ``--steps`` steps of 8 x 256 tokens with ``slimact train``'s
defaults (AdamW at 3e-3 with warm-up and cosine decay, clipping 0.5, the stdlib corpus, seed 0:
the same initial weights and the same batches for every strategy), one run per strategy in
``--runs/<name>`` (``--baseline off``: ``none`` is the reference run), evaluated every 50 steps
on the same 8 validation batches. A run whose ``metrics.jsonl`` already reaches the last step
is read, not run again; ``--parallel 2`` runs two at a time with one thread each. Reported:
the validation loss at each evaluation, its gap to ``none``'s, and the first step's saved bytes.

Writes ``benchmarks/results/quality.{json,md}`` (the md keeps its hand-written reading).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from slimact.bench.document import write_summary
from slimact.envinfo import machine_info
from slimact.timing import load_average

RESULTS = Path(__file__).parent / "results"
STRATEGIES = ("none", "int4", "int4@sr", "auto@25%")


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done(run: Path, steps: int) -> bool:
    return any(r.get("step") == steps and "eval_loss" in r for r in _rows(run / "metrics.jsonl"))


def command(strategy: str, run: Path, steps: int, threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "slimact", "train", "--steps", str(steps), "--no-progress"]
    cmd += ["--baseline", "off", "--ckpt-every", "0", "--out", str(run)]
    cmd += ["--threads", str(threads)] if threads else []
    return [*cmd, "--strategy", strategy]


def run_all(args, strategies: list[str]) -> None:
    todo = [s for s in strategies if not done(args.runs / _dirname(s), args.steps)]
    running: list[tuple[str, subprocess.Popen]] = []
    threads = 1 if args.parallel > 1 else 0
    while todo or running:
        while todo and len(running) < args.parallel:
            s = todo.pop(0)
            run = args.runs / _dirname(s)
            run.mkdir(parents=True, exist_ok=True)
            log = open(run / "train.log", "w")  # noqa: SIM115 (closed with the process)
            print(f"training {s} -> {run}", flush=True)
            running.append(
                (s, subprocess.Popen(command(s, run, args.steps, threads), stdout=log, stderr=log))
            )
        time.sleep(5)
        for s, p in list(running):
            if p.poll() is not None:
                running.remove((s, p))
                if p.returncode:
                    raise SystemExit(f"{s} failed (exit {p.returncode}): see its train.log")


def _dirname(strategy: str) -> str:
    return strategy.replace("@", "_").replace("%", "pct").replace("+", "_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("runs/quality"))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    strategies = args.strategies.split(",")
    if strategies[0] != "none":
        strategies = ["none", *[s for s in strategies if s != "none"]]
    load_before = load_average()
    run_all(args, strategies)
    evals: dict[str, dict[int, float]] = {}
    saved: dict[str, int] = {}
    for s in strategies:
        rows = _rows(args.runs / _dirname(s) / "metrics.jsonl")
        evals[s] = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
        saved[s] = next((r["saved_bytes"] for r in rows if "saved_bytes" in r), 0)
    steps = sorted(evals["none"])
    meta = {
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/quality.py " + " ".join(sys.argv[1:]),
        "load_average": [load_before, load_average()],
        "steps": args.steps,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = {"meta": meta, "evals": evals, "saved_bytes": saved}
    (args.results_dir / "quality.json").write_text(json.dumps(out, indent=1))
    m = meta["machine"]
    base = evals["none"]
    lines = [
        f"# Lossy actions over {args.steps} steps: the validation-loss gap to none",
        "",
        f"llama-20m, {args.steps} steps of 8 x 256 tokens, `slimact train`'s defaults (AdamW 3e-3, "
        "warm-up and cosine, clipping 0.5, seed 0: the same weights and batches for every run), "
        f"validation on 8 batches every 50 steps. {m['machine']}, {m['cpu_count']} cores, torch "
        f"{m['torch']}, commit {m['git_commit']}; {meta['date']}; load average {load_before} "
        f"before, {meta['load_average'][1]} after. Command: `{meta['command']}`.",
        "",
        "| strategy | saved bytes (1st step) | "
        + " | ".join(f"val @{k}" for k in steps)
        + f" | gap @{steps[-1]} |",
        "| --- | ---: | " + " | ".join("---:" for _ in steps) + " | ---: |",
    ]
    for s in strategies:
        ev = evals[s]
        cells = [f"{ev[k]:.4f}" if k in ev else "-" for k in steps]
        last = steps[-1]
        gap = f"{ev[last] / base[last] - 1:+.2%}" if last in ev else "-"
        share = f"{saved[s] / saved['none']:.3f} of none" if saved.get("none") else "-"
        lines.append(f"| `{s}` | {share} | " + " | ".join(cells) + f" | {gap} |")
    write_summary(args.results_dir / "quality.md", "\n".join(lines))


if __name__ == "__main__":
    main()
