"""Planner benchmarks: solve speed, honesty of predictions, anchors, max batch (Adacc Table 3).

    PYTHONPATH=src python benchmarks/bench_planner.py --part speed     # llama-7b structure
    PYTHONPATH=src python benchmarks/bench_planner.py --part honesty   # llama-20m 10/25/50%
    PYTHONPATH=src python benchmarks/bench_planner.py --part anchors   # vs recompute, compile
    PYTHONPATH=src python benchmarks/bench_planner.py --part table3    # max batch at 24 GiB
    PYTHONPATH=src python benchmarks/bench_planner.py --part report    # planner.md from JSON

Each part merges its section into benchmarks/results/planner.json (machine, torch, threads and
the command recorded per section) and rewrites planner.md; text below the marker line
``<!-- reading -->`` in planner.md is kept. One torch thread unless --threads says otherwise.

Step times are taken in interleaved rounds in one process (``slimact.timing``: every compared
model once per round): ``honesty`` times the baseline and the three budgets' models together,
``anchors`` the baseline, auto, recompute-k and compiled models of one budget together. Ratios and
added seconds are medians of per-round values, with their min-max spread (``*_spread``); each
section's ``env`` records the load average. ``--results-dir`` writes elsewhere. Smoke::

    python benchmarks/bench_planner.py --part honesty --model llama-tiny --batch 1 --seq 16 \
        --budgets 25% --rounds 2 --results-dir /tmp/planner
    python benchmarks/bench_planner.py --part anchors --model llama-tiny --batch 1 --seq 16 \
        --budgets 25% --rounds 2 --results-dir /tmp/planner [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import slimact
from slimact.bench.document import write_summary
from slimact.codecs import codec_names
from slimact.envinfo import machine_info
from slimact.models import build_model, count_params
from slimact.planner import plan_for, profile_model
from slimact.planner.milp import Problem
from slimact.planner.plan import ROOT
from slimact.planner.solve import solve_plan
from slimact.timing import RatioStats, interleaved, load_average
from slimact.utils import fmt_bytes, seed_everything

RESULTS = Path(__file__).parent / "results"
JSON_PATH, MD_PATH = RESULTS / "planner.json", RESULTS / "planner.md"


def env(args) -> dict:
    """Machine, versions, git commit, command, date and load average (shared by every benchmark)."""
    return machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": load_average()}


def tokens(vocab: int, b: int, s: int, seed: int):
    t = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def fresh(name: str, seed: int = 0, **over):
    seed_everything(seed)
    return build_model(name, **over)


def step_fn(model, x, y):
    """One forward+backward of ``model`` (gradients freed first): a point to time."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x, targets=y).loss.backward()

    return step


def timed(models: dict, x, y, rounds: int):
    """``slimact.timing.interleaved`` over ``models``: one step of each per round, one warm-up."""
    return interleaved({k: step_fn(m, x, y) for k, m in models.items()}, rounds=rounds, warmup=1)


def replicate(prof, n_blocks: int):
    """A profile of ``n_blocks`` identical blocks from a profile of one or two."""
    for kind in prof.kinds:
        if kind.kind == ROOT:
            continue
        prefix = kind.blocks[0].rsplit(".", 1)[0]
        row = kind.per_block[kind.blocks[0]]
        kind.blocks = [f"{prefix}.{i}" for i in range(n_blocks)]
        kind.per_block = {b: row for b in kind.blocks}
    return prof


# -- parts --------------------------------------------------------------------------------------


def _speed_rows(prof) -> list[dict]:
    rows = []
    for layers in ("uniform", "ends", "each"):
        prob = Problem(prof, layers=layers, max_rel_err=0.25)
        n_vars = sum(
            len(g.rc) + len(g.rf) + sum(len(o) + 1 for o in g.options.values()) for g in prob.groups
        )
        for frac in (0.1, 0.25, 0.5):
            rows.append({"layers": layers, "budget": frac, "variables": n_vars, "prob": prob,
                         "times": []})  # fmt: skip
    # three rounds, every (layers, budget) problem solved once per round: the load hits them
    # alike (absolute solve times; no ratio between them is reported)
    for _ in range(3):
        for row in rows:
            prob = row["prob"]
            res = prob.solve(row["budget"] * prob.baseline_bytes)
            row["times"].append(res.solve_s)
            row.update(status=res.status, predicted_ratio=res.bytes / prob.baseline_bytes)
    for row in rows:
        del row["prob"]
        row["solve_s_median"] = statistics.median(row.pop("times"))
    return rows


