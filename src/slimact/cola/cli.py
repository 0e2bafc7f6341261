"""``slimact flops`` and ``slimact rank`` (wired into ``slimact.cli``).

    slimact flops --model llama-1b --seq 256 [--batch 1 --rank 512 --json]
    slimact rank --model llama-20m --checkpoint runs/llama-20m-none-0 [--plot out.png --json]

Each pair is ``add_*_arguments(parser)`` / ``run_*(args) -> exit status``.
"""

from __future__ import annotations

import argparse
import json

import torch

from slimact.cola.flops import model_dims, training_flops
from slimact.cola.rank import activation_ranks, load_trained, plot_spectra, ranks_to_json
from slimact.data import fixed_batches, load_data


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


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="registered model name the checkpoint is of")
    p.add_argument("--checkpoint", required=True, help="run dir, ckpt-N dir or .safetensors file")
    p.add_argument("--alpha", type=float, default=0.95, help="energy fraction α of Eq. 1")
    p.add_argument("--batches", type=int, default=4, help="validation batches")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--data", default=None, help="corpus (default: the embedded stdlib sources)")
    p.add_argument("--plot", default=None, help="write the Fig. 2-style PNG here")
    p.add_argument("--kind", default=None, help="activation to plot, e.g. mlp.act_fn")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_rank(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    model = load_trained(args.model, args.checkpoint)
    if args.seq > model.config.max_seq_len:
        raise ValueError(
            f"--seq {args.seq} exceeds the model's max_seq_len {model.config.max_seq_len}"
        )
    val = load_data(args.data).val
    batches = [x for x, _ in fixed_batches(val, args.batch, args.seq, args.batches)]
    rows, spectra = activation_ranks(model, batches, args.alpha)
    plot = None
    if args.plot:
        title = f"{args.model} ({args.checkpoint}), α={args.alpha}"
        plot = str(plot_spectra(rows, spectra, args.plot, args.kind, title))
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "checkpoint": str(args.checkpoint),
                    "alpha": args.alpha,
                    "tokens": sum(x.numel() for x in batches),
                    "plot": plot,
                    "layers": ranks_to_json(rows),
                }
            )
        )
        return 0
    print(f"{'activation':<40} {'dim':>6} {'r(α)':>6} {'ratio':>7}")
    for r in rows:
        print(f"{r.path:<40} {r.dim:>6} {r.rank:>6} {r.ratio:>7.3f}")
    if plot:
        print(f"plot: {plot}")
    return 0
