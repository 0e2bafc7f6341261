"""Codecs inside torch.compile (issue 16): compiled-int8/6/4 and the planner vs eager and compile.

    PYTHONPATH=src python benchmarks/bench_compiled.py                    # llama-20m, 8 x 256
    PYTHONPATH=src python benchmarks/bench_compiled.py --model llama-tiny --batch 1 --seq 16 \
        --rounds 2 --results-dir /tmp/compiled                             # smoke

Points, all in one process, fp32, one torch thread (unless --threads):

* ``eager-none``: the model as built (the baseline of every ratio);
* ``compiled-none``: ``slimact.hf.compile_blocks`` (each block's forward compiled, no budget);
* ``compile-budget (b)``: ``torch.compile`` (inductor) of the whole loss function with
  ``activation_memory_budget`` = b, for each b of --budgets. Each budget gets its own code object (dynamo caches
  compiled frames per code object and does not guard on the budget), and every point runs with
  its own budget patched in, so a recompile can never take another point's budget;
* ``compiled-int8`` / ``-int6`` / ``-int4``: ``slimact.compiled.compile_blocks_with`` (per-block
  compile, pack/unpack GraphModules inlined into the compiled graphs);
* ``eager-prac`` / ``compiled-prac``: PRAC eagerly (``prac``: a stateful codec per site, Q1
  refreshed every 5 steps) and as a traced codec in compiled blocks (Q1 from every step's X);
* ``compiled-invact``: ``invact`` (inverted activations and norms as custom ops) then
  ``compile_blocks``: the reformulation inside compiled blocks;
* ``compiled-invact-norms``: the same with norms only (``InvActConfig(ops=())``): under
  inductor a SwiGLU block already keeps the SiLU input and recomputes its output, so inverting
  SiLU saves nothing there;
* ``compiled-auto@<x>%`` (``--auto``): the compiled planner (``slimact.planner.compiled``: one
  region budget and traced codec per block, by MILP over measured options) given as budget the
  bytes each compile anchor keeps (measured first, as a share of eager none's metered bytes),
  and at 10%; one profile serves every budget.

Saved bytes: what one forward leaves alive (``slimact.compiled.forward_live_bytes``: the torch
profiler's memory events; loss included), measured on a call after compilation. For eager-none
the meter's exact count is recorded beside it (the cross-check). Gradient cosine vs eager-none
(exact autograd): over all parameters at once (``grad_cos``) and the minimum per parameter
(``grad_cos_min``, ``slimact.compare.grad_cosine``). Step time: ``slimact.timing.interleaved``
(every point once per round), median of per-round ratios to eager-none with min-max and IQR.
Writes benchmarks/results/compiled.json and compiled.md (text below ``<!-- reading -->`` kept).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections import Counter
from pathlib import Path

import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F

import slimact
from slimact.bench.document import write_summary
from slimact.bench.tables import pareto_front
from slimact.compare import grad_cosine
from slimact.compiled import TRACE_CALLS, compiled_saved_tensors, forward_live_bytes, own_code
from slimact.envinfo import machine_info
from slimact.hf import compile_blocks, graph_breaks
from slimact.models import build_model
from slimact.planner.compiled import CODECS as AUTO_CODECS
from slimact.planner.compiled import profile_compiled
from slimact.reformulate import InvActConfig
from slimact.state import state_of
from slimact.strategies.compiled_auto import CompiledAutoConfig, plan_compiled
from slimact.timing import interleaved, load_average
from slimact.utils import fmt_bytes, seed_everything

RESULTS = Path(__file__).parent / "results"
CODEC_POINTS = ("compiled-int8", "compiled-int6", "compiled-int4")


def env() -> dict:
    return machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": load_average()}


def loss_fn(model, x, y):
    return model(x, targets=y).loss


class Point:
    """A model, its forward, and the activation_memory_budget patched around every call."""

    def __init__(self, model, forward=loss_fn, budget: float = 1.0) -> None:
        self.model, self.forward, self.budget = model, forward, budget

    def loss(self, x, y):
        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.forward(self.model, x, y)

    def step(self, x, y):
        self.model.zero_grad(set_to_none=True)
        loss = self.loss(x, y)
        with functorch_config.patch(activation_memory_budget=self.budget):
            loss.backward()
        return float(loss.detach())

    def grads(self) -> torch.Tensor:
        return torch.cat([p.grad.flatten() for p in self.model.parameters()])


def compiled_saves(model, loss) -> dict[str, int]:
    """Bytes the compiled regions keep for backward, by dtype (unique storages, parameters
    and buffers excluded): walks ``loss``'s autograd graph to the ``CompiledFunctionBackward`` nodes."""
    held = [*model.parameters(), *model.buffers()]
    params = {t.untyped_storage().data_ptr() for t in held}
    seen_ptrs, out = set(params), {}
    for t in compiled_saved_tensors(loss):
        st = t.untyped_storage()
        if st.data_ptr() not in seen_ptrs:
            seen_ptrs.add(st.data_ptr())
            key = str(t.dtype).replace("torch.", "")
            out[key] = out.get(key, 0) + st.nbytes()
    return out


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    seed_everything(0)
    base = build_model(args.model)
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(0, base.config.vocab_size, (args.batch, args.seq + 1), generator=gen)
    x, y = t[:, :-1], t[:, 1:]

    points: dict[str, Point] = {"eager-none": Point(base)}
    m = copy.deepcopy(base)
    compile_blocks(m, backend="inductor")
    points["compiled-none"] = Point(m)
    for b in args.budgets:
        tag = f"budget_{str(b).replace('.', '_')}"
        fwd = torch.compile(own_code(loss_fn, tag), backend="inductor")
        points[f"compile-budget ({b})"] = Point(copy.deepcopy(base), fwd, b)
    for name in CODEC_POINTS:
        points[name] = Point(slimact.apply(copy.deepcopy(base), name))
    points["eager-prac"] = Point(slimact.apply(copy.deepcopy(base), "prac"))
    points["compiled-prac"] = Point(slimact.apply(copy.deepcopy(base), "compiled-prac"))
    inv = slimact.apply(copy.deepcopy(base), "invact")
    compile_blocks(inv, backend="inductor")
    points["compiled-invact"] = Point(inv)
    inv_norms = slimact.apply(copy.deepcopy(base), InvActConfig(ops=()))  # norms only
    compile_blocks(inv_norms, backend="inductor")
    points["compiled-invact-norms"] = Point(inv_norms)
    if args.auto:  # compiled-auto at each anchor's bytes (added after the anchors are measured)
        points["compiled-auto"] = None
    if args.only:  # eager-none stays: it is every ratio's baseline
        unknown = set(args.only) - set(points)
        if unknown:
            raise ValueError(f"--only: unknown point(s) {sorted(unknown)}; valid: {list(points)}")
        points = {k: p for k, p in points.items() if k == "eager-none" or k in args.only}

    rows: dict[str, dict] = {}
    points["eager-none"].step(x, y)
    exact = points["eager-none"].grads()
    exact_model = points["eager-none"].model
    with slimact.measure(base) as meter:
        points["eager-none"].loss(x, y)
    meter_bytes = meter.report.total_bytes
    if "compiled-auto" in points:
        del points["compiled-auto"]
        anchors = {k: p for k, p in points.items() if k.startswith("compile-budget")}
        for name, p in anchors.items():  # the anchors' bytes first: the plans' budgets
            t0 = time.perf_counter()
            p.step(x, y)
            rows[name] = {
                "first_step_s": time.perf_counter() - t0,
                "saved_bytes": forward_live_bytes(lambda p=p: p.loss(x, y))[0],
            }
        points.update(auto_points(base, x, y, args, meter_bytes, rows))
    for name, p in points.items():
        t0 = time.perf_counter()
        p.step(x, y)  # compiles
        first_s = time.perf_counter() - t0
        live, held = forward_live_bytes(lambda p=p: p.loss(x, y))
        in_graphs = compiled_saves(p.model, held)
        with slimact.measure(p.model) as m:  # the router sees the eager (root) saves only
            p.loss(x, y)
        del held
        p.step(x, y)  # the meter's TorchFunctionMode is guarded on: compiled again, untimed
        calls = dict(TRACE_CALLS)
        loss = p.step(x, y)
        rows[name] = (
            {"first_step_s": first_s}
            | rows.get(name, {})
            | {
                "saved_bytes": live,
                "compiled_saved_bytes_by_dtype": in_graphs,
                "meter_bytes_outside_compiled": m.report.total_bytes,
                "loss": loss,
                "grad_cos": float(F.cosine_similarity(p.grads().double(), exact.double(), dim=0)),
                "grad_cos_min": grad_cosine(exact_model, p.model),
                "hook_trace_calls_after_compile": {k: TRACE_CALLS[k] - calls[k] for k in calls},
            }
        )
        print(name, json.dumps(rows[name]), flush=True)
    rows = {k: rows[k] for k in points}  # in the points' order (eager-none first)
    base_bytes = rows["eager-none"]["saved_bytes"]
    for r in rows.values():
        r["bytes_ratio"] = r["saved_bytes"] / base_bytes

    steps = {k: (lambda p=p: p.step(x, y)) for k, p in points.items()}
    timing = interleaved(steps, args.rounds, alternate=args.alternate)
    for name in rows:
        rows[name]["step_s"] = timing.median_s(name)
        if name != "eager-none":
            rows[name]["step_ratio"] = timing.ratio(name, "eager-none").to_dict()
    anchors = ["compiled-none", *(f"compile-budget ({b})" for b in args.budgets)]
    pairs = [(a, b) for a in CODEC_POINTS for b in anchors]
    pairs += [("compiled-invact", "compiled-none"), ("compiled-invact-norms", "compiled-none")]
    pairs += [("compiled-prac", "eager-prac"), ("compiled-prac", "compiled-none")]
    for name, r in rows.items():  # each compiled-auto point against the anchor it was given
        if "anchor" in r:
            pairs += [(name, r["anchor"]), (name, "compiled-none")]
    pairs = [(a, b) for a, b in pairs if a in points and b in points]
    cross = {f"{a} / {b}": timing.ratio(a, b).to_dict() for a, b in pairs}
    return {
        "env": env(),
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": "float32",
        "budgets": args.budgets,
        "rounds": args.rounds,
        "alternate": args.alternate,
        "meter_bytes_eager_none": meter_bytes,
        "graph_breaks": graph_breaks(),
        "timing_load_avg": [timing.load_before, timing.load_after],
        "rows": rows,
        "cross_ratios": cross,
        "times_s": timing.times,
    }


