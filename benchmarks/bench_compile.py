"""Eager vs torch.compile (inductor, CPU) per strategy: step time and saved bytes.

``slimact.hf.compile_blocks`` compiles every block's forward; the root stays eager (see
``slimact.hf``). Codec strategies (int4, prac) are left eager by design and reported as such.
Step time: per strategy, the eager and the compiled model are timed in ``--steps`` interleaved
rounds (eager, compiled, eager, ...; ``slimact.timing``) after 2 warm-up rounds (the first
compiled call, which compiles, is excluded and reported separately); ``speedup`` is the median
of per-round t(eager) / t(compiled), ``speedup_spread`` its spread. Strategies are not
interleaved with each other: each compiles after ``torch._dynamo.reset()`` (dynamo caches per
code object, and every strategy's blocks share LlamaBlock.forward), so one strategy's compiled
model cannot be kept beside another's; no ratio across strategies is reported.
torch.set_num_threads(--threads); the JSON's meta records the load average.

    PYTHONPATH=src python benchmarks/bench_compile.py [--model llama-20m --batch 2 --seq 128]
    python benchmarks/bench_compile.py --model llama-tiny --batch 1 --seq 16 --steps 2 \
        --strategies none,int4 --out /tmp/compile.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import slimact
from slimact import hf
from slimact.timing import interleaved, load_average

STRATEGIES = ("none", "recompute", "invact", "invact+recompute", "int4", "prac")


def build(name: str, strategy: str):
    torch.manual_seed(0)
    return slimact.apply(slimact.build_model(name), strategy)


def first_step(model, x, y):
    """(saved bytes, seconds, gradients) of one metered forward+backward (compiles if compiled)."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with slimact.measure(model, n_tokens=x.numel()) as m:
        loss = model(x, targets=y).loss
    loss.backward()
    first = time.perf_counter() - t0
    grads = [p.grad.clone() for p in model.parameters()]
    return m.report.total_bytes, first, grads


def step_fn(model, x, y):
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x, targets=y).loss.backward()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-20m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--out", default="benchmarks/results/compile.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 257, (a.batch, a.seq + 1), generator=gen)
    x, y = tok[:, :-1], tok[:, 1:]
    rows = []
    for strategy in a.strategies.split(","):
        eager = build(a.model, strategy)
        e_bytes, _, e_grads = first_step(eager, x, y)
        model = build(a.model, strategy)
        torch._dynamo.reset()  # strategies one after the other: see the module docstring
        changes = hf.compile_blocks(model, backend="inductor")
        compiled = not any(c.skipped for c in changes)
        c_bytes, c_first, c_grads = first_step(model, x, y)
        t = interleaved(
            {"eager": step_fn(eager, x, y), "compiled": step_fn(model, x, y)},
            rounds=a.steps,
            warmup=2,
        )
        speedup = t.ratio("eager", "compiled")
        rel = max(
            float((g - h).abs().max() / (h.abs().max() + 1e-12)) for g, h in zip(c_grads, e_grads)
        )
        row = dict(strategy=strategy, compiled=compiled,
                   note="" if compiled else changes[0].detail,
                   eager_saved_bytes=e_bytes, compiled_saved_bytes=c_bytes,
                   eager_step_s=t.median_s("eager"), compiled_step_s=t.median_s("compiled"),
                   speedup=speedup.median, speedup_spread=speedup.to_dict(),
                   timing_load_avg=[t.load_before, t.load_after],
                   first_compiled_call_s=c_first, max_rel_grad_diff=rel,
                   graph_breaks=sum(hf.graph_breaks().values()))  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = dict(machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
                threads=a.threads, torch=torch.__version__, model=a.model, batch=a.batch,
                seq=a.seq, command=" ".join(["python", *sys.argv]), load_avg=load_average(),
                timing="per strategy: eager and compiled in interleaved rounds; speedup = "
                "median of per-round t(eager)/t(compiled)")  # fmt: skip
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
