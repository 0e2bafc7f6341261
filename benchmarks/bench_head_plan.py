"""The planner's head action at real vocabularies (issue 17): is ``auto@10%`` feasible and kept?

    PYTHONPATH=src python benchmarks/bench_head_plan.py --vocabs 32000,128256 --batch 2 --seq 128

For each vocabulary: llama-20m with that vocabulary (random token ids), strategy ``none``
measured by the meter (saved bytes, the loss head's share), then the planner profiles the model
and solves ``auto@10%`` twice: with every action, and without the head action (the plan an
``auto`` without it could reach: the smallest feasible budget it reports). The full plan is
applied and one training step measured: saved bytes against the budget, the loss, and the
minimum over parameters of the gradient cosine against ``none`` (same weights, same batch).
Writes ``benchmarks/results/head_plan.{json,md}`` (machine, versions, load, command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

import slimact
from slimact.envinfo import machine_info
from slimact.planner import profile_model
from slimact.planner.plan import ROOT
from slimact.planner.reforms import HEAD_KIND
from slimact.planner.solve import solve_plan
from slimact.timing import load_average
from slimact.utils import fmt_bytes

RESULTS = Path(__file__).parent / "results"


def step(model, ids, tgt):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(ids, targets=tgt)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return m.report, float(out.loss.detach()), grads


def min_cosine(a: dict, b: dict) -> float:
    return min(
        float(torch.nn.functional.cosine_similarity(a[n].flatten(), b[n].flatten(), dim=0))
        for n in a
    )


def one(vocab: int, batch: int, seq: int, codecs: tuple[str, ...] | None) -> dict:
    torch.manual_seed(0)
    model = slimact.build_model("llama-20m", vocab_size=vocab)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    ids, tgt = x[:, :-1], x[:, 1:]
    base, loss0, g0 = step(model, ids, tgt)
    head = sum(
        s.bytes for s in base.sites if s.site.startswith("lm_head") or s.site.startswith(":")
    )
    t0 = time.perf_counter()
    prof = profile_model(model, ids, tgt, repeats=1, codecs=codecs)
    profile_s = time.perf_counter() - t0
    row = {
        "vocab": vocab, "batch": batch, "seq": seq,
        "none_bytes": base.total_bytes, "head_bytes": head, "head_share": head / base.total_bytes,
        "profile_s": profile_s,
    }  # fmt: skip
    root = next(k for k in prof.kinds if k.kind == ROOT)
    no_head = dataclasses.replace(
        prof,
        kinds=[
            k if k.kind != ROOT else dataclasses.replace(
                k, reforms=[r for r in root.reforms if r.kind != HEAD_KIND])
            for k in prof.kinds
        ],
    )  # fmt: skip
    try:
        solve_plan(no_head, "10%")
        row["without_head_action"] = "feasible"
    except ValueError as e:
        row["without_head_action"] = str(e).split("; ")[-1]
    t0 = time.perf_counter()
    plan = solve_plan(prof, "10%")
    row["solve_s"] = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    slimact.apply(model, plan)
    rep, loss1, g1 = step(model, ids, tgt)
    row |= {
        "budget_bytes": plan.budget_bytes,
        "predicted_bytes": plan.predicted_bytes,
        "measured_bytes": rep.total_bytes,
        "ratio": rep.total_bytes / base.total_bytes,
        "within_budget": rep.total_bytes <= plan.budget_bytes * 1.02,
        "head_reformulated": "lm_head" in plan.layers[-1].reform,
        "loss_none": loss0,
        "loss_plan": loss1,
        "grad_cos_min": min_cosine(g0, g1),
    }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="32000,128256")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--codecs", default="int8,int4-channel,int8-channel,int4-outlier,bits")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    codecs = tuple(c for c in args.codecs.split(",") if c) or None
    env = machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": load_average()}
    env["command"] = "python benchmarks/bench_head_plan.py " + " ".join(argv or sys.argv[1:])
    rows = []
    for v in (int(x) for x in args.vocabs.split(",")):
        rows.append(one(v, args.batch, args.seq, codecs))
        print(json.dumps(rows[-1]), flush=True)
    env["load_avg_end"] = load_average()
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_plan.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [
        "# The planner's head action: `auto@10%` at real vocabularies (llama-20m)",
        "",
        f"Machine: {env.get('machine')}, torch {env.get('torch')}, {args.threads} thread(s), "
        f"load {env['load_avg']} -> {env['load_avg_end']}; `{env['command']}`; fp32, random ids,"
        f" codecs {', '.join(codecs or ('all',))}.",
        "",
        "| V | batch × seq | none saved | head share | without head action | budget | measured |"
        " ratio | head planned | loss none / plan | grad cos min | profile s |",
        "| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']:,} | {r['batch']} × {r['seq']} | {fmt_bytes(r['none_bytes'])} | "
            f"{r['head_share']:.1%} | {r['without_head_action']} | {fmt_bytes(r['budget_bytes'])} |"
            f" {fmt_bytes(r['measured_bytes'])} | {r['ratio']:.3f} | {r['head_reformulated']} | "
            f"{r['loss_none']:.6f} / {r['loss_plan']:.6f} | {r['grad_cos_min']:.5f} | "
            f"{r['profile_s']:.0f} |"
        )
    (out / "head_plan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
