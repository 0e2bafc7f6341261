"""One-graph ``compile=True`` points (``recompute``, ``int8``, ...) against whole-model
``torch.compile`` at ``activation_memory_budget`` 0.1 and 0.25: saved bytes and step time, CPU,
interleaved rounds (A B C A B C ...) in one process; medians and spreads (max - min).

    PYTHONPATH=src python benchmarks/graph_vs_budget.py --model llama-tiny --batch 8 --seq 64 \
        --specs none,recompute,int8,auto@25%+graph --markdown

Every ratio is against whole-model compile @0.1 of the same run. Saved bytes: the distinct
storages the compiled graphs hold for backward (parameters excluded), read off the loss's graph
(``compiled.blocks.compiled_saved_tensors``).
"""

import argparse
import copy
import json
import statistics
import time

import torch
from torch._functorch import config as functorch_config

import slimact
from slimact.compiled.blocks import compiled_saved_tensors
from slimact.registry import applied_strategies

ANCHOR = "whole-model compile @0.1"


def _saved(loss, model):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}
    for t in compiled_saved_tensors(loss):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--specs",
        default="none,recompute,int8,auto@25%+graph",
        help="compile=True specs (or one-graph specs ending in +graph), comma-separated",
    )
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = slimact.build_model(a.model)
    v = base.config.vocab_size
    ids = torch.randint(0, v, (a.batch, a.seq))
    points = {}
    for spec in a.specs.split(","):  # auto plans on its first batch: the warm-up below
        graph = spec.endswith("+graph")  # written as the one-graph form: applied as it is
        m = slimact.apply(copy.deepcopy(base), spec, compile=not graph)
        form = "+".join(applied_strategies(m))
        points[f"compile=True {spec} ({form})"] = (m, None)
    for budget in (0.1, 0.25):
        w = copy.deepcopy(base)
        fn = torch.compile(w)  # whole model, a code object per budget
        points[f"whole-model compile @{budget}"] = (fn, budget)

    def step(fn, budget):
        with functorch_config.patch(activation_memory_budget=budget if budget else 1.0):
            out = fn(ids, targets=ids)
            out.loss.backward()
        return out

    saved = {}
    for name, (fn, budget) in points.items():
        model = fn if budget is None else fn._orig_mod
        for _ in range(2):  # compile, warm
            model.zero_grad(set_to_none=True)
            step(fn, budget)
        model.zero_grad(set_to_none=True)
        with functorch_config.patch(activation_memory_budget=budget or 1.0):
            out = fn(ids, targets=ids)
        saved[name] = _saved(out.loss, model)
        out.loss.backward()
    times = {k: [] for k in points}
    for _ in range(a.rounds):
        for name, (fn, budget) in points.items():
            model = fn if budget is None else fn._orig_mod
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(fn, budget)
            times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times[ANCHOR])
    rows = []
    for name in points:
        med = statistics.median(times[name])
        rows.append({
            "point": name, "saved_bytes": saved[name], "step_ms": med * 1e3,
            "spread_ms": (max(times[name]) - min(times[name])) * 1e3,
            "step_vs_anchor": med / ref, "saved_vs_anchor": saved[name] / saved[ANCHOR],
        })  # fmt: skip
    print(json.dumps({"model": a.model, "batch": a.batch, "seq": a.seq, "torch": torch.__version__,
                      "rounds": a.rounds, "rows": rows}, indent=1))  # fmt: skip
    if a.markdown:
        print("| point | saved MiB | saved / @0.1 | step ms (median) | spread ms | step / @0.1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(
                f"| {r['point']} | {r['saved_bytes'] / 2**20:.2f} | {r['saved_vs_anchor']:.3f} "
                f"| {r['step_ms']:.1f} | {r['spread_ms']:.1f} | {r['step_vs_anchor']:.2f} |"
            )


if __name__ == "__main__":
    main()
