"""``slimact`` command line: one subcommand per job.

    slimact models                      list model names with parameter counts
    slimact strategies                  list strategy names
    slimact memory --model M --strategy S [--batch B --seq S --json]
    slimact train --model M --strategy S --steps N ...
    slimact flops | rank | plan ...     CoLA calculators, effective rank, the planner
    slimact bench quick|full|gpu [--only-models M,.. --only-strategies S,.. --threads N
                  --out-dir DIR]        run a benchmark suite, write its JSON, rebuild the report
    slimact bench --report-only         regenerate bench.md, its plots and BENCHMARKS.md

Subcommands live in a small table: name -> (add-arguments function, run function, help). Every
module is imported at the top: ``import slimact`` already imports torch and every strategy, so
importing a subcommand's module only when it runs would save no start-up time.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Callable

import torch

from slimact.bench import cli as bench_cli
from slimact.bench import maxbatch
from slimact.bench.deadline import exit_process
from slimact.budget import add_budget_argument
from slimact.cola import cli as cola_cli
from slimact.compare import CompareConfig, compare
from slimact.compiled.advice import compiled_rivals, documented_dominance, measured_dominance
from slimact.models import count_params, get_spec, model_names
from slimact.planner import cli as plan_cli
from slimact.registry import add_compile_argument, cli_spec
from slimact.strategies import describe_strategies
from slimact.strategies.describe import describe
from slimact.train import cli as train_cli
from slimact.train import rank as rank_cli
from slimact.train.config import TrainConfig
from slimact.utils import MissingDependency, default_device, fmt_bytes


def _add_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def _run_models(args: argparse.Namespace) -> int:
    rows = [(n, count_params(n), get_spec(n).description) for n in model_names()]
    if args.json:
        print(json.dumps([{"model": n, "params": c, "note": d} for n, c, d in rows], indent=2))
        return 0
    print(f"{'model':<14} {'params':>14}  note")
    for n, c, d in rows:
        print(f"{n:<14} {c:>14,}  {d}")
    return 0


def _add_strategies(p: argparse.ArgumentParser) -> None:
    pass


def _run_strategies(args: argparse.Namespace) -> int:
    for name, desc in describe_strategies().items():
        print(f"{name:<14} {desc}")
    return 0


def _add_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--strategy", default="recompute", help="name, or names joined by '+'")
    add_budget_argument(p)
    add_compile_argument(p)
    micro = "default: slimact train's micro-batch"
    p.add_argument("--batch", type=int, default=TrainConfig.batch, help=f"{micro} (%(default)s)")
    p.add_argument("--seq", type=int, default=TrainConfig.seq, help=f"{micro} (%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--steps", type=int, default=5, help="interleaved timing rounds (baseline, strategy)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--vocab", type=int, default=None, help="override the model's vocabulary size")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--compare-compiled",
        action="store_true",
        help="also measure the strategy's compile=True form and compiled-recompute in the same "
        "rounds, and say which one dominates it here (more builds and compiles: slower)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _run_memory(args: argparse.Namespace) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = _device(args.device) if args.device else default_device()
    cfg_spec = cli_spec(args.strategy, args.budget, args.compile)
    cfg = CompareConfig(
        model=args.model,
        strategy=cfg_spec,
        batch=args.batch,
        seq=args.seq,
        seed=args.seed,
        steps=args.steps,
        warmup=args.warmup,
        device=device,
        dtype=args.dtype,
        vocab_size=args.vocab,
        rivals=tuple(compiled_rivals(cfg_spec)) if args.compare_compiled else (),
    )
    res = compare(cfg)
    res["advice"] = memory_advice(res)
    if args.json:
        print(json.dumps(res))
        return 0
    print("\n".join(memory_lines(res)))
    return 0


def memory_advice(res: dict) -> str | None:
    """``slimact memory``'s one-line warning when its strategy is dominated on this device: by a
    rival measured in the run (``--compare-compiled``), else by the documented rule
    (``slimact.compiled.advice``)."""
    device_type = res["device"].split(":")[0]
    rivals = [r for r in res.get("rivals", []) if "error" not in r]
    if rivals:
        how = {r["strategy"]: "--compile" for r in rivals}
        return measured_dominance(res, rivals, device_type, how)
    return documented_dominance(res["strategy"], device_type)


def memory_lines(res: dict) -> list[str]:
    """``slimact memory``'s table. On CUDA the peak leads (it decides whether a run fits)."""
    cuda = res["device"].startswith("cuda")
    names = [res["strategy"], *(r["strategy"] for r in res.get("rivals", []) if "error" not in r)]
    rivals = {r["strategy"]: r for r in res.get("rivals", [])}

    def row(label: str, base: str, key: str, fmt) -> str:
        vals = [res[key], *(rivals[n].get(key) for n in names[1:])]
        cells = "".join(f" {'-' if v is None else fmt(v):>18}" for v in vals)
        return f"{label:<30} {fmt(res[base]):>18}{cells}"

    def num(spec: str):
        return lambda v: format(v, spec)

    peak = row("peak over a step", "baseline_peak_bytes", "peak_bytes", fmt_bytes)
    saved = row("saved activations", "baseline_saved_bytes", "saved_bytes", fmt_bytes)
    lines = [
        f"model {res['model']} ({res['params']:,} params), batch {res['batch']} x seq "
        f"{res['seq']}, {res['dtype']} on {res['device']}",
        f"{'':<30} {'baseline':>18}" + "".join(f" {n[:18]:>18}" for n in names),
        *([peak, saved] if cuda else [saved, peak]),
        row("step time (s)", "baseline_step_time_s", "step_time_s", num(".4f")),
        row("loss", "baseline_loss", "loss", num(".5f")),
    ]
    if res.get("host_saved_bytes"):  # offload: beside the device bytes, not in them
        lines.append(f"{'saved in host memory':<30} {fmt_bytes(0):>18} "
                     f"{fmt_bytes(res['host_saved_bytes']):>18}")  # fmt: skip
    spread = res["step_time_ratio_spread"]
    lines.append(
        f"ratio {res['ratio']:.4f}   step-time ratio {res['step_time_ratio']:.3f} "
        f"[{spread['min']:.3f}-{spread['max']:.3f} over {spread['n']} interleaved rounds, "
        f"load {res['timing']['load_before']}]   grad_cosine {res['grad_cosine']:.6f}"
    )
    if cuda and res.get("peak_ratio") is not None:
        lines.insert(
            2,
            f"peak ratio {res['peak_ratio']:.3f}: on CUDA the peak (the allocator's maximum "
            "over a step) is what decides whether a run fits",
        )
    for r in res.get("rivals", []):
        if "error" in r:
            lines.append(f"{r['strategy']}: not measured ({r['error'][:160]})")
    if res.get("advice"):
        lines.append(res["advice"])
    return lines


