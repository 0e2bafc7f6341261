"""``slimact train``: argparse front end of :func:`slimact.train.train`.

``add_train_arguments`` declares the flags (defaults from ``TrainConfig``), ``run_train`` builds
the config, trains and prints a summary table and, with a baseline twin (``--baseline``), the
strategy and the baseline side by side.
Bad values come back as a one-line ``error: ...`` on stderr and exit status 2; Ctrl-C after a
saved checkpoint gives 130.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slimact import dist as sdist
from slimact.budget import add_budget_argument
from slimact.compiled.advice import documented_dominance
from slimact.registry import add_compile_argument, cli_spec
from slimact.train.config import BASELINES, DEVICES, DIST_MODES, TrainConfig
from slimact.train.loop import TrainResult, train
from slimact.utils import fmt_bytes

_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS

    def a(flag: str, **kw: Any) -> None:
        if kw.get("default") not in (None, False) and "help" in kw:
            kw["help"] += f" (default: {kw['default']})"
        parser.add_argument(flag, **kw)

    a("--model", default=d["model"], help="registered model name (see `slimact models`)")
    a("--strategy", default=d["strategy"], help="strategy name, or names joined by '+'")
    add_budget_argument(parser)
    add_compile_argument(parser)
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
    a(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        choices=("latest", "latest-valid"),
        help="continue from the latest checkpoint in --out (it must verify); latest-valid: from "
        "the newest one that verifies, skipping damaged ones",
    )
    a("--keep-last", type=int, default=d["keep_last"], help="checkpoints to keep")
    a("--ckpt-every", type=int, default=d["ckpt_every"], help="checkpoint every N steps (0: end)")
    a("--stop-at", type=int, default=None, help="stop (with a checkpoint) after this step")
    a("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a("--device", default=d["device"], help=f"{', '.join(DEVICES)} or cuda:N (auto: cuda if any)")
    a("--no-progress", action="store_true", help="no progress bar")
    a(
        "--baseline",
        default=d["baseline"],
        choices=BASELINES,
        help="measure strategy 'none' beside the run on the same batches: train (a twin trained "
        "alongside, for losses), first-batch (bytes, peak and step time on the first steps), off; "
        "auto: off for strategy none, first-batch when resuming or under --dist, else train",
    )
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
    values["strategy"] = cli_spec(
        values["strategy"], getattr(args, "budget", None), getattr(args, "compile", False)
    )
    return TrainConfig(**values)


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _bytes(v: int | None) -> str:
    return "-" if v is None else fmt_bytes(v)


def _on_cuda(result: TrainResult) -> bool:
    return str(result.device).startswith("cuda")


def summary_rows(result: TrainResult) -> list[tuple[str, str]]:
    """The run: model, strategy, steps, tokens/s, losses, saved bytes, run dir. On CUDA the
    first step's peak follows the strategy: it decides whether a run fits."""
    cfg = result.config
    peak = (
        [("peak over fwd+bwd (1st step)", _bytes(result.peak_bytes) + " (decides what fits)")]
        if _on_cuda(result)
        else []
    )
    return [
        ("model", f"{cfg.model} ({result.params:,} params) on {result.device}"),
        ("strategy", cfg.strategy),
        *peak,
        (
            "steps",
            f"{result.steps} / {cfg.steps}" + (" (interrupted)" if result.interrupted else ""),
        ),
        ("tokens/step", f"{cfg.tokens_per_step:,} ({cfg.batch}x{cfg.seq}x{cfg.grad_accum})"),
        ("training tokens/s", _num(result.tokens_per_s, ",.0f") + " (whole steps)"),
        ("final val loss", _num(result.final_val_loss, ".4f")),
        ("final val ppl", _num(result.final_val_ppl, ".2f")),
        ("load average", " -> ".join(_num(v, ".2f") for v in result.load_avg)),
        ("run dir", str(result.run_dir)),
    ]


