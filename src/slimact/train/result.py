"""What ``slimact.train.train`` returns: ``TrainResult`` and the baseline side-by-side."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimact.timing import RatioStats
from slimact.train.config import TrainConfig


@dataclass(frozen=True)
class SideBySide:
    """Strategy and baseline on the same batches (``--baseline``): first-step bytes and peak,
    interleaved fwd+bwd step times, losses."""

    mode: str
    saved_bytes: int
    peak_bytes: int
    step_time_s: float | None
    first_loss: float
    final_train_loss: float | None
    final_val_loss: float | None
    step_time_ratio: RatioStats | None
    rounds: int


@dataclass(frozen=True)
class TrainResult:
    """What a run achieved; ``history`` holds the metrics.jsonl records (all steps of the run)."""

    config: TrainConfig
    run_dir: Path
    device: str
    params: int
    steps: int
    final_train_loss: float | None
    final_val_loss: float | None
    final_val_ppl: float | None
    tokens_per_s: float
    saved_bytes: int | None
    history: list[dict[str, Any]]
    resumed_from: int | None = None
    interrupted: bool = False
    peak_bytes: int | None = None
    first_loss: float | None = None
    step_time_s: float | None = None  # median fwd+bwd seconds of the timed rounds
    baseline: SideBySide | None = None
    load_avg: tuple[float | None, float | None] = (None, None)
