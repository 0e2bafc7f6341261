"""Adaptive policy evolution (adacc.txt §3.4, issue 18.3): what it changes over training.

    PYTHONPATH=src python benchmarks/bench_evolution.py --steps 200 --batch 4 --seq 128

Trains llama-20m three times on the same batches (same seed, the embedded corpus), one thread:
``none``; ``auto@<budget>`` with evolution (``slimact.train``'s evolver, ``EvolveConfig``
defaults: tracking steps 1, 2, 4, ..., 64, then every 64; re-solve at each, install on budget
overrun or a > 2% predicted speed-up); and the same ``auto`` with a *frozen* plan (the evolver
tracks and re-solves at the same steps but never installs: ``EvolveConfig(replan=False)``,
so both runs log the measured stored bytes against the budget at every tracking step). Both
``auto`` runs start from the same cached profile, hence the same first plan. Writes
``benchmarks/results/evolution.{json,md}``: the plan-change log per tracking step (measured
stored bytes vs budget, drifts of bytes / codec times / outlier channels, the verdict, the
changed sites), final train and validation losses against ``none``, step times, and the
machine, versions, load average and command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import slimact.train.loop as loop
from slimact.envinfo import machine_info
from slimact.planner.evolve import EvolveConfig, PlanEvolver
from slimact.timing import load_average
from slimact.train import TrainConfig, train
from slimact.utils import fmt_bytes

RESULTS = Path(__file__).parent / "results"


class FrozenEvolver(PlanEvolver):
    """Tracks and re-solves like the real one, never installs (the no-evolution arm)."""

    @classmethod
    def for_model(cls, model, **kwargs):  # type: ignore[no-untyped-def]
        return PlanEvolver.for_model(model, config=EvolveConfig(replan=False), **kwargs)


def run(arm: str, args: argparse.Namespace, work: Path) -> dict:
    strategy = "none" if arm == "none" else f"auto@{args.budget},repeats=1"
    loop.PlanEvolver = FrozenEvolver if arm == "auto-frozen" else PlanEvolver
    cfg = TrainConfig(
        model="llama-20m", strategy=strategy, steps=args.steps, batch=args.batch, seq=args.seq,
        eval_every=args.eval_every, eval_batches=args.eval_batches, out=str(work / arm),
        progress=False, baseline="off", threads=1, ckpt_every=0, keep_last=1, seed=0,
    )  # fmt: skip
    load0, t0 = load_average(), time.perf_counter()
    diverged = None
    try:
        res = train(cfg)
    except FloatingPointError as e:  # a non-finite loss: recorded, the other arms still run
        res, diverged = None, str(e)
    log = work / arm / "plan_changes.jsonl"
    events = [json.loads(s) for s in log.read_text().splitlines()] if log.exists() else []
    history = [json.loads(s) for s in (work / arm / "metrics.jsonl").read_text().splitlines()]
    return {
        "arm": arm,
        "strategy": strategy,
        "wall_s": time.perf_counter() - t0,
        "load_avg": [load0, load_average()],
        "diverged": diverged,
        "final_train_loss": res.final_train_loss if res else None,
        "final_val_loss": res.final_val_loss if res else None,
        "first_step_saved_bytes": res.saved_bytes if res else None,
        "step_time_s": res.step_time_s if res else None,
        "losses": [r["loss"] for r in history],
        "eval": [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r],
        "events": events,
    }


def markdown(out: dict) -> str:
    a = out["args"]
    none = next(r for r in out["runs"] if r["arm"] == "none")  # the first arm
    lines = [
        "# Adaptive policy evolution (adacc.txt §3.4)",
        "",
        f"llama-20m, `auto@{a['budget']}` vs `none`, {a['steps']} steps, batch {a['batch']} x "
        f"seq {a['seq']}, 1 thread, CPU. Command: `{out['command']}`. Machine: "
        f"{out['machine'].get('processor', '?')} x {out['machine'].get('cpu_count', '?')} cores, torch {out['machine'].get('torch', '?')}; load "
        f"average {out['load_avg'][0]} before, {out['load_avg'][1]} after.",
        "",
        "| arm | final train loss | vs none | final val loss | vs none | median step s | "
        "plan changes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in out["runs"]:
        n = sum(1 for e in r["events"] if e.get("applied"))
        if r["diverged"]:
            lines.append(f"| {r['arm']} | {r['diverged']} | | | | | {n} |")
            continue
        dt = r["final_train_loss"] / none["final_train_loss"] - 1
        dv = r["final_val_loss"] / none["final_val_loss"] - 1
        lines.append(
            f"| {r['arm']} | {r['final_train_loss']:.4f} | {dt:+.2%} | {r['final_val_loss']:.4f} "
            f"| {dv:+.2%} | {r['step_time_s'] or 0:.3f} | {n if r['arm'] != 'none' else '-'} |"
        )
    evals = {r["arm"]: dict(r["eval"]) for r in out["runs"]}
    steps = sorted({s for e in evals.values() for s in e})
    lines += [
        "",
        "Validation loss at the eval steps:",
        "",
        "| step | " + " | ".join(evals) + " |",
        "| ---: |" + " ---: |" * len(evals),
    ]
    for s in steps:
        cells = [f"{e[s]:.4f}" if s in e else "-" for e in evals.values()]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for r in out["runs"]:
        if not r["events"]:
            continue
        lines += [
            "",
            f"## {r['arm']}: tracking steps",
            "",
            "| step | measured stored | budget | measured/budget | bytes drift | time drift | "
            "outlier ch. (change) | verdict | sites changed | predicted s (current -> new) | "
            "track s | solve s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: |",
        ]
        for e in r["events"]:
            ratio = e["measured_bytes"] / e["budget_bytes"] if e["budget_bytes"] else 0.0
            lines.append(
                f"| {e['step']} | {fmt_bytes(e['measured_bytes'])} | "
                f"{fmt_bytes(e['budget_bytes'])} | {ratio:.3f} | {e['bytes_drift']:.3f} | "
                f"{e['time_drift']:.2f} | {e['outlier_channels']} ({e['outlier_change']:+d}) | "
                f"{e['reason']} | {e.get('n_differ', 0)} | "
                f"{e['current_time_s'] * 1e3:.1f} ms -> {e.get('predicted_time_s', 0) * 1e3:.1f}"
                f" ms | {e['track_s']:.2f} | {e.get('solve_s', 0):.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--budget", default="25%")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--arms", default="none,auto-evolve,auto-frozen")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    load0, machine = load_average(), machine_info()  # the commit the code was loaded from
    out = {
        "command": " ".join(["python", *sys.argv]),
        "args": vars(args) | {"out": str(args.out)},
        "machine": machine,
        "load_avg": [load0, None],
        "runs": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SLIMACT_CACHE_DIR"] = str(Path(tmp) / "profiles")  # one shared profile
        for arm in args.arms.split(","):
            out["runs"].append(run(arm, args, Path(tmp)))
            out["load_avg"][1] = load_average()
            (args.out / "evolution.json").write_text(json.dumps(out, indent=1))
            (args.out / "evolution.md").write_text(markdown(out))  # after every arm
    print(markdown(out))


if __name__ == "__main__":
    main()
