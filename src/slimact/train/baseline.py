"""The baseline twin of a training run: what strategy ``none`` saves, peaks and costs, measured
on the same batches in the same process, so ``slimact train`` can end with the two side by side.

The twin is the same model (same weights, copied before the strategy touches anything) without
the strategy. Every step it runs right after the strategy's step, on the same micro-batches and
with the same RNG state (identical dropout masks), so each step is one *interleaved round*:

    ratio_step = t_fwd+bwd(strategy) / t_fwd+bwd(baseline)     (both under the same load)

and the reported step-time ratio is the median over rounds with its spread. The first round runs
under the meter (saved bytes) and the peak probe (``slimact.peak``, profiler on CPU) and is not
timed. The twin never changes the strategy's own RNG stream, so a run trains the same with or
without it.

Modes (``--baseline``):

- ``train``: the twin also takes its optimizer steps, so final train and validation losses compare.
  Costs a second model and about twice the time: meant for the demo and for studies.
- ``first-batch``: the twin runs forward+backward (no optimizer) for the first
  ``FIRST_BATCH_ROUNDS`` + 1 steps, then is freed: saved bytes, peak and timing, not loss curves.
- ``off``: no twin.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from slimact.meter import measure
from slimact.peak import peak_and_result
from slimact.timing import RatioStats
from slimact.train.steps import Batch, clip_and_step, evaluate, forward_backward, make_optimizer

BASELINE_MODES = ("train", "first-batch", "off")
FIRST_BATCH_ROUNDS = 5  # timed rounds of a first-batch twin (after its measured first step)
WARMUP_ROUNDS = 1  # rounds after the measured one that are timed but not counted (lazy inits)

RngState = tuple[torch.Tensor, torch.Tensor | None]


def rng_snapshot(device: str) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.startswith("cuda") else None
    return torch.get_rng_state(), cuda


@contextmanager
def replayed_rng(state: RngState, device: str) -> Iterator[None]:
    """Run with the RNG as it was at ``state``; the caller's RNG stream is restored after."""
    devices = [torch.device(device)] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


@dataclass
class FirstStep:
    """What the meter and the peak probe saw on the first micro-batch step of one model."""

    saved_bytes: int
    peak_bytes: int
    loss: float


def measured_forward_backward(
    model: nn.Module, batches: Sequence[Batch], device: str
) -> tuple[FirstStep, float]:
    """Forward+backward of ``batches`` with the meter on the first micro-batch's forward and the
    peak of live memory over the whole forward+backward; returns (first step, mean loss)."""
    saved: list[int] = []

    def metered(run):  # type: ignore[no-untyped-def]
        with measure(model, n_tokens=batches[0][0].numel()) as meter:
            loss = run()
        saved.append(int(meter.report.total_bytes))
        return loss

    peak, (loss, _) = peak_and_result(
        lambda: forward_backward(model, batches, device, first=metered), device
    )
    return FirstStep(saved[0], peak, loss), loss


class BaselineTwin:
    """The strategy-free copy of the trained model; see the module docstring."""

    def __init__(
        self, model: nn.Module, mode: str, device: str, lr: float, weight_decay: float
    ) -> None:
        if mode not in ("train", "first-batch"):
            raise ValueError(f"BaselineTwin mode must be 'train' or 'first-batch', got {mode!r}")
        self.mode, self.device = mode, device
        self.model: nn.Module | None = model.to(device).train()
        self.optimizer = make_optimizer(model, lr, weight_decay) if mode == "train" else None
        self.first: FirstStep | None = None
        self.times: list[float] = []  # fwd+bwd seconds per timed round
        self.losses: list[float] = []
        self.val_loss: float | None = None

    @property
    def active(self) -> bool:
        return self.model is not None

    def step(self, batches: Sequence[Batch], rng: RngState, lr: float, clip: float) -> None:
        """One round on the strategy's micro-batches, replaying its RNG state."""
        if self.model is None:
            return
        with replayed_rng(rng, self.device):
            if self.optimizer is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            self.model.zero_grad(set_to_none=True)
            if self.first is None:
                self.first, loss = measured_forward_backward(self.model, batches, self.device)
            else:
                loss, seconds = forward_backward(self.model, batches, self.device)
                self.times.append(seconds)
            self.losses.append(loss)
            if self.optimizer is not None:
                clip_and_step(self.optimizer, clip)
        if self.mode == "first-batch" and len(self.times) >= WARMUP_ROUNDS + FIRST_BATCH_ROUNDS:
            self.model = None  # done: free the twin

    def evaluate(self, batches: list[Batch]) -> None:
        if self.model is not None and self.mode == "train":
            self.val_loss = evaluate(self.model, batches, self.device)


def ratio_over_rounds(
    strategy_s: Sequence[float], baseline_s: Sequence[float]
) -> RatioStats | None:
    """Median per-round ratio of the rounds both timed, after ``WARMUP_ROUNDS`` (the first,
    measured round is not timed at all)."""
    n = min(len(strategy_s), len(baseline_s))
    skip = WARMUP_ROUNDS if n > WARMUP_ROUNDS else 0
    pairs = [a / b for a, b in zip(strategy_s[skip:n], baseline_s[skip:n]) if b > 0]
    return RatioStats.of(pairs) if pairs else None