def auto_points(base, x, y, args, meter_bytes: int, rows: dict) -> dict[str, Point]:
    """``compiled-auto`` given each compile anchor's measured bytes as its budget (a share of
    eager none's metered bytes, rounded down), plus ``compiled-auto@10%``; one profile of the
    model's blocks (every option of the grid) serves every budget."""
    codecs = tuple(args.auto_codecs)
    t0 = time.perf_counter()
    prof = profile_compiled(base, x, y, codecs=codecs, rounds=args.auto_rounds)
    print(f"compiled-auto profile: {time.perf_counter() - t0:.1f} s", flush=True)
    options = [  # one block of the (single) kind: what the MILP chose from
        {"option": s.choice.label, "bytes": s.bytes, "seconds": s.seconds, "grad_err": s.grad_err}
        for stats in prof.options.values()
        for s in stats
    ]
    budgets = [
        (math.floor(r["saved_bytes"] / meter_bytes * 1e6) / 1e4, name)
        for name, r in rows.items()
        if name.startswith("compile-budget")
    ]
    out = {}
    for pct, anchor in [*budgets, (10.0, None)]:
        model = copy.deepcopy(base)
        cfg = CompiledAutoConfig(budget=f"{pct:.4f}%", codecs=codecs)
        name = f"compiled-auto@{pct:.2f}%"
        try:
            plan_compiled(model, cfg, x, y, profile=prof)
        except ValueError as e:  # below the smallest compiled plan: say so, no point
            print(name, "infeasible:", e, flush=True)
            continue
        plan = state_of(model).compiled_plan
        out[name] = Point(model)
        rows[name] = {
            "anchor": anchor,
            "plan": [r["action"] for r in plan.rows() if r["block"] != "(root)"],
            "root": plan.root.label if plan.root is not None else "keep",
            "plan_predicted_bytes": plan.predicted_bytes,
            "plan_measured_bytes": plan.measured_bytes,
            "plan_allowed_bytes": plan.allowed_bytes,
            "profile_time_s": prof.profile_time_s,
            "profile_options": options,
        }
        print(name, plan.table(), flush=True)
    return out


