"""Max batch, measured: the largest batch whose measured step peak fits a memory cap.

adacc.txt Table 3 reports the largest batch each method trains on a 32 GB V100 (GPT-117M: 57
baseline, 136 full recomputation, 98 per-token INT4, 136 Adacc). Here the batch is found by
running it, not computed from bytes per sample: for each strategy, a model built from ``seed``
runs one forward+backward per candidate batch (``seq`` tokens per row) and
:func:`slimact.peak.step_peak` measures the peak of live bytes above what was live before the
step (CUDA allocator stats, or the CPU profiler's memory events). A batch *fits* when

    static + peak <= cap,      static = weights + AdamW's two moments (3 x parameter bytes)

(``include_static=False`` compares the step peak alone). The gradients are freed before the step
(``set_to_none``), so the peak includes them. The batch grows by doubling from ``start`` until one
does not fit (or ``limit`` is reached), then bisection between the last fit and the first miss
finds the largest fitting batch exactly, assuming the peak grows with the batch. Each candidate is
a fresh copy of the model with the strategy applied (``auto`` plans for that batch) and
``warmup`` unmeasured steps first (a planned strategy profiles and checks its budget on its first
step; that is not the training step's peak).

    slimact maxbatch --model llama-20m --seq 256 --cap 2GiB --strategies none,recompute,int4,auto@25%

Where every probe costs seconds (a GPU lent for minutes; a compiled point compiles once more at
its first new batch size), :func:`predicted_search` finds the batch in a few probes instead: the
peak grows about linearly with the batch, so the next probe is where a line through the peaks
measured so far (one of them the case's own batch, measured for the table) meets the cap;
``slimact bench`` uses it on each point's prepared model (:func:`peak_at`), so a planned point
keeps the plan it made at the case's batch.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from slimact import spec
from slimact.envinfo import machine_info
from slimact.models import build_model, model_names
from slimact.peak import step_peak
from slimact.registry import resolve
from slimact.strategies import apply
from slimact.timing import load_average
from slimact.utils import fmt_bytes, seed_everything

DEFAULT_STRATEGIES = ("none", "recompute", "int4", "auto@25%")
ADAM_MOMENTS = 2


def parse_cap(value: str | int) -> int:
    """A memory cap in bytes from ``"2GiB"``, ``"512MB"``, ``"123456B"`` or an int of bytes."""
    try:
        budget = spec.parse_budget(value)
    except ValueError as e:
        raise ValueError(
            f"cap {value!r} is not a memory size; use e.g. '2GiB', '512MiB', '123456B' ({e})"
        ) from None
    if budget.total is None:
        raise ValueError(
            f"cap {value!r} is a share; a cap is a memory size such as '2GiB', '512MiB' or "
            "'123456B'"
        )
    return budget.total


@dataclass(frozen=True)
class MaxBatchConfig:
    model: str = "llama-20m"
    seq: int = 256
    cap: int | str = "2GiB"
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    start: int = 1
    limit: int = 4096
    include_static: bool = True
    warmup: int = 1
    seed: int = 0
    device: str = "cpu"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cap", parse_cap(self.cap))
        if self.model not in model_names():
            raise ValueError(f"unknown model {self.model!r}; valid: {', '.join(model_names())}")
        for name in ("seq", "start", "limit"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MaxBatchConfig.{name} must be an int >= 1, got {v!r}")
        if self.start > self.limit:
            raise ValueError(f"MaxBatchConfig.start={self.start} exceeds limit={self.limit}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"MaxBatchConfig.warmup must be an int >= 0, got {self.warmup!r}")
        if isinstance(self.strategies, str):
            object.__setattr__(self, "strategies", tuple(split_strategies(self.strategies)))
        object.__setattr__(self, "strategies", tuple(self.strategies))
        if not self.strategies:
            raise ValueError("MaxBatchConfig.strategies is empty; give at least one strategy")
        for s in self.strategies:
            resolve(s)  # an unknown name fails here, listing the valid ones
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"MaxBatchConfig.device must be cpu or cuda[:N], got {self.device!r}")


def split_strategies(text: str) -> list[str]:
    """``"none,recompute,auto@25%"`` -> names (a comma inside ``auto@25%,codecs=...`` options is
    not supported here: give such a spec alone)."""
    return [s.strip() for s in text.split(",") if s.strip()]


@dataclass
class Trial:
    batch: int
    peak_bytes: int
    total_bytes: int
    fits: bool
    seconds: float


@dataclass
class StrategyResult:
    strategy: str
    max_batch: int
    hit_limit: bool
    static_bytes: int
    trials: list[Trial] = field(default_factory=list)


def search(fits: Callable[[int], bool], start: int = 1, limit: int = 4096) -> tuple[int, bool]:
    """Largest ``b`` in [start, limit] with ``fits(b)`` (0 if ``start`` does not fit): doubling,
    then bisection. Returns (batch, whether ``limit`` was reached while still fitting)."""
    if not fits(start):
        return 0, False
    good, b = start, start
    while True:
        if good == limit:
            return good, True
        b = min(2 * good, limit)
        if not fits(b):
            bad = b
            break
        good = b
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, False


@dataclass
class Bracket:
    """What :func:`predicted_search` found: the largest batch measured to fit (0: none did),
    the smallest measured not to (None: none missed), and every probe as (batch, peak or None
    where it ran out of memory)."""

    fits: int = 0
    misses: int | None = None
    probes: list[tuple[int, int | None]] = field(default_factory=list)
    limit: int = 4096

    @property
    def exact(self) -> bool:
        """The largest fitting batch is known: the next batch up was measured not to fit, or
        the fitting one is the limit."""
        return self.fits >= self.limit or (self.misses is not None and self.misses - self.fits == 1)


def predicted_search(
    measure: Callable[[int], int | None],
    known: list[tuple[int, int]],
    budget: int,
    probes: int = 3,
    limit: int = 4096,
    intercept: int = 0,
    bracket: Bracket | None = None,
    max_growth: int = 8,
) -> Bracket:
    """The largest batch ``b`` in [1, ``limit``] whose peak ``measure(b)`` (None: out of memory)
    is at most ``budget``, in at most ``probes`` calls of ``measure``.

    ``known``: (batch, peak) pairs already measured. Each probe is the batch where a line
    through the two largest measured batches' peaks reaches ``budget`` (through one pair and
    ``intercept``, the peak's part that does not grow with the batch, e.g. the gradients, when
    only one is known), kept strictly between the largest fitting and the smallest missing
    batch, so a good prediction ends in two probes (it fits, the next batch does not). A probe
    is at most ``max_growth`` times the largest batch measured so far: a peak measured at a
    small batch is mostly what does not grow with it, and a line through it alone can predict a
    batch a hundred times larger, whose step would take as long as a hundred steps.
    ``bracket`` (optional) is filled as probes come in, so a caller interrupted midway keeps
    what was measured."""
    out = bracket if bracket is not None else Bracket()
    out.limit = limit
    pts = sorted({b: p for b, p in known}.items())
    for b, p in pts:
        if p <= budget:
            out.fits = max(out.fits, b)
        elif out.misses is None or b < out.misses:
            out.misses = b
    for _ in range(probes):
        top = limit if out.misses is None else out.misses - 1
        if out.fits >= top:
            break
        if len(pts) >= 2:
            (b1, p1), (b2, p2) = pts[-2], pts[-1]
            slope = (p2 - p1) / (b2 - b1) if b2 != b1 else 0.0
            base = p2 - slope * b2
        elif pts:
            b2, p2 = pts[-1]
            slope, base = (p2 - intercept) / b2, float(intercept)
        else:
            slope, base = 0.0, 0.0
        guess = int((budget - base) // slope) if slope > 0 else top
        largest = max((b for b, _ in pts), default=out.fits) or 1
        b = min(max(guess, out.fits + 1), top, max_growth * largest)
        peak = measure(b)
        out.probes.append((b, peak))
        if peak is not None and peak <= budget:
            out.fits = b
        else:
            out.misses = b if out.misses is None else min(out.misses, b)
        if peak is not None:
            pts = sorted({**dict(pts), b: peak}.items())
    return out


def peak_at(
    model: nn.Module,
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    batch: int,
    seq: int,
    vocab: int,
    device: torch.device | str,
    seed: int = 0,
    warmup: int = 1,
) -> int | None:
    """Peak of one forward+backward of ``model`` (as prepared: its strategy or plan kept) at
    ``batch x seq`` random tokens, after ``warmup`` unmeasured steps (a compiled block compiles
    at a new batch size there); None where CUDA ran out of memory."""
    gen = torch.Generator().manual_seed(seed + batch)
    x = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        forward(model, x, x).backward()

    try:
        for _ in range(warmup):
            step()
        model.zero_grad(set_to_none=True)
        gc.collect()
        return step_peak(step, device)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the parameters' gradients (part of a step's peak that does not grow with the
    batch)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return sum(p.numel() * p.element_size() for p in params)


def static_bytes(model: nn.Module) -> int:
    """Weights plus AdamW's two moments (fp32 like the weights): what the cap must also hold."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) * (1 + ADAM_MOMENTS)


