"""``slimact plan``: profile a model, solve the MILP for a budget, print (or save) the plan.

    slimact plan --model llama-20m --batch 4 --seq 256 --budget 25% [--json] [--out plan.json]
    slimact plan --model llama-20m --batch 4 --seq 256 --strategy int4 [--json]

With ``--strategy NAME`` it prints the plan a strategy is, applied and measured on one step
beside ``none`` (``slimact.strategies.describe``: every storage's action and bytes in the same
words). The strategies sit above the planner, so ``slimact.cli`` hands ``run`` that function.

The profile is cached (``--cache DIR``, default ``~/.cache/slimact/profiles``), so re-planning
for another budget only re-solves. ``slimact.apply(model, Plan.load("plan.json"))`` applies a
saved plan.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from slimact.budget import add_budget_argument
from slimact.models import build_model
from slimact.models.registry import get_spec
from slimact.planner.auto import plan_for
from slimact.planner.plan import Plan
from slimact.planner.scaled import (
    SCALED_FROM_BYTES,
    ScaledConfig,
    cached_profile_scaled,
    param_bytes,
    profile_scaled,
)
from slimact.planner.solve import solve_plan
from slimact.utils import default_device, seed_everything

# (model, spec, token ids, model name) -> the measured plan: slimact.strategies.describe.describe
Describe = Callable[..., Plan]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-20m", help="registered model name")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    add_budget_argument(p, what="the plan (required unless --strategy)")
    p.add_argument(
        "--strategy",
        default=None,
        help="print the plan this strategy (a preset spec, e.g. int4, invact+recompute, "
        "auto@25%%, or a compiled-* one) is, with its bytes measured on one step, instead of "
        "solving for --budget",
    )
    p.add_argument("--layers", default="ends", choices=["uniform", "ends", "each"])
    p.add_argument("--codecs", default=None, help="comma-separated candidate codecs (default all)")
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--no-reform", action="store_true")
    p.add_argument("--max-quality", type=float, default=None, help="cap on summed relative MSE")
    p.add_argument(
        "--max-rel-err", type=float, default=0.25, help="per-tensor cap (<0: no cap; default 0.25)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timing repeats, median (default 3; scaled: 1)"
    )
    p.add_argument(
        "--profile",
        default="auto",
        choices=["auto", "full", "scaled"],
        help="full: build and profile the model; scaled: shapes from fake tensors, times from a "
        "one-block twin at --profile-tokens (auto: scaled above 2 GiB of parameters)",
    )
    p.add_argument(
        "--profile-tokens", type=int, default=64, help="scaled: the twin's batch x seq cap"
    )
    p.add_argument(
        "--host-budget",
        default=None,
        help="pinned host memory offload may use, e.g. 8GiB (CUDA only; default: no offload)",
    )
    p.add_argument("--cache", default="", help="profile cache dir ('none' disables)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace, describe: Describe | None = None) -> int:
    """``slimact plan``; ``describe`` measures a ``--strategy`` (``slimact.cli`` passes
    ``slimact.strategies.describe.describe``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = dtype[args.dtype]
    seed_everything(args.seed)
    device = args.device or default_device()
    if args.seq > get_spec(args.model).config.max_seq_len:
        raise ValueError(f"seq {args.seq} exceeds {args.model}'s max_seq_len")
    if (args.strategy is None) == (args.budget is None):
        raise ValueError("slimact plan needs exactly one of --budget (solve) or --strategy NAME")
    if args.strategy is not None:
        if describe is None:
            raise ValueError("slimact plan --strategy needs a describe function (slimact.cli)")
        return _print(args, _described(args, device, dtype, describe), "measured", None)
    mode = args.profile
    if mode == "auto":
        mode = "scaled" if param_bytes(args.model, dtype) > SCALED_FROM_BYTES else "full"
    codecs = tuple(c.strip() for c in args.codecs.split(",")) if args.codecs else None
    options = dict(
        layers=args.layers, codecs=codecs, recompute=not args.no_recompute,
        reform=not args.no_reform, max_quality=args.max_quality,
        max_rel_err=None if args.max_rel_err < 0 else args.max_rel_err,
        host_budget=args.host_budget,
    )  # fmt: skip
    cache = None if args.cache == "none" else args.cache
    scaled = None
    if mode == "scaled":
        repeats = args.repeats or 1  # the twin's times are scaled: one timed run each
        cfg = ScaledConfig(args.profile_tokens, codecs, repeats, not args.no_reform, args.seed)
        if cache is None:
            prof = profile_scaled(args.model, args.batch, args.seq, cfg, dtype=dtype, device=device)
        else:
            prof = cached_profile_scaled(
                args.model, args.batch, args.seq, cfg, dtype=dtype, device=device,
                cache_dir=cache or None,
            )  # fmt: skip
        scaled = prof.meta["scaled"]
        plan = solve_plan(prof, args.budget, **options)
    else:
        model = build_model(args.model, device=device).to(dtype)
        plan = plan_for(
            model, args.batch, args.seq, args.budget, seed=args.seed, repeats=args.repeats or 3,
            cache=cache, **options,
        )  # fmt: skip
    return _print(args, plan, mode, scaled)


def _described(args: argparse.Namespace, device, dtype, describe: Describe) -> Plan:
    model = build_model(args.model, device=device).to(dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
    return describe(model, args.strategy, ids, name=args.model)


def _print(args: argparse.Namespace, plan, mode: str, scaled) -> int:
    if args.out:
        plan.save(args.out)
    if args.json:  # planning time split: profiling (cached: the original run's) and the MILP
        times = {"solve_time_s": plan.solve_s, "profile_time_s": dict(plan.meta).get("profile_s")}
        print(json.dumps(plan.to_dict() | times | {"profile": {"mode": mode, "scaled": scaled}}))
    else:
        print(plan.table())
        if scaled:
            print(f"profile: scaled ({scaled['rule']})")
    return 0
