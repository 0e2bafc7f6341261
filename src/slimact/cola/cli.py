"""``slimact flops`` (wired into ``slimact.cli``): cola.txt's FLOPs and memory formulas.

    slimact flops --model llama-1b --seq 256 [--batch 1 --rank 512 --json]

``add_flops_arguments(parser)`` / ``run_flops(args) -> exit status``; ``slimact rank`` (the
effective-rank analysis of a trained checkpoint) lives in ``slimact.train.rank``.
"""

from __future__ import annotations

import argparse
import json

from slimact.cola.flops import model_dims, training_flops


def add_flops_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-20m", help="registered model name")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (the paper's n)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--rank", type=int, default=None, help="rank r (default: model's, else d/4)")
    p.add_argument("--no-head", action="store_true", help="leave out the LM head (Table 3 style)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_flops(args: argparse.Namespace) -> int:
    res = training_flops(args.model, args.seq, args.batch, args.rank, not args.no_head)
    dims = model_dims(args.model)
    res = {"model": args.model, "d": dims.d, "d_ff": dims.d_ff, "n_layers": dims.n_layers, **res}
    if args.json:
        print(json.dumps(res))
        return 0
    print(
        f"{args.model}: d={dims.d} d_ff={dims.d_ff} layers={dims.n_layers} r={res['rank']} "
        f"seq={args.seq} batch={args.batch}"
    )
    print(f"{'method':<10} {'FLOPs/token':>14} {'vs full-rank':>13}")
    for m, v in res["methods"].items():
        print(f"{m:<10} {v['flops_per_token']:>14.4g} {v['vs_full_rank']:>13.3f}")
    rc = res["recompute_per_layer"]
    print(
        f"recompute per layer: vanilla GCP {rc['vanilla-gcp']:.4g} (Eq. 16), CoLA-M "
        f"{rc['cola-m']:.4g} (Eq. 18), ratio {rc['vanilla-gcp'] / rc['cola-m']:.2f}x"
    )
    mem = res["activation_elements_per_layer"]
    print(
        "activation elements per layer: "
        + ", ".join(f"{k} {v:.4g}" for k, v in mem.items())
        + " (Table 4)"
    )
    return 0