def measure_peak(base: nn.Module, strategy: str, batch: int, cfg: MaxBatchConfig) -> int:
    """Peak of live bytes over one forward+backward of a fresh copy of ``base`` under
    ``strategy`` at ``batch x cfg.seq`` (after ``cfg.warmup`` unmeasured steps)."""
    model = copy.deepcopy(base)
    apply(model, strategy)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(cfg.seed + batch)
    x = torch.randint(0, vocab, (batch, cfg.seq), generator=gen).to(cfg.device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x, targets=x).loss.backward()

    for _ in range(cfg.warmup):
        step()
    model.zero_grad(set_to_none=True)
    gc.collect()  # nothing left from the warm-up is freed inside the measured step
    return step_peak(step, cfg.device)


def max_batch(
    cfg: MaxBatchConfig, log: Callable[[str], None] | None = None
) -> list[StrategyResult]:
    """The largest fitting batch of every strategy in ``cfg`` (see the module docstring)."""
    seed_everything(cfg.seed)
    kwargs = {"vocab_size": cfg.vocab_size} if cfg.vocab_size else {}
    base = build_model(cfg.model, **kwargs).to(cfg.device).train()
    static = static_bytes(base) if cfg.include_static else 0
    out = []
    for strategy in cfg.strategies:
        result = StrategyResult(strategy, 0, False, static)

        def fits(batch: int, strategy: str = strategy, result: StrategyResult = result) -> bool:
            t0 = time.perf_counter()
            peak = measure_peak(base, strategy, batch, cfg)
            ok = static + peak <= cfg.cap
            trial = Trial(batch, peak, static + peak, ok, round(time.perf_counter() - t0, 2))
            result.trials.append(trial)
            if log is not None:
                log(
                    f"{strategy:>12} batch {batch:>5}: peak {fmt_bytes(peak)} + static "
                    f"{fmt_bytes(static)} {'<=' if ok else '>'} cap {fmt_bytes(cfg.cap)}"
                )
            return ok

        result.max_batch, result.hit_limit = search(fits, cfg.start, cfg.limit)
        out.append(result)
    return out


