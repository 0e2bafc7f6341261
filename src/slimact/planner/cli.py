"""``slimact plan``: profile a model, solve the MILP for a budget, print (or save) the plan.

    slimact plan --model llama-20m --batch 4 --seq 256 --budget 25% [--json] [--out plan.json]

The profile is cached (``--cache DIR``, default ``~/.cache/slimact/profiles``), so re-planning
for another budget only re-solves. ``slimact.apply(model, Plan.load("plan.json"))`` applies a
saved plan.
"""

from __future__ import annotations

import argparse
import json

from slimact.budget import add_budget_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-20m", help="registered model name")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    add_budget_argument(p, required=True, what="the plan")
    p.add_argument("--layers", default="ends", choices=["uniform", "ends", "each"])
    p.add_argument("--codecs", default=None, help="comma-separated candidate codecs (default all)")
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--no-reform", action="store_true")
    p.add_argument("--max-quality", type=float, default=None, help="cap on summed relative MSE")
    p.add_argument(
        "--max-rel-err", type=float, default=0.25, help="per-tensor cap (<0: no cap; default 0.25)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    p.add_argument("--cache", default="", help="profile cache dir ('none' disables)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    from slimact.models import build_model
    from slimact.planner import plan_for
    from slimact.utils import default_device, seed_everything

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    seed_everything(args.seed)
    device = args.device or default_device()
    model = build_model(args.model, device=device).to(dtype[args.dtype])
    if args.seq > model.config.max_seq_len:
        raise ValueError(f"seq {args.seq} exceeds {args.model}'s max_seq_len")
    codecs = tuple(c.strip() for c in args.codecs.split(",")) if args.codecs else None
    plan = plan_for(
        model, args.batch, args.seq, args.budget, seed=args.seed, layers=args.layers,
        codecs=codecs, recompute=not args.no_recompute, reform=not args.no_reform,
        max_quality=args.max_quality,
        max_rel_err=None if args.max_rel_err < 0 else args.max_rel_err,
        repeats=args.repeats, cache=None if args.cache == "none" else args.cache,
    )  # fmt: skip
    if args.out:
        plan.save(args.out)
    if args.json:  # planning time split: profiling (cached: the original run's) and the MILP
        times = {"solve_time_s": plan.solve_s, "profile_time_s": dict(plan.meta).get("profile_s")}
        print(json.dumps(plan.to_dict() | times))
    else:
        print(plan.table())
    return 0
