"""Side-by-side measurement of a strategy against the baseline (``slimact memory``).

Both models are built from the same seed and run on the same batch. Saved bytes come from the
meter (``slimact.measure``) on the first step; step times are medians over a few steps after a
warm-up; ``grad_cosine`` is the minimum over parameters of the cosine between the strategy's and
the baseline's gradients, skipping parameters whose baseline gradient norm is below 1e-6 × the
largest (e.g. gradients that vanish by symmetry).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from slimact.meter import MemoryReport, measure
from slimact.models import build_model, count_params
from slimact.strategies import apply, resolve
from slimact.utils import seed_everything


@dataclass(frozen=True)
class CompareConfig:
    model: str
    strategy: str
    batch: int = 4
    seq: int = 256
    seed: int = 0
    steps: int = 3
    warmup: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    vocab_size: int | None = None

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


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _default_forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, targets=y).loss


def run_steps(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    warmup: int,
    forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[MemoryReport, float, float]:
    """First step measured by the meter; returns (report, first loss, median step time).

    ``forward(model, x, y) -> loss`` replaces ``model(x, targets=y).loss`` (e.g.
    ``slimact.hf.lm_loss`` for Hugging Face models, which take ``labels=``).
    """
    fwd = forward or _default_forward
    device = x.device
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with measure(model, n_tokens=x.numel()) as m:
        out_loss = fwd(model, x, y)
    out_loss.backward()
    report, loss = m.report, out_loss.item()
    if device.type == "cuda":
        _sync(device)
        report.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    times = []
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        fwd(model, x, y).backward()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    for n, p in model.named_parameters():  # leave the first step's gradients in place
        p.grad = grads.get(n)
    report.step_time_s = statistics.median(times)
    return report, loss, report.step_time_s


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
    largest = max(float(a.norm()) for a, _ in pairs)
    cosines = [
        float(F.cosine_similarity(a, b, dim=0))
        for a, b in pairs
        if float(a.norm()) >= 1e-6 * largest
    ]
    return min(cosines)


def compare(cfg: CompareConfig) -> dict:
    """Baseline vs strategy on one batch; returns the ``slimact memory --json`` object."""
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
    seed_everything(cfg.seed)
    base_report, base_loss, base_time = run_steps(base, x, y, cfg.steps, cfg.warmup)
    strat = apply(build(), cfg.strategy)
    seed_everything(cfg.seed)
    report, loss, step_time = run_steps(strat, x, y, cfg.steps, cfg.warmup)
    return {
        "model": cfg.model,
        "strategy": cfg.strategy,
        "params": count_params(strat),
        "batch": cfg.batch,
        "seq": cfg.seq,
        "device": str(device),
        "dtype": cfg.dtype,
        "saved_bytes": report.total_bytes,
        "baseline_saved_bytes": base_report.total_bytes,
        "ratio": report.total_bytes / base_report.total_bytes,
        "block_saved_bytes": report.block_bytes,
        "baseline_block_saved_bytes": base_report.block_bytes,
        "bytes_per_token_per_block": report.bytes_per_token_per_block(),
        "baseline_bytes_per_token_per_block": base_report.bytes_per_token_per_block(),
        "step_time_s": step_time,
        "baseline_step_time_s": base_time,
        "step_time_ratio": step_time / base_time,
        "grad_cosine": grad_cosine(base, strat),
        "loss": loss,
        "baseline_loss": base_loss,
        "peak_allocated_bytes": report.peak_allocated_bytes,
        "baseline_peak_allocated_bytes": base_report.peak_allocated_bytes,
        "torch": torch.__version__,
    }