def side_by_side_rows(result: TrainResult) -> list[tuple[str, str, str, str]]:
    """(what, baseline, strategy, strategy / baseline) rows; empty without a baseline twin."""
    base = result.baseline
    if base is None:
        return []
    tokens = result.config.batch * result.config.seq * result.config.grad_accum

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.3f}x"

    def tps(t: float | None) -> str:
        return "-" if not t else f"{tokens / t:,.0f}"

    r = base.step_time_ratio
    spread = "-" if r is None else f"{r.median:.3f}x [{r.min:.2f}-{r.max:.2f}, {r.n} rounds]"
    saved = (
        "saved activations (1st step)",
        _bytes(base.saved_bytes),
        _bytes(result.saved_bytes),
        ratio(result.saved_bytes, base.saved_bytes),
    )
    peak = (
        "peak over fwd+bwd (1st step)",
        _bytes(base.peak_bytes),
        _bytes(result.peak_bytes),
        ratio(result.peak_bytes, base.peak_bytes),
    )
    return [
        *([peak, saved] if _on_cuda(result) else [saved, peak]),
        (
            "step time fwd+bwd (median)",
            _num(base.step_time_s, ".3f") + " s",
            _num(result.step_time_s, ".3f") + " s",
            spread,
        ),  # fmt: skip
        ("tokens/s fwd+bwd", tps(base.step_time_s), tps(result.step_time_s), ""),
        ("loss, 1st step", _num(base.first_loss, ".4f"), _num(result.first_loss, ".4f"), ""),
        (
            "final train loss",
            _num(base.final_train_loss, ".4f"),
            _num(result.final_train_loss, ".4f"),
            ratio(result.final_train_loss, base.final_train_loss),
        ),
        (
            "final val loss",
            _num(base.final_val_loss, ".4f"),
            _num(result.final_val_loss, ".4f"),
            ratio(result.final_val_loss, base.final_val_loss),
        ),
    ]


def summary_advice(result: TrainResult) -> str | None:
    """One line when the run's strategy is documented as dominated on its device (eager codec
    policies on CUDA: ``slimact.compiled.advice``)."""
    return documented_dominance(result.config.strategy, str(result.device).split(":")[0])


def print_summary(result: TrainResult, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="slimact train", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in summary_rows(result):
        table.add_row(k, v)
    console.print(table)
    advice = summary_advice(result)
    rows = side_by_side_rows(result)
    if not rows:
        if advice:
            console.print(advice, markup=False, highlight=False, soft_wrap=True)
        return
    base = result.baseline
    assert base is not None
    how = (
        "trained alongside on the same batches"
        if base.mode == "train"
        else "run on the first steps' batches, not trained (--baseline train compares losses)"
    )
    side = Table(title=f"{result.config.strategy} vs baseline (none): baseline {how}")
    for col in ("", "baseline (none)", result.config.strategy, "strategy / baseline"):
        side.add_column(col, justify="left" if not col else "right")
    for row in rows:
        side.add_row(*row)
    console.print(side)
    peak_note = " On CUDA the peak decides whether a run fits." if _on_cuda(result) else ""
    console.print(
        "Saved activations: bytes autograd keeps for backward (unique storages, parameters "
        "excluded). Peak: live memory above the weights over one forward+backward."
        f"{peak_note} Step-time ratio: median of per-step ratios, strategy and baseline "
        "interleaved."
    )
    if advice:
        console.print(advice, markup=False, highlight=False, soft_wrap=True)


def check_run_dir(run_dir: Path) -> None:
    """``ValueError`` naming ``--out`` when the run dir cannot be created or written, before a
    training step is spent (the metrics log and checkpoints go there)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ValueError(
            f"--out {str(run_dir)!r} is not a writable directory ({why}); give a directory "
            "this user can create and write"
        ) from None


def run_train(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        if config.dist != "none" and not sdist.info().world_size > 1:
            sdist.check_torchrun_env(config.dist)  # before any step is spent
        check_run_dir(config.run_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = train(config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
