"""Planning a big model on a small machine (issue 18.5): the scaled profile's cost and honesty.

    PYTHONPATH=src python benchmarks/bench_planner_scaled.py --part cli7b    # the 7b command
    PYTHONPATH=src python benchmarks/bench_planner_scaled.py --part each32   # solve times
    PYTHONPATH=src python benchmarks/bench_planner_scaled.py --part slots    # 'each' +- slots
    PYTHONPATH=src python benchmarks/bench_planner_scaled.py --part honesty  # llama-130m vs meter
    PYTHONPATH=src python benchmarks/bench_planner_scaled.py --part report

``cli7b`` runs ``slimact plan --model llama-7b --batch 1 --seq 2048 --budget 25% --json`` under
``/usr/bin/time -v`` (wall time, peak RSS of the process) with the profile cached in
``--cache-dir``; ``each32`` loads that profile and times ``solve_plan`` at every ``--layers``
mode and budget (3 rounds, median; the Problem is built anew each time, as the CLI does);
``honesty`` plans llama-130m from a scaled profile (never building it for planning) and meters
the real llama-130m under each plan: predicted vs measured saved bytes. Each part merges its
section into ``benchmarks/results/planner_scaled.json`` with the machine and load average, and
rewrites ``planner_scaled.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import slimact
from slimact.envinfo import machine_info
from slimact.models import build_model
from slimact.planner import milp
from slimact.planner.scaled import ScaledConfig, cached_profile_scaled
from slimact.planner.solve import solve_plan
from slimact.timing import load_average
from slimact.utils import fmt_bytes, seed_everything

RESULTS = Path(__file__).parent / "results"
COMMAND = ["plan", "--model", "llama-7b", "--batch", "1", "--seq", "2048", "--budget", "25%",
           "--json"]  # fmt: skip


def env() -> dict:
    return machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": load_average()}


def part_cli7b(args) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-W", "ignore", "-m", "slimact", *COMMAND,
           "--cache", str(args.cache_dir)]  # fmt: skip
    load0 = load_average()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1))
    cpu = sum(float(re.search(rf"{k} time \(seconds\): ([\d.]+)", out.stderr).group(1))
              for k in ("User", "System"))  # fmt: skip
    d = json.loads(out.stdout)
    return {
        "command": "slimact " + " ".join(COMMAND) + f" --cache {args.cache_dir}",
        "wall_s": wall, "cpu_s": cpu, "max_rss_gib": rss_kib / 2**20, "solve_time_s": d["solve_time_s"],
        "profile_time_s": d["profile_time_s"], "profile": d["profile"],
        "predicted_ratio": d["predicted_bytes"] / d["baseline_bytes"],
        "baseline_bytes": d["baseline_bytes"], "load_before": load0, "load_after": load_average(),
    }  # fmt: skip


def part_each32(args) -> dict:
    cfg = ScaledConfig(max_tokens=64)
    prof = cached_profile_scaled("llama-7b", 1, 2048, cfg, cache_dir=args.cache_dir)
    rows = []
    for layers in ("uniform", "ends", "each"):
        for budget in ("10%", "25%", "50%"):
            times, totals = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                plan = solve_plan(prof, budget, layers=layers)
                totals.append(time.perf_counter() - t0)
                times.append(plan.solve_s)
            rows.append({"layers": layers, "budget": budget,
                         "solve_time_s": statistics.median(times),
                         "solve_plan_s": statistics.median(totals),
                         "predicted_ratio": plan.predicted_bytes / plan.baseline_bytes})  # fmt: skip
    return {"profile_cache_hit": prof.meta.get("cache_hit"), "rows": rows}


def part_slots(args) -> dict:
    """'each' on the cached llama-7b profile with and without slots: min_bytes + solve, wall
    and this process's CPU seconds (a shared machine's wall time measures its load too)."""
    cfg = ScaledConfig(max_tokens=64)
    prof = cached_profile_scaled("llama-7b", 1, 2048, cfg, cache_dir=args.cache_dir)
    rows = []
    for slots in (False, True):
        milp.SLOT_FROM = 5 if slots else 10**9
        for frac in (0.1, 0.25, 0.5):
            prob = milp.Problem(prof, layers="each")
            base = prob.baseline_bytes
            c0, w0 = time.process_time(), time.perf_counter()
            prob.min_bytes()
            res = prob.solve(frac * base)
            rows.append({"slots": slots, "budget": frac, "groups": len(prob.groups),
                         "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
                         "solve_time_s": res.solve_s, "added_s": res.time_s,
                         "predicted_ratio": res.bytes / base})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    milp.SLOT_FROM = 5
    return {"rows": rows}


def part_honesty(args) -> dict:
    b, s, name = args.batch, args.seq, "llama-130m"
    t0 = time.perf_counter()
    cfg = ScaledConfig(max_tokens=args.tokens)
    prof = cached_profile_scaled(name, b, s, cfg, cache_dir=args.cache_dir)
    profile_s = time.perf_counter() - t0
    ids = torch.randint(0, 32000, (b, s + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    rows = []
    for budget in args.budgets.split(","):
        plan = solve_plan(prof, budget)
        seed_everything(0)
        model = build_model(name).train()
        slimact.apply(model, plan)
        with slimact.measure(model) as m:
            out = model(x, targets=y)
        out.loss.backward()
        got = m.report.total_bytes
        rows.append({"budget": budget, "predicted_bytes": plan.predicted_bytes,
                     "measured_bytes": got, "error": plan.predicted_bytes / got - 1,
                     "baseline_bytes": plan.baseline_bytes})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del model
    return {"model": name, "batch": b, "seq": s, "profile_s": prof.meta["profile_s"],
            "wall_s": profile_s, "cache_hit": prof.meta.get("cache_hit"),
            "scaled": prof.meta["scaled"], "rows": rows}  # fmt: skip


def report(data: dict) -> str:
    lines = ["# Planning a big model on a small machine (issue 18.5)", ""]
    for part, sec in data.items():
        e, r = sec["env"], sec["result"]
        lines += [f"## {part}", "", f"{e.get('machine')}, {e.get('cpu_count')} cores, torch "
                  f"{e.get('torch')}, {e.get('date')}, load average {e.get('load_avg')}", ""]  # fmt: skip
        if part == "cli7b":
            lines += [f"`{r['command']}`", "",
                      f"wall {r['wall_s']:.1f} s (CPU user+sys {r['cpu_s']:.1f} s), peak RSS {r['max_rss_gib']:.2f} GiB, "
                      f"profile {r['profile_time_s']:.1f} s, solve {r['solve_time_s']:.3f} s, "
                      f"predicted {r['predicted_ratio']:.1%} of {fmt_bytes(r['baseline_bytes'])}"
                      f" (load {r['load_before']} -> {r['load_after']})", "",
                      f"scaling: {r['profile']['scaled']['rule']}"]  # fmt: skip
        elif part == "each32":
            lines += ["| layers | budget | solve_time_s | solve_plan (both solves) | predicted |",
                      "|---|---|---|---|---|"]  # fmt: skip
            lines += [f"| {x['layers']} | {x['budget']} | {x['solve_time_s']:.3f} | "
                      f"{x['solve_plan_s']:.3f} | {x['predicted_ratio']:.1%} |"
                      for x in r["rows"]]  # fmt: skip
        elif part == "slots":
            lines += ["llama-7b 1 x 2048, layers 'each': min_bytes + solve", "",
                      "| slots | budget | groups | wall s | CPU s | solve_time_s | added s/step |",
                      "|---|---|---|---|---|---|---|"]  # fmt: skip
            lines += [f"| {x['slots']} | {x['budget']:.0%} | {x['groups']} | {x['wall_s']:.3f} | "
                      f"{x['cpu_s']:.3f} | {x['solve_time_s']:.3f} | {x['added_s']:.2f} |"
                      for x in r["rows"]]  # fmt: skip
        elif part == "honesty":
            lines += [f"{r['model']} at {r['batch']} x {r['seq']}, scaled profile in "
                      f"{r['profile_s']:.1f} s ({r['scaled']['rule']})", "",
                      "| budget | predicted | measured | error |", "|---|---|---|---|"]  # fmt: skip
            lines += [f"| {x['budget']} | {fmt_bytes(x['predicted_bytes'])} | "
                      f"{fmt_bytes(x['measured_bytes'])} | {x['error']:+.3%} |"
                      for x in r["rows"]]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--part", required=True, choices=["cli7b", "each32", "slots", "honesty", "report"]
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", type=Path, default=Path("/tmp/slimact-scaled-profiles"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64, help="honesty: the twin's token cap")
    p.add_argument("--budgets", default="10%,25%,50%")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    jpath, mpath = args.results_dir / "planner_scaled.json", args.results_dir / "planner_scaled.md"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if args.part != "report":
        parts = {"cli7b": part_cli7b, "each32": part_each32, "slots": part_slots}
        fn = (parts | {"honesty": part_honesty})[args.part]
        section = {"env": env() | {"threads": args.threads}, "result": fn(args)}
        data = json.loads(jpath.read_text()) if jpath.exists() else {}  # read after: parts may
        data[args.part] = section  # run side by side
        jpath.write_text(json.dumps(data, indent=2, default=str))
    data = json.loads(jpath.read_text()) if jpath.exists() else {}
    mpath.write_text(report(data) + "\n")
    print(report({k: v for k, v in data.items() if k == args.part} or data))


if __name__ == "__main__":
    main()
