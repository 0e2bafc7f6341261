"""``slimact train``: argparse front end of :func:`slimact.train.train`.

``add_train_arguments`` declares the flags (defaults from ``TrainConfig``), ``run_train`` builds
the config, trains and prints a summary table (``rich`` when available, plain text otherwise).
Bad values come back as a one-line ``error: ...`` on stderr and exit status 2; Ctrl-C after a
saved checkpoint gives 130.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any

from slimact.train.config import DEVICES, DIST_MODES, TrainConfig

_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS

    def a(flag: str, **kw: Any) -> None:
        if kw.get("default") not in (None, False) and "help" in kw:
            kw["help"] += f" (default: {kw['default']})"
        parser.add_argument(flag, **kw)

    a("--model", default=d["model"], help="registered model name (see `slimact models`)")
    a("--strategy", default=d["strategy"], help="strategy name, or names joined by '+'")
    a("--budget", default=None, help="memory budget for strategy 'auto': 25%% | 6GiB | bytes")
    a("--steps", type=int, default=d["steps"], help="optimizer steps")
    a("--batch", type=int, default=d["batch"], help="sequences per micro-batch")
    a("--seq", type=int, default=d["seq"], help="tokens per sequence (<= the model's max)")
    a("--grad-accum", type=int, default=d["grad_accum"], help="micro-batches per step")
    a("--lr", type=float, default=d["lr"], help="peak learning rate (cola.txt App. D: 3e-3)")
    a("--min-lr-ratio", type=float, default=d["min_lr_ratio"], help="final lr / peak lr")
    a("--warmup", type=float, default=d["warmup"], help="warm-up: fraction (<1) or steps (>=1)")
    a("--weight-decay", type=float, default=d["weight_decay"], help="AdamW weight decay")
    a("--clip", type=float, default=d["clip"], help="max grad norm (0 disables clipping)")
    a("--eval-every", type=int, default=d["eval_every"], help="eval every N steps (0: at end)")
    a("--eval-batches", type=int, default=d["eval_batches"], help="validation batches per eval")
    a("--seed", type=int, default=d["seed"], help="seed for init and data order")
    a("--data", default=None, help=".txt/.jsonl file or directory (default: stdlib sources)")
    a("--out", default=None, help="run dir (default runs/<model>-<strategy>-<seed>)")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    a("--keep-last", type=int, default=d["keep_last"], help="checkpoints to keep")
    a("--ckpt-every", type=int, default=d["ckpt_every"], help="checkpoint every N steps (0: end)")
    a("--stop-at", type=int, default=None, help="stop (with a checkpoint) after this step")
    a("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a("--device", default=d["device"], help=f"{', '.join(DEVICES)} or cuda:N (auto: cuda if any)")
    a("--no-progress", action="store_true", help="no progress bar")
    a(
        "--dist",
        default=d["dist"],
        choices=DIST_MODES,
        help="data parallelism under torchrun: ddp or fsdp (FSDP2 fully_shard); --batch is the "
        "global batch, split over ranks",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = {
        f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)
    }
    values["progress"] = not getattr(args, "no_progress", False)
    if getattr(args, "budget", None) is not None:
        from slimact.strategies.registry import with_budget

        values["strategy"] = with_budget(values["strategy"], args.budget)
    return TrainConfig(**values)


def summary_rows(result: Any) -> list[tuple[str, str]]:
    from slimact.utils import fmt_bytes

    def num(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    cfg = result.config
    saved = result.saved_bytes
    return [
        ("model", cfg.model),
        ("strategy", cfg.strategy),
        ("params", f"{result.params:,}"),
        ("device", result.device),
        (
            "steps",
            f"{result.steps} / {cfg.steps}" + (" (interrupted)" if result.interrupted else ""),
        ),
        ("tokens/step", f"{cfg.tokens_per_step:,} ({cfg.batch}x{cfg.seq}x{cfg.grad_accum})"),
        ("tokens/s", num(result.tokens_per_s, ",.0f")),
        ("final train loss", num(result.final_train_loss, ".4f")),
        ("final val loss", num(result.final_val_loss, ".4f")),
        ("final val ppl", num(result.final_val_ppl, ".2f")),
        ("saved activations", "-" if saved is None else f"{fmt_bytes(saved)} ({saved:,} B)"),
        ("run dir", str(result.run_dir)),
    ]


def print_summary(result: Any) -> None:
    rows = summary_rows(result)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
        return
    table = Table(title="slimact train", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def run_train(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from slimact.train.loop import train

    try:
        result = train(config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import os

    if os.environ.get("RANK", "0") == "0":  # under torchrun, only rank 0 reports
        print_summary(result)
    return 130 if result.interrupted else 0


# The lead's dispatcher also accepts these generic names.
add_arguments = add_train_arguments
run = run_train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slimact train", description=__doc__)
    add_train_arguments(parser)
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
