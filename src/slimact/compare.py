"""Side-by-side measurement of a strategy against the baseline (``slimact memory``).

Both models are built from the same seed and run on the same batch. Saved bytes come from the
meter (``slimact.measure``) on the first step; peak memory over one whole step from
``slimact.peak``; step times from interleaved rounds (baseline, strategy, baseline, ...) as the
median of per-round ratios with its spread (``slimact.timing``); ``grad_cosine`` is the minimum over parameters of the cosine between the strategy's and
the baseline's gradients, skipping parameters whose baseline gradient norm is below 1e-6 × the
largest (e.g. gradients that vanish by symmetry).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from slimact.gradcheck import grad_error
from slimact.meter import MemoryReport, measure
from slimact.models import build_model, count_params
from slimact.peak import step_peak
from slimact.spec import compiles_blocks
from slimact.strategies import apply, resolve
from slimact.timing import interleaved
from slimact.utils import seed_everything

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CompareConfig:
    model: str
    strategy: str
    batch: int = 4
    seq: int = 256
    seed: int = 0
    steps: int = 5
    warmup: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    vocab_size: int | None = None
    rivals: tuple[str, ...] = ()  # more strategies measured beside it (--compare-compiled)

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.seq < 2:
            raise ValueError(f"seq must be >= 2, got {self.seq}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        resolve(self.strategy)  # unknown names fail here, listing the valid ones
        object.__setattr__(self, "rivals", tuple(self.rivals))
        for r in self.rivals:
            resolve(r)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _default_forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, targets=y).loss


def measured_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, forward: Forward | None = None
) -> tuple[MemoryReport, float]:
    """One forward+backward with the meter on: (report, loss). The gradients stay in ``.grad``."""
    fwd = forward or _default_forward
    model.zero_grad(set_to_none=True)
    with measure(model, n_tokens=x.numel()) as m:
        out_loss = fwd(model, x, y)
    out_loss.backward()
    return m.report, float(out_loss.detach().float())


def train_step_fn(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, forward: Forward | None = None
) -> Callable[[], None]:
    """A closure running one forward+backward (gradients freed first), for timing and peaks."""
    fwd = forward or _default_forward

    def step() -> None:
        model.zero_grad(set_to_none=True)
        fwd(model, x, y).backward()

    return step


def run_steps(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    warmup: int,
    forward: Forward | None = None,
) -> tuple[MemoryReport, float, float]:
    """One model alone: first step measured by the meter, then its peak over a step (``peak_bytes``
    of the report), then the median of ``steps`` timed steps. Returns (report, loss, median time).

    Use :func:`slimact.timing.interleaved` to compare points: timing one model after another
    measures the machine's load as much as the model. The first step's gradients are left in
    ``.grad``.
    """
    report, loss = measured_step(model, x, y, forward)
    grads = grads_of(model, x.device)
    step = train_step_fn(model, x, y, forward)
    report.peak_allocated_bytes = step_peak(step, x.device)
    timing = interleaved({"model": step}, rounds=steps, warmup=warmup)
    _restore_grads(model, grads)
    report.step_time_s = timing.median_s("model")
    return report, loss, report.step_time_s


def _restore_grads(model: nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        p.grad = grads.get(n)


def grads_of(model: nn.Module, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Detached copies of ``model``'s gradients by parameter name (on ``device``), so a baseline
    model can be freed and still compared with :func:`grad_cosine`."""
    return {
        n: p.grad.detach().to(device, copy=True)
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def grad_cosine(baseline: nn.Module | Mapping[str, torch.Tensor], other: nn.Module) -> float:
    """Min cosine over parameters with non-negligible baseline gradient (see module docstring).

    ``baseline`` is a model, or its gradients by parameter name (:func:`grads_of`)."""
    pairs = []
    if isinstance(baseline, Mapping):
        named = [(n, baseline.get(n), q) for n, q in other.named_parameters()]
        triples = [(n, g, q) for n, g, q in named if g is not None]
    else:
        triples = [
            (name, p.grad, q)
            for (name, p), (_, q) in zip(baseline.named_parameters(), other.named_parameters())
        ]
    for name, g, q in triples:
        if g is None:
            continue
        if q.grad is None:
            raise RuntimeError(
                f"parameter {name} has a baseline gradient but none under the strategy"
            )
        pairs.append((g.float().flatten().to(q.grad.device), q.grad.float().flatten()))
    if not pairs:
        raise RuntimeError("no parameter received a gradient")
    return 1.0 - grad_error([b for _, b in pairs], [a for a, _ in pairs])


def compare(cfg: CompareConfig) -> dict:
    """Baseline vs strategy on one batch; returns the ``slimact memory --json`` object.

    Saved bytes and loss from each model's first step (meter), ``grad_cosine`` from those
    gradients, peak memory from one more step each (:mod:`slimact.peak`), then ``cfg.steps``
    interleaved timing rounds (baseline, strategy, baseline, ...; :mod:`slimact.timing`).
    ``cfg.rivals`` are measured the same way and timed in the same rounds (``rivals``: one
    record each, or its ``error``).
    """
    device = torch.device(cfg.device)
    dtype = _DTYPES[cfg.dtype]

    def build() -> nn.Module:
        seed_everything(cfg.seed)
        m = build_model(cfg.model, vocab_size=cfg.vocab_size, device=device)
        return m.to(dtype)

    base = build()
    vocab = base.config.vocab_size
    if cfg.seq > base.config.max_seq_len:
        raise ValueError(
            f"seq {cfg.seq} exceeds {cfg.model}'s max_seq_len {base.config.max_seq_len}"
        )
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    strat = apply(build(), cfg.strategy)
    seed_everything(cfg.seed)
    base_report, base_loss = measured_step(base, x, y)
    base_grads = grads_of(base, device)
    seed_everything(cfg.seed)
    report, loss = measured_step(strat, x, y)
    cosine = grad_cosine(base_grads, strat)
    steps = {"baseline": train_step_fn(base, x, y), "strategy": train_step_fn(strat, x, y)}
    rivals = {}
    for name in cfg.rivals:  # measured as the strategy is; one that fails is reported, not fatal
        try:
            m = apply(build(), name)
            seed_everything(cfg.seed)
            r_report, r_loss = measured_step(m, x, y)
            rivals[name] = {"strategy": name, "saved_bytes": r_report.total_bytes,
                            "grad_cosine": grad_cosine(base_grads, m), "loss": r_loss}  # fmt: skip
            step = train_step_fn(m, x, y)
            step()  # a compiled rival compiles again without the meter: not in its peak
            steps[name] = step
        except Exception as e:
            rivals[name] = {"strategy": name, "error": f"{type(e).__name__}: {e}"}
    if compiles_blocks(cfg.strategy):
        steps["strategy"]()  # compiled blocks compile again without the meter: not in the peak
    peaks = {k: step_peak(fn, device) for k, fn in steps.items()}
    timing = interleaved(steps, rounds=cfg.steps, warmup=cfg.warmup)
    ratio = timing.ratio("strategy", "baseline")
    for name, rec in rivals.items():
        if name in steps:
            rec.update(
                peak_bytes=peaks[name],
                step_time_s=timing.median_s(name),
                step_time_ratio=timing.ratio(name, "baseline").median,
                ratio=rec["saved_bytes"] / base_report.total_bytes,
                peak_ratio=peaks[name] / peaks["baseline"] if peaks["baseline"] else None,
            )
    return {
        "model": cfg.model,
        "strategy": cfg.strategy,
        "params": count_params(strat),
        "batch": cfg.batch,
        "seq": cfg.seq,
        "vocab_size": vocab,
        "device": str(device),
        "dtype": cfg.dtype,
        "saved_bytes": report.total_bytes,
        "baseline_saved_bytes": base_report.total_bytes,
        "ratio": report.total_bytes / base_report.total_bytes,
        "param_cast_bytes": report.param_cast_bytes,  # autocast weight copies, not in saved_bytes
        "host_saved_bytes": report.host_bytes,  # offloaded to pinned host memory, not in saved_bytes
        "block_saved_bytes": report.block_bytes,
        "baseline_block_saved_bytes": base_report.block_bytes,
        "bytes_per_token_per_block": report.bytes_per_token_per_block(),
        "baseline_bytes_per_token_per_block": base_report.bytes_per_token_per_block(),
        "peak_bytes": peaks["strategy"],
        "baseline_peak_bytes": peaks["baseline"],
        "peak_ratio": peaks["strategy"] / peaks["baseline"] if peaks["baseline"] else None,
        "step_time_s": timing.median_s("strategy"),
        "baseline_step_time_s": timing.median_s("baseline"),
        "step_time_ratio": ratio.median,
        "step_time_ratio_spread": ratio.to_dict(),
        "timing": timing.to_dict(),
        "grad_cosine": cosine,
        "loss": loss,
        "baseline_loss": base_loss,
        "rivals": list(rivals.values()),
        "torch": torch.__version__,
    }