def part_speed(args) -> dict:
    """Solve time of the MILP for the llama-7b structure (32 LLaMA blocks).

    (a) one llama-7b block profiled at batch 1 x seq ``--seq`` (PRAC/PAC/RAC left out: their
    basis P alone is n x 0.6n fp32 = 290 MB at n = 11008, so they cannot pay off at a few
    tokens, and building it takes minutes on this CPU), replicated to 32 blocks;
    (b) llama-20m's full profile (every codec, PRAC included) replicated to 32 blocks: the same
    LLaMA block structure with the full option set."""
    no_prac = tuple(c for c in codec_names() if c not in ("prac", "pac", "rac"))
    model = build_model("llama-7b", n_layers=1, max_seq_len=args.seq)
    x, y = tokens(32000, 1, args.seq, 0)
    t0 = time.perf_counter()
    prof = profile_model(model, x, y, codecs=no_prac, repeats=1, name="llama-7b-1layer")
    profile_s = time.perf_counter() - t0
    del model
    out = {"a": {"what": f"llama-7b block, batch 1 x seq {args.seq}, codecs {no_prac}, x32",
                 "profile_s": profile_s, "rows": _speed_rows(replicate(prof, 32))}}  # fmt: skip
    print(json.dumps(out["a"]), flush=True)
    m = fresh("llama-20m")
    x, y = tokens(m.config.vocab_size, 4, 256, 0)
    prof = replicate(_profile(args, m, x, y), 32)
    out["b"] = {"what": "llama-20m block (all codecs), batch 4 x seq 256, x32",
                "rows": _speed_rows(prof)}  # fmt: skip
    return out


def _profile(args, model, x, y):
    from slimact.planner.profile import cached_profile

    c = model.config  # llama-20m: "LlamaModel-d512-L6", the name its cached profiles have
    name = f"{type(model).__name__}-d{c.d_model}-L{c.n_layers}"
    return cached_profile(model, x, y, cache_dir=args.cache or None, name=name,
                          codecs=None, repeats=3, reform=True)  # fmt: skip


def part_honesty(args) -> dict:
    """Predicted vs measured saved bytes at each budget (10/25/50%), and per-layer freedom.

    The baseline and every budget's model are built first, then timed together in interleaved
    rounds: measured added seconds and step-time ratios are medians of per-round values."""
    b, s, name = args.batch, args.seq, args.model
    base_model = fresh(name)
    x, y = tokens(base_model.config.vocab_size, b, s, 0)
    x2, y2 = tokens(base_model.config.vocab_size, b, s, 1)
    base_bytes = saved_bytes(base_model, x, y)
    t0 = time.perf_counter()
    plan25 = plan_for(fresh(name), b, s, "25%", seed=0, cache=args.cache)
    plan_s = time.perf_counter() - t0
    rows, models = [], {"baseline": base_model}
    for budget in args.budgets.split(","):
        model = fresh(name)
        plan = plan_for(model, b, s, budget, seed=0, cache=args.cache)
        slimact.apply(model, plan)
        got = saved_bytes(model, x, y)
        with slimact.measure(model) as m:
            model(x2, targets=y2).loss.backward()
        got2 = m.report.total_bytes
        models[budget] = model
        rows.append({
            "budget": budget, "budget_bytes": plan.budget_bytes,
            "predicted_bytes": plan.predicted_bytes, "measured_bytes": got,
            "measured_other_batch": got2, "within_budget": got <= plan.budget_bytes,
            "prediction_error": (got - plan.predicted_bytes) / plan.predicted_bytes,
            "ratio": got / base_bytes, "predicted_added_s": plan.predicted_time_s,
            "solve_s": plan.solve_s,
            "recompute": sorted({p or "(block)" for lp in plan.layers for p in lp.recompute}),
            "reform": sorted({p for lp in plan.layers for p in lp.reform}),
            "codecs": sorted({c for lp in plan.layers for c, _ in lp.codecs}),
        })  # fmt: skip
    t = timed(models, x, y, args.rounds)
    for row in rows:
        k = row["budget"]
        added = RatioStats.of([a - z for a, z in zip(t.times[k], t.times["baseline"])])
        ratio = t.ratio(k, "baseline")
        row.update({
            "step_s": t.median_s(k), "baseline_step_s": t.median_s("baseline"),
            "measured_added_s": added.median, "measured_added_s_spread": added.to_dict(),
            "step_time_ratio": ratio.median, "step_time_ratio_spread": ratio.to_dict(),
        })  # fmt: skip
        print(json.dumps(row), flush=True)
    freedom = []
    prof = _profile(args, fresh(name), x, y)
    for frac in (0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.7):
        row = {"budget": frac}
        for layers in ("uniform", "ends", "each"):
            prob = Problem(prof, layers=layers, max_rel_err=0.25)
            res = prob.solve(frac * prob.baseline_bytes)
            row[layers] = res.time_s if res.status == "optimal" else None
        freedom.append(row)
    return {"model": name, "batch": b, "seq": s, "baseline_bytes": base_bytes,
            "plan_s_first (profile+solve)": plan_s, "rows": rows, "per_layer_freedom": freedom,
            "rounds": args.rounds, "timing_load_avg": [t.load_before, t.load_after],
            "table_25": plan25.table()}  # fmt: skip


