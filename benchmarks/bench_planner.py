"""Planner benchmarks: solve speed, honesty of predictions, anchors, max batch (Adacc Table 3).

    PYTHONPATH=src python benchmarks/bench_planner.py --part speed     # llama-7b structure
    PYTHONPATH=src python benchmarks/bench_planner.py --part honesty   # llama-20m 10/25/50%
    PYTHONPATH=src python benchmarks/bench_planner.py --part anchors   # vs recompute, compile
    PYTHONPATH=src python benchmarks/bench_planner.py --part table3    # max batch at 24 GiB
    PYTHONPATH=src python benchmarks/bench_planner.py --part report    # planner.md from JSON

Each part merges its section into benchmarks/results/planner.json (machine, torch, threads and
the command recorded per section) and rewrites planner.md; text below the marker line
``<!-- reading -->`` in planner.md is kept. One torch thread unless --threads says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import slimact
from slimact.codecs import codec_names
from slimact.envinfo import machine_info
from slimact.models import build_model, count_params
from slimact.planner import plan_for, profile_model
from slimact.planner.milp import Problem, solve_plan
from slimact.planner.plan import ROOT
from slimact.utils import fmt_bytes, seed_everything

RESULTS = Path(__file__).parent / "results"
JSON_PATH, MD_PATH = RESULTS / "planner.json", RESULTS / "planner.md"
MARK = "<!-- reading -->"


def env(args) -> dict:
    """Machine, versions, git commit and command (shared by every benchmark)."""
    return machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S")}


def tokens(vocab: int, b: int, s: int, seed: int):
    t = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def fresh(name: str, seed: int = 0, **over):
    seed_everything(seed)
    return build_model(name, **over)


def measure_step(model, x, y, steps: int = 3) -> tuple[int, float]:
    """(saved bytes of the first step, median step time of ``steps`` after one warm-up)."""
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(x, targets=y)
    out.loss.backward()
    times = []
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(x, targets=y).loss.backward()
        if i:
            times.append(time.perf_counter() - t0)
    return m.report.total_bytes, statistics.median(times)


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
            times = []
            for _ in range(3):
                res = prob.solve(frac * prob.baseline_bytes)
                times.append(res.solve_s)
            rows.append({"layers": layers, "budget": frac, "variables": n_vars,
                         "solve_s_median": statistics.median(times), "status": res.status,
                         "predicted_ratio": res.bytes / prob.baseline_bytes})  # fmt: skip
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
    prof = replicate(_llama20m_profile(args, m, x, y), 32)
    out["b"] = {"what": "llama-20m block (all codecs), batch 4 x seq 256, x32",
                "rows": _speed_rows(prof)}  # fmt: skip
    return out


def _llama20m_profile(args, model, x, y):
    from slimact.planner.profile import cached_profile

    return cached_profile(model, x, y, cache_dir=args.cache or None, name="LlamaModel-d512-L6",
                          codecs=None, repeats=3, reform=True)  # fmt: skip


def part_honesty(args) -> dict:
    """llama-20m: predicted vs measured saved bytes at 10/25/50%, and per-layer freedom."""
    b, s = args.batch, args.seq
    base_model = fresh("llama-20m")
    x, y = tokens(base_model.config.vocab_size, b, s, 0)
    x2, y2 = tokens(base_model.config.vocab_size, b, s, 1)
    base_bytes, base_t = measure_step(base_model, x, y)
    t0 = time.perf_counter()
    plan25 = plan_for(fresh("llama-20m"), b, s, "25%", seed=0, cache=args.cache)
    plan_s = time.perf_counter() - t0
    rows = []
    for budget in ("10%", "25%", "50%"):
        model = fresh("llama-20m")
        plan = plan_for(model, b, s, budget, seed=0, cache=args.cache)
        slimact.apply(model, plan)
        got, t = measure_step(model, x, y)
        with slimact.measure(model) as m:
            model(x2, targets=y2).loss.backward()
        got2 = m.report.total_bytes
        rows.append({
            "budget": budget, "budget_bytes": plan.budget_bytes,
            "predicted_bytes": plan.predicted_bytes, "measured_bytes": got,
            "measured_other_batch": got2, "within_budget": got <= plan.budget_bytes,
            "prediction_error": (got - plan.predicted_bytes) / plan.predicted_bytes,
            "ratio": got / base_bytes, "predicted_added_s": plan.predicted_time_s,
            "step_s": t, "baseline_step_s": base_t, "measured_added_s": t - base_t,
            "solve_s": plan.solve_s,
            "recompute": sorted({p or "(block)" for lp in plan.layers for p in lp.recompute}),
            "reform": sorted({p for lp in plan.layers for p in lp.reform}),
            "codecs": sorted({c for lp in plan.layers for c, _ in lp.codecs}),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    freedom = []
    prof = _llama20m_profile(args, fresh("llama-20m"), x, y)
    for frac in (0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.7):
        row = {"budget": frac}
        for layers in ("uniform", "ends", "each"):
            prob = Problem(prof, layers=layers, max_rel_err=0.25)
            res = prob.solve(frac * prob.baseline_bytes)
            row[layers] = res.time_s if res.status == "optimal" else None
        freedom.append(row)
    return {"model": "llama-20m", "batch": b, "seq": s, "baseline_bytes": base_bytes,
            "plan_s_first (profile+solve)": plan_s, "rows": rows, "per_layer_freedom": freedom,
            "table_25": plan25.table()}  # fmt: skip


def saved_bytes(model, x, y) -> int:
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(x, targets=y)
    out.loss.backward()
    return m.report.total_bytes


def interleaved(models: dict, x, y, rounds: int) -> dict[str, float]:
    """Median step time of each model, timed in rounds (one step of each per round), so that
    the machine's changing load hits every model alike."""
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 1):
        for k, m in models.items():
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            m(x, targets=y).loss.backward()
            if r:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


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
    Then all four (eager baseline, auto, recompute-k, compiled) are timed in interleaved rounds."""
    b, s = args.batch, args.seq
    base = fresh("llama-20m")
    x, y = tokens(base.config.vocab_size, b, s, 0)
    base_bytes = saved_bytes(base, x, y)
    n_layers = base.config.n_layers
    rec = []
    for k in range(n_layers + 1):
        m = slimact.apply(fresh("llama-20m"), "recompute", filter_fn=by_blocks(k))
        rec.append((k, saved_bytes(m, x, y)))
    full = None if args.no_compile else compiled(fresh("llama-20m"), x, y, 1.0)[1]
    rows = []
    for budget in args.budgets.split(","):
        auto = fresh("llama-20m")
        plan = plan_for(auto, b, s, budget, seed=0, cache=args.cache)
        slimact.apply(auto, plan)
        a_bytes = saved_bytes(auto, x, y)
        k, _ = next(((k, kb) for k, kb in rec if kb <= a_bytes), rec[-1])
        recm = slimact.apply(fresh("llama-20m"), "recompute", filter_fn=by_blocks(k))
        models = {"baseline": base, "auto": auto, "recompute": recm}
        row = {"budget": budget, "auto_bytes": a_bytes, "recompute_blocks": k,
               "recompute_bytes": saved_bytes(recm, x, y)}  # fmt: skip
        if full is not None:
            frac = min(1.0, a_bytes / full)
            cm, c_bytes, c_s = compiled(fresh("llama-20m"), x, y, frac)
            if c_bytes > a_bytes:
                frac *= a_bytes / c_bytes
                cm, c_bytes, c_s = compiled(fresh("llama-20m"), x, y, frac)
            models["compile"] = cm
            row.update(compile_budget=frac, compile_bytes=c_bytes, compile_s=c_s,
                       compile_full_bytes=full)  # fmt: skip
        t = interleaved(models, x, y, args.rounds)
        row.update({f"{k}_step_s": v for k, v in t.items()})
        row["baseline_step_s"] = t["baseline"]
        row["auto_vs_recompute"] = t["auto"] / t["recompute"]
        if "compile" in t:
            row["auto_vs_compile"] = t["auto"] / t["compile"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"model": "llama-20m", "batch": b, "seq": s, "baseline_bytes": base_bytes,
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


def report(data: dict) -> str:
    lines = ["# Planner benchmarks (issue 7)", ""]
    for part, sec in data.items():
        e = sec.get("env", {})
        lines += [f"## {part}", "", f"`{e.get('command')}`  ", f"{e.get('machine')}, "
                  f"{e.get('cores')} cores, {e.get('threads')} torch thread(s), torch "
                  f"{e.get('torch')}, {e.get('date')}", ""]  # fmt: skip
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
                "batch | ratio | predicted +s | measured +s |",
                "|" + "---|" * 10,
            ]
            for x in r["rows"]:
                lines.append(
                    f"| {x['budget']} | {fmt_bytes(x['budget_bytes'])} | "
                    f"{fmt_bytes(x['predicted_bytes'])} | {fmt_bytes(x['measured_bytes'])} | "
                    f"{x['prediction_error']:+.2%} | {x['within_budget']} | "
                    f"{fmt_bytes(x['measured_other_batch'])} | {x['ratio']:.3f} | "
                    f"{x['predicted_added_s']:.3f} | {x['measured_added_s']:.3f} |"
                )
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
                ac = f"{x['auto_vs_compile']:.2f}" if "auto_vs_compile" in x else "-"
                lines.append(
                    f"| {x['budget']} | {x['baseline_step_s']:.3f} | {fmt_bytes(x['auto_bytes'])}"
                    f" | {x['auto_step_s']:.3f} | {x['recompute_blocks']} | "
                    f"{fmt_bytes(x['recompute_bytes'])} | {x['recompute_step_s']:.3f} | {c} | "
                    f"{x['auto_vs_recompute']:.2f} | {ac} |"
                )
            lines += ["", f"Step times: medians of {r.get('rounds')} interleaved rounds, eager "
                      f"unless 'compile'. auto under torch.compile: {r['auto_compiled']}"]  # fmt: skip
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
    p = argparse.ArgumentParser()
    p.add_argument("--part", required=True, choices=["speed", "honesty", "anchors", "table3",
                                                     "report"])  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--budgets", default="10%,25%,50%")
    p.add_argument("--cache", default="")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (anchors)")
    p.add_argument("--t3-model", default="llama-350m")
    p.add_argument("--t3-seq", type=int, default=1024)
    p.add_argument("--device-gib", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    if args.part != "report":
        fn = {"speed": part_speed, "honesty": part_honesty, "anchors": part_anchors,
              "table3": part_table3}[args.part]  # fmt: skip
        data[args.part] = {"env": env(args), "result": fn(args)}
        JSON_PATH.write_text(json.dumps(data, indent=2, default=str))
    reading = ""
    if MD_PATH.exists() and MARK in MD_PATH.read_text():
        reading = MD_PATH.read_text().split(MARK, 1)[1]
    MD_PATH.write_text(report(data) + "\n" + MARK + reading)
    print(report({k: v for k, v in data.items() if k == args.part} or data))


if __name__ == "__main__":
    main()