def report(d: dict) -> str:
    e = d["env"]
    lines = [
        "# Codecs inside torch.compile (issue 16)",
        "",
        f"Model {d['model']}, batch {d['batch']} x seq {d['seq']}, {d['dtype']}, "
        f"{e['torch_threads']} torch thread(s); torch {e['torch']}, Python {e['python']}, "
        f"{e['processor']} ({e['cpu_count']} cores, shared), commit {e['git_commit']}, "
        f"{e['date']}.",
        f"Command: `{e['command']}` -> `benchmarks/results/compiled.json`.",
        f"Load average: {e['load_avg']} at start; {d['timing_load_avg']} around the "
        f"{d['rounds']} interleaved timing rounds.",
        "",
        "| point | saved bytes | vs eager none | step ratio (median [min-max]) | IQR | "
        "grad cos | min cos per param | first step s |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for name, r in d["rows"].items():
        s = r.get("step_ratio")
        ratio = f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]" if s else "1 (baseline)"
        iqr = f"{s['q1']:.3f}-{s['q3']:.3f}" if s else ""
        label = name
        lines.append(
            f"| {label} | {fmt_bytes(r['saved_bytes'])} | {r['bytes_ratio']:.3f} | {ratio} | "
            f"{iqr} | {r['grad_cos']:.5f} | {r['grad_cos_min']:.4f} | {r['first_step_s']:.1f} |"
        )
    lines += [
        "",
        "| step-time ratio (same rounds) | median [min-max] | IQR |",
        "| --- | --- | --- |",
    ]
    for k, c in d["cross_ratios"].items():
        lines.append(
            f"| {k} | {c['median']:.3f} [{c['min']:.3f}-{c['max']:.3f}] | "
            f"{c['q1']:.3f}-{c['q3']:.3f} |"
        )
    lines += [
        "",
        f"- Saved bytes: live bytes a forward leaves (torch profiler memory events, loss "
        f"included). Cross-check on eager none: meter {d['meter_bytes_eager_none']:,} B vs "
        f"profiler {d['rows']['eager-none']['saved_bytes']:,} B.",
        f"- Graph breaks (dynamo counter, whole run): {d['graph_breaks'] or 'none'}.",
        "- Where the bytes are: "
        + "; ".join(
            f"{k}: compiled graphs {_by_dtype(r['compiled_saved_bytes_by_dtype'])}, eager parts "
            f"(meter) {fmt_bytes(r['meter_bytes_outside_compiled'])}"
            for k, r in d["rows"].items()
            if k != "eager-none"
        )
        + ".",
        "- compiled-auto plans (per block, then the eager root; predicted / measured bytes, "
        "allowed): "
        + "; ".join(
            f"{k} (given {r['anchor'] or 'a 10% budget'}): {_counts(r['plan'])}, root "
            f"{r.get('root', 'keep')}; "
            f"{fmt_bytes(r['plan_predicted_bytes'])} / {fmt_bytes(r['plan_measured_bytes'])}, "
            f"{fmt_bytes(r['plan_allowed_bytes'])}"
            for k, r in d["rows"].items()
            if "plan" in r
        )
        + ".",
        "- compiled-auto's options (one block: bytes, fwd+bwd time vs its first option, "
        "gradient error; over 2e-3 not a candidate): "
        + "; ".join(
            f"{o['option']} {fmt_bytes(o['bytes'])}, {o['seconds'] / opts[0]['seconds']:.3f}, "
            f"{o['grad_err']:.1e}"
            for opts in [
                next(
                    (r["profile_options"] for r in d["rows"].values() if "profile_options" in r), []
                )
            ]
            for o in opts
        )
        + ".",
        "- Pareto front (saved bytes, median step ratio vs eager none; the anchors are "
        "`compile-budget`): " + _front(d["rows"]) + ".",
        "- Python calls of the traced pack/unpack helpers during a step after compilation "
        "(0 = the hooks are inlined, nothing runs per tensor): "
        + ", ".join(
            f"{k} {r['hook_trace_calls_after_compile']}"
            for k, r in d["rows"].items()
            if k.startswith("compiled-int")
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def _front(rows: dict) -> str:
    timed = [(k, r) for k, r in rows.items() if k == "eager-none" or "step_ratio" in r]
    xy = [
        (r["bytes_ratio"], r["step_ratio"]["median"] if "step_ratio" in r else 1.0)
        for _, r in timed
    ]
    return ", ".join(
        f"{timed[i][0]} ({xy[i][0]:.3f}, {xy[i][1]:.3f})"
        for i in sorted(pareto_front(xy), key=lambda i: xy[i][0])
    )


def _counts(actions: list[str]) -> str:
    return ", ".join(f"{n} x {a}" for a, n in Counter(actions).items())


def _by_dtype(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(d.items())) or "0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument(
        "--budgets",
        type=lambda t: [float(v) for v in t.split(",")],
        default=[0.5, 0.25, 0.1],
        help="comma-separated activation_memory_budget values of the compile anchors",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--alternate",
        action="store_true",
        help="every other round in reverse order (A B C | C B A): cancels a bias by position",
    )
    p.add_argument(
        "--only",
        type=lambda t: [v.strip() for v in t.split(",")],
        default=None,
        help="comma-separated points to run besides eager-none (default: all)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--auto",
        action="store_true",
        help="add compiled-auto points given each anchor's bytes as budget, and compiled-auto@10%%",
    )
    p.add_argument(
        "--auto-codecs",
        type=lambda t: [v.strip() for v in t.split(",")],
        default=list(AUTO_CODECS),
        help="traced codecs compiled-auto may use (default: the planner's grid)",
    )
    p.add_argument("--auto-rounds", type=int, default=5, help="compiled-auto's timing rounds")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument(
        "--report-only", action="store_true", help="re-render compiled.md from compiled.json"
    )
    args = p.parse_args()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        data = json.loads((args.results_dir / "compiled.json").read_text())
    else:
        data = run(args)
        (args.results_dir / "compiled.json").write_text(json.dumps(data, indent=2))
    md = args.results_dir / "compiled.md"
    write_summary(md, report(data))
    print(report(data))


if __name__ == "__main__":
    main()