def saved_bytes(model, x, y) -> int:
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(x, targets=y)
    out.loss.backward()
    return m.report.total_bytes


def compiled(model, x, y, budget: float):
    """``torch.compile`` (inductor) with ``activation_memory_budget``; (module, bytes, compile s)."""
    import torch._functorch.config as fcfg

    torch._dynamo.reset()
    fcfg.activation_memory_budget = budget
    cm = torch.compile(model)
    t0 = time.perf_counter()
    cm(x, targets=y).loss.backward()
    return cm, saved_bytes(cm, x, y), time.perf_counter() - t0


def by_blocks(k: int):
    return lambda mod, p: int(p.split(".")[-1]) < k


def part_anchors(args) -> dict:
    """Step time at equal measured bytes: auto vs per-block recompute vs torch.compile's budget.

    For each budget: auto's plan is applied and measured; ``recompute`` checkpoints the first k
    blocks, k the smallest with bytes <= auto's; torch.compile's ``activation_memory_budget`` is
    set to auto's bytes / the compiled graph's bytes at budget 1 (once more if it overshoots).
    Then all four (eager baseline, auto, recompute-k, compiled) are timed in interleaved rounds.

    Budgets are not interleaved with each other: the compiled model of one budget cannot coexist
    with another's (``activation_memory_budget`` is a global read when dynamo compiles, and dynamo
    caches per code object, so ``compiled`` resets dynamo for each budget). Each budget's row is
    its own interleaved set, with its own eager baseline; no ratio across rows is reported."""
    b, s, name = args.batch, args.seq, args.model
    base = fresh(name)
    x, y = tokens(base.config.vocab_size, b, s, 0)
    base_bytes = saved_bytes(base, x, y)
    n_layers = base.config.n_layers
    rec = []
    for k in range(n_layers + 1):
        m = slimact.apply(fresh(name), "recompute", filter_fn=by_blocks(k))
        rec.append((k, saved_bytes(m, x, y)))
    full = None if args.no_compile else compiled(fresh(name), x, y, 1.0)[1]
    rows = []
    for budget in args.budgets.split(","):
        auto = fresh(name)
        plan = plan_for(auto, b, s, budget, seed=0, cache=args.cache)
        slimact.apply(auto, plan)
        a_bytes = saved_bytes(auto, x, y)
        k, _ = next(((k, kb) for k, kb in rec if kb <= a_bytes), rec[-1])
        recm = slimact.apply(fresh(name), "recompute", filter_fn=by_blocks(k))
        models = {"baseline": base, "auto": auto, "recompute": recm}
        row = {"budget": budget, "auto_bytes": a_bytes, "recompute_blocks": k,
               "recompute_bytes": saved_bytes(recm, x, y)}  # fmt: skip
        if full is not None:
            frac = min(1.0, a_bytes / full)
            cm, c_bytes, c_s = compiled(fresh(name), x, y, frac)
            if c_bytes > a_bytes:
                frac *= a_bytes / c_bytes
                cm, c_bytes, c_s = compiled(fresh(name), x, y, frac)
            models["compile"] = cm
            row.update(compile_budget=frac, compile_bytes=c_bytes, compile_s=c_s,
                       compile_full_bytes=full)  # fmt: skip
        t = timed(models, x, y, args.rounds)
        row.update({f"{k}_step_s": t.median_s(k) for k in models})
        for other in ("recompute", "compile"):
            if other in models:  # median of per-round t(auto) / t(other)
                r = t.ratio("auto", other)
                row[f"auto_vs_{other}"] = r.median
                row[f"auto_vs_{other}_spread"] = r.to_dict()
        row["timing_load_avg"] = [t.load_before, t.load_after]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"model": name, "batch": b, "seq": s, "baseline_bytes": base_bytes,
            "rounds": args.rounds, "recompute_k_bytes": rec, "rows": rows,
            "auto_compiled": "not run: auto installs saved-tensor hooks and patches module "
            "forwards at run time; compiling it is untested"}  # fmt: skip