def summary(cfg: MaxBatchConfig, results: list[StrategyResult]) -> dict:
    """JSON-able record: config, machine, per strategy the max batch, its ratio to ``none``'s and
    every trial."""
    base = next((r.max_batch for r in results if r.strategy == "none"), None)
    rows = []
    for r in results:
        row = asdict(r)
        row["ratio_to_none"] = r.max_batch / base if base else None
        fitting = [t for t in r.trials if t.fits]
        best = max(fitting, key=lambda t: t.batch) if fitting else None
        row["peak_at_max_bytes"] = best.peak_bytes if best else None
        rows.append(row)
    meta = machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": load_average()}
    return {"config": asdict(cfg), "machine": meta, "results": rows}


def table(data: dict) -> str:
    lines = [
        f"{'strategy':<14} {'max batch':>10} {'vs none':>8} {'peak at max':>12} {'trials':>7}",
    ]
    for r in data["results"]:
        ratio = f"{r['ratio_to_none']:.2f}x" if r["ratio_to_none"] else "-"
        peak = fmt_bytes(r["peak_at_max_bytes"]) if r["peak_at_max_bytes"] else "-"
        top = f"{r['max_batch']}{'+' if r['hit_limit'] else ''}"
        lines.append(f"{r['strategy']:<14} {top:>10} {ratio:>8} {peak:>12} {len(r['trials']):>7}")
    return "\n".join(lines)


def _cap_arg(text: str) -> int:
    try:
        return parse_cap(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument(
        "--cap", type=_cap_arg, required=True, help="memory cap: '2GiB', '512MiB', '123456B'"
    )
    p.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated strategies (default: %(default)s)",
    )
    p.add_argument("--start", type=int, default=1, help="first batch tried")
    p.add_argument("--limit", type=int, default=4096, help="largest batch tried")
    p.add_argument(
        "--no-static",
        action="store_true",
        help="compare the step peak alone with the cap (default: weights + AdamW moments too)",
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps before each peak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=None, help="override the model's vocabulary size")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cfg = MaxBatchConfig(
        model=args.model, seq=args.seq, cap=args.cap, strategies=split_strategies(args.strategies),
        start=args.start, limit=args.limit, include_static=not args.no_static,
        warmup=args.warmup, seed=args.seed, device=args.device, vocab_size=args.vocab,
    )  # fmt: skip
    log = None if args.json else functools.partial(print, flush=True)
    data = summary(cfg, max_batch(cfg, log))
    print(json.dumps(data) if args.json else table(data))
    return 0