def _device(name: str) -> str:
    """``--device``: a torch device string this machine has, else one line saying what is."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r} requested but CUDA is not available; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r} is not supported; use cpu, cuda or cuda:N")
    return name


# name -> (add-arguments function, run function, help). Run functions return an exit code.
COMMANDS: dict[str, tuple[Callable, Callable, str]] = {
    "models": (_add_models, _run_models, "list the model registry with parameter counts"),
    "strategies": (_add_strategies, _run_strategies, "list the registered strategies"),
    "memory": (
        _add_memory,
        _run_memory,
        "measure a strategy's saved bytes, speed and gradients vs baseline",
    ),
    "train": (
        train_cli.add_train_arguments,
        train_cli.run_train,
        "train a model on the embedded corpus (or --data)",
    ),
    "flops": (
        cola_cli.add_flops_arguments,
        cola_cli.run_flops,
        "training FLOPs and activation-memory formulas (cola.txt)",
    ),
    "rank": (
        rank_cli.add_rank_arguments,
        rank_cli.run_rank,
        "effective rank r(alpha) of a checkpoint's activations",
    ),
    "plan": (
        plan_cli.add_arguments,
        functools.partial(plan_cli.run, describe=describe),  # --strategy: a strategy's plan
        "solve a per-site plan under a memory budget",
    ),
    "bench": (
        bench_cli.add_arguments,
        bench_cli.run,
        "run a benchmark suite (quick | full | gpu) and regenerate BENCHMARKS.md",
    ),
    "maxbatch": (
        maxbatch.add_arguments,
        maxbatch.run,
        "the largest batch whose measured step peak fits a memory cap, per strategy",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimact", description="slimact: cut the activation memory of transformer training"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what apply changes")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, _run, help_) in COMMANDS.items():
        add(sub.add_parser(name, help=help_, description=help_))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    _add, run, _help = COMMANDS[args.command]
    try:
        return int(run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, MissingDependency) as e:
        print(f"slimact {args.command}: error: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``slimact`` command (``main``'s exit code; see ``bench.deadline.exit_process``)."""
    exit_process(main())


if __name__ == "__main__":
    entry()