def part_table3(args) -> dict:
    """Max batch at a fixed device memory, from the meter's bytes per sample (Adacc Table 3)."""
    name, device_gib, s = args.t3_model, args.device_gib, args.t3_seq
    full = build_model(name, device="meta")
    n_layers, n_params = full.config.n_layers, count_params(name)
    m = fresh(name, n_layers=2, max_seq_len=s)
    x, y = tokens(m.config.vocab_size, 1, s, 0)
    static = 16 * n_params  # fp32 params + grads + AdamW m, v (4+4+8 bytes per parameter)
    out = {"model": name, "seq": s, "layers": n_layers, "params": n_params,
           "device_bytes": device_gib * 2**30, "static_bytes": static}  # fmt: skip
    per_sample = {}
    for strategy in ("none", "recompute", "int4"):
        mm = fresh(name, n_layers=2, max_seq_len=s)
        slimact.apply(mm, strategy)
        with slimact.measure(mm) as me:
            mm(x, targets=y).loss.backward()
        r = me.report
        per_sample[strategy] = (r.total_bytes - r.block_bytes) + r.block_bytes / 2 * n_layers
    prof = replicate(profile_model(m, x, y, repeats=1, name=name), n_layers)
    prob = Problem(prof, layers="uniform", max_rel_err=0.25)
    per_sample["auto"] = prob.min_bytes().bytes
    room = device_gib * 2**30 - static
    out["rows"] = [{"strategy": k, "bytes_per_sample": int(v), "max_batch": int(room // v)}
                   for k, v in per_sample.items()]  # fmt: skip
    batch = out["rows"][-1]["max_batch"]
    if batch >= 1:  # check: a plan at that batch fits (profile scaled by batch: linear bytes)
        plan = solve_plan(prof, int(room / batch), include_static=False, max_rel_err=0.25)
        out["auto_plan_at_max_batch"] = {"predicted_bytes_per_sample": plan.predicted_bytes,
                                         "recompute": sorted({p for lp in plan.layers
                                                              for p in lp.recompute})}  # fmt: skip
    return out


# -- report -------------------------------------------------------------------------------------


def _spread(x: dict, key: str, fmt: str = ".2f") -> str:
    """``1.07 (0.98-1.15)``: a median of per-round values with its min-max, where recorded
    (sections written before the interleaved rounds have no spread)."""
    sp = x.get(f"{key}_spread")
    if not sp:
        return "-" if x.get(key) is None else format(x[key], fmt)
    return f"{format(sp['median'], fmt)} ({format(sp['min'], fmt)}-{format(sp['max'], fmt)})"


def report(data: dict) -> str:
    lines = ["# Planner benchmarks (issue 7)", ""]
    for part, sec in data.items():
        e = sec.get("env", {})
        cores = e.get("cores", e.get("cpu_count"))  # older sections: cores / threads
        threads = e.get("threads", e.get("torch_threads"))
        load = f", load average {e['load_avg']:.2f}" if e.get("load_avg") is not None else ""
        lines += [f"## {part}", "", f"`{e.get('command')}`  ", f"{e.get('machine')}, "
                  f"{cores} cores, {threads} torch thread(s), torch "
                  f"{e.get('torch')}, {e.get('date')}{load}", ""]  # fmt: skip
        r = sec["result"]
        if part == "speed":
            for key in ("a", "b"):
                lines += [f"({key}) {r[key]['what']}", "",
                          "| layers | budget | binaries | solve time (median of 3) | status |",
                          "|---|---|---|---|---|"]  # fmt: skip
                lines += [f"| {x['layers']} | {x['budget']:.0%} | {x['variables']} | "
                          f"{x['solve_s_median'] * 1e3:.0f} ms | {x['status']} |"
                          for x in r[key]["rows"]] + [""]  # fmt: skip
        elif part == "honesty":
            lines += [
                "| budget | budget bytes | predicted | measured | error | within | other "
                "batch | ratio | predicted +s | measured +s | step-time ratio |",
                "|" + "---|" * 11,
            ]
            for x in r["rows"]:
                lines.append(
                    f"| {x['budget']} | {fmt_bytes(x['budget_bytes'])} | "
                    f"{fmt_bytes(x['predicted_bytes'])} | {fmt_bytes(x['measured_bytes'])} | "
                    f"{x['prediction_error']:+.2%} | {x['within_budget']} | "
                    f"{fmt_bytes(x['measured_other_batch'])} | {x['ratio']:.3f} | "
                    f"{x['predicted_added_s']:.3f} | {_spread(x, 'measured_added_s', '.3f')} | "
                    f"{_spread(x, 'step_time_ratio')} |"
                )
            if r.get("rounds"):
                lines += ["", f"Measured +s and step-time ratio vs the baseline: medians of "
                          f"per-round values over {r['rounds']} interleaved rounds of the "
                          "baseline and every budget's model (min-max)."]  # fmt: skip
            else:
                lines += ["", "Measured +s: each model timed after the other (recorded before "
                          "interleaved rounds), so it compares the machine's load too; no "
                          "spread."]  # fmt: skip
            lines += ["", "Per-layer freedom (predicted added seconds per step):", "",
                      "| budget | uniform | ends | each |", "|---|---|---|---|"]  # fmt: skip
            for x in r["per_layer_freedom"]:
                f = [("-" if x[k] is None else f"{x[k]:.4f}") for k in ("uniform", "ends", "each")]
                lines.append(f"| {x['budget']:.0%} | " + " | ".join(f) + " |")
            lines += ["", "```", r["table_25"], "```"]
        elif part == "anchors":
            lines += ["| budget | baseline s | auto bytes | auto s | recompute k | recompute "
                      "bytes | recompute s | compile budget | compile bytes | compile s | "
                      "auto/recompute | auto/compile |", "|" + "---|" * 12]  # fmt: skip
            for x in r["rows"]:
                c = (f"{x['compile_budget']:.3f} | {fmt_bytes(x['compile_bytes'])} | "
                     f"{x['compile_step_s']:.3f}") if "compile_bytes" in x else "- | - | -"  # fmt: skip
                ac = _spread(x, "auto_vs_compile")
                lines.append(
                    f"| {x['budget']} | {x['baseline_step_s']:.3f} | {fmt_bytes(x['auto_bytes'])}"
                    f" | {x['auto_step_s']:.3f} | {x['recompute_blocks']} | "
                    f"{fmt_bytes(x['recompute_bytes'])} | {x['recompute_step_s']:.3f} | {c} | "
                    f"{_spread(x, 'auto_vs_recompute')} | {ac} |"
                )
            lines += ["", f"Step times: medians of {r.get('rounds')} interleaved rounds of the "
                      "models of one budget (baseline, auto, recompute-k and, where run, compile), "
                      "eager unless 'compile'; auto/recompute and "
                      "auto/compile: medians of per-round ratios (min-max, where recorded). "
                      "Budgets are not interleaved with each other (each compiles anew). "
                      f"auto under torch.compile: {r['auto_compiled']}"]  # fmt: skip
        elif part == "table3":
            lines += [
                f"{r['model']} at seq {r['seq']}, {fmt_bytes(r['device_bytes'])} device, "
                f"static {fmt_bytes(r['static_bytes'])} (fp32 params+grads+AdamW)",
                "",
                "| strategy | activation bytes / sample | max batch |",
                "|---|---|---|",
            ]
            lines += [f"| {x['strategy']} | {fmt_bytes(x['bytes_per_sample'])} | "
                      f"{x['max_batch']} |" for x in r["rows"]]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    global RESULTS, JSON_PATH, MD_PATH
    p = argparse.ArgumentParser()
    p.add_argument("--part", required=True, choices=["speed", "honesty", "anchors", "table3",
                                                     "report"])  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--budgets", default="10%,25%,50%")
    p.add_argument("--cache", default="")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--model", default="llama-20m", help="honesty and anchors (llama family)")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="planner.{json,md} go here")
    p.add_argument("--t3-model", default="llama-350m")
    p.add_argument("--t3-seq", type=int, default=1024)
    p.add_argument("--device-gib", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    RESULTS = args.results_dir
    JSON_PATH, MD_PATH = RESULTS / "planner.json", RESULTS / "planner.md"
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    if args.part != "report":
        fn = {"speed": part_speed, "honesty": part_honesty, "anchors": part_anchors,
              "table3": part_table3}[args.part]  # fmt: skip
        data[args.part] = {"env": env(args), "result": fn(args)}
        JSON_PATH.write_text(json.dumps(data, indent=2, default=str))
    write_summary(MD_PATH, report(data))
    print(report({k: v for k, v in data.items() if k == args.part} or data))


if __name__ == "__main__":
    main()
