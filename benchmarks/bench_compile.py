"""Eager vs torch.compile (inductor, CPU) per strategy: step time and saved bytes.

``slimact.hf.compile_blocks`` compiles every block's forward; the root stays eager (see
``slimact.hf``). Codec strategies (int4, prac) are left eager by design and reported as such.
Step time: median of ``--steps`` forward+backward after 2 warm-up steps (the first compiled
call, which compiles, is excluded and reported separately). torch.set_num_threads(--threads).

    PYTHONPATH=src python benchmarks/bench_compile.py [--model llama-20m --batch 2 --seq 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import slimact
from slimact import hf

STRATEGIES = ("none", "recompute", "invact", "invact+recompute", "int4", "prac")


def build(name: str, strategy: str):
    torch.manual_seed(0)
    return slimact.apply(slimact.build_model(name), strategy)


def run(model, x, y, steps: int):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with slimact.measure(model, n_tokens=x.numel()) as m:
        loss = model(x, targets=y).loss
    loss.backward()
    first = time.perf_counter() - t0
    grads = [p.grad.clone() for p in model.parameters()]
    times = []
    for i in range(steps + 2):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(x, targets=y).loss.backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return m.report.total_bytes, statistics.median(times), first, grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-20m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
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
        e_bytes, e_time, _, e_grads = run(eager, x, y, a.steps)
        model = build(a.model, strategy)
        torch._dynamo.reset()
        changes = hf.compile_blocks(model, backend="inductor")
        compiled = not any(c.skipped for c in changes)
        c_bytes, c_time, c_first, c_grads = run(model, x, y, a.steps)
        rel = max(
            float((g - h).abs().max() / (h.abs().max() + 1e-12)) for g, h in zip(c_grads, e_grads)
        )
        row = dict(strategy=strategy, compiled=compiled,
                   note="" if compiled else changes[0].detail,
                   eager_saved_bytes=e_bytes, compiled_saved_bytes=c_bytes,
                   eager_step_s=e_time, compiled_step_s=c_time, speedup=e_time / c_time,
                   first_compiled_call_s=c_first, max_rel_grad_diff=rel,
                   graph_breaks=sum(hf.graph_breaks().values()))  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = dict(machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
                threads=a.threads, torch=torch.__version__, model=a.model, batch=a.batch,
                seq=a.seq, command=" ".join(["python", *sys.argv]))  # fmt: skip
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
