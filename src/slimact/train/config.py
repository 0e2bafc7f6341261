"""``TrainConfig``: every knob of a training run, validated once, frozen afterwards.

Defaults follow cola.txt App. D where they transfer to small models: AdamW with lr 3e-3, a
linear warm-up over 10% of the steps, then cosine decay to ``min_lr_ratio * lr``; weight decay
0.01 and gradient clipping at 0.5. ``warmup`` below 1 is a fraction of ``steps``, 1 or more is a
step count. Errors name the bad value and the valid range. The config round-trips through JSON
(``to_dict``/``from_dict``), which is how checkpoints record it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimact.models import get_spec
from slimact.strategies import resolve

# Fields that change what a run computes; resuming requires them to match the checkpoint.
TRAJECTORY_FIELDS = (
    "model",
    "strategy",
    "steps",
    "batch",
    "seq",
    "grad_accum",
    "lr",
    "min_lr_ratio",
    "warmup",
    "weight_decay",
    "clip",
    "seed",
    "data",
)
DEVICES = ("auto", "cpu", "cuda")
BASELINES = ("auto", "train", "first-batch", "off")  # see slimact.train.baseline
# What `slimact train` trains with when no --strategy is given: the one the README recommends
# to a new user (outlier-aware INT4, adacc.txt §3.2: ~4x fewer saved bytes, loss within ~0.2%).
DEFAULT_STRATEGY = "int4"
DIST_MODES = ("none", "ddp", "fsdp")  # "none": one process; ddp/fsdp: under torchrun
# Largest peak lr accepted: AdamW's steps are ~lr per weight, so above 1 every step moves each
# weight by more than its init scale (0.02) fifty times over; such a run only diverges.
MAX_LR = 1.0


def _model_max_seq_len(model: str) -> int:
    return int(get_spec(model).config.max_seq_len)


def _check_strategy(strategy: str) -> None:
    resolve(strategy)


@dataclass(frozen=True)
class TrainConfig:
    model: str = "llama-20m"
    strategy: str = DEFAULT_STRATEGY
    steps: int = 100
    batch: int = 8
    seq: int = 256
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.1
    weight_decay: float = 0.01
    clip: float = 0.5
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    data: str | None = None
    out: str | None = None
    resume: bool | str = False  # True/'latest', or 'latest-valid' (see slimact.train.resume)
    keep_last: int = 2
    ckpt_every: int = 100
    threads: int | None = None
    device: str = "auto"
    progress: bool = True
    stop_at: int | None = None
    dist: str = "none"
    baseline: str = "auto"

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("steps", "batch", "seq", "grad_accum", "eval_every", "eval_batches", "seed"):
            need(is_int(getattr(self, name)), f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("lr", "min_lr_ratio", "warmup", "weight_decay", "clip"):
            v = getattr(self, name)
            need(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                f"{name} must be a finite number, got {v!r}",
            )
        need(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        need(self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        need(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        max_seq = _model_max_seq_len(self.model)  # also rejects unknown model names
        need(
            2 <= self.seq <= max_seq,
            f"seq must be in [2, {max_seq}] (model {self.model!r} has max_seq_len {max_seq}), "
            f"got {self.seq}",
        )
        _check_strategy(self.strategy)
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(
            self.lr <= MAX_LR,
            f"lr must be in (0, {MAX_LR}] (AdamW's peak learning rate; cola.txt uses 3e-3), "
            f"got {self.lr}",
        )
        need(
            0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )
        need(
            0 <= self.warmup < 1 or (self.warmup >= 1 and float(self.warmup).is_integer()),
            f"warmup must be a fraction in [0, 1) or a whole number of steps, got {self.warmup}",
        )
        need(
            self.warmup_steps <= self.steps,
            f"warmup of {self.warmup_steps} steps exceeds steps={self.steps}; use at most {self.steps}",
        )
        need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        need(self.clip >= 0, f"clip must be >= 0 (0 disables clipping), got {self.clip}")
        need(
            self.eval_every >= 0,
            f"eval_every must be >= 0 (0 = only at the end), got {self.eval_every}",
        )
        need(self.eval_batches >= 1, f"eval_batches must be >= 1, got {self.eval_batches}")
        need(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        need(
            is_int(self.keep_last) and self.keep_last >= 1,
            f"keep_last must be >= 1, got {self.keep_last}",
        )
        need(
            is_int(self.ckpt_every) and self.ckpt_every >= 0,
            f"ckpt_every must be >= 0 (0 = only at the end), got {self.ckpt_every}",
        )
        need(
            self.threads is None or (is_int(self.threads) and self.threads >= 1),
            f"threads must be >= 1 (or unset), got {self.threads}",
        )
        need(
            self.device in DEVICES or self.device.startswith("cuda:"),
            f"device must be one of {', '.join(DEVICES)} or cuda:N, got {self.device!r}",
        )
        need(
            self.stop_at is None or (is_int(self.stop_at) and 1 <= self.stop_at <= self.steps),
            f"stop_at must be in [1, steps={self.steps}] (or unset), got {self.stop_at}",
        )
        need(
            self.resume in (False, True, "latest", "latest-valid"),
            "resume must be False, True (the latest checkpoint) or one of ('latest', "
            f"'latest-valid'), got {self.resume!r}",
        )
        need(
            self.dist in DIST_MODES,
            f"dist must be one of {', '.join(DIST_MODES)}, got {self.dist!r}",
        )
        need(
            self.baseline in BASELINES,
            f"baseline must be one of {', '.join(BASELINES)}, got {self.baseline!r}",
        )
        need(
            not (self.baseline == "train" and (self.resume or self.dist != "none")),
            "baseline 'train' needs a fresh single-process run (no --resume, --dist none); "
            "use --baseline first-batch or off",
        )
        if self.data is not None:
            object.__setattr__(self, "data", str(self.data))
        if self.out is not None:
            object.__setattr__(self, "out", str(self.out))

    def resolved_baseline(self) -> str:
        """``auto``: no twin for strategy ``none``; a first-batch twin when resuming or under
        ``--dist``; otherwise a twin trained alongside (``slimact.train.baseline``)."""
        if self.baseline != "auto":
            return self.baseline
        if self.strategy == "none":
            return "off"
        return "first-batch" if (self.resume or self.dist != "none") else "train"

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup) if self.warmup >= 1 else round(self.warmup * self.steps)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq * self.grad_accum

    @property
    def run_dir(self) -> Path:
        strategy = self.strategy.replace("+", "_").replace("/", "_")
        return Path(self.out or f"runs/{self.model}-{strategy}-{self.seed}")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return self.device

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s): {', '.join(unknown)}")
        return cls(**d)

    def mismatches(self, other: TrainConfig) -> list[str]:
        """Human-readable differences in the fields that shape the training trajectory."""
        return [
            f"{name}: checkpoint has {getattr(other, name)!r}, this run has {getattr(self, name)!r}"
            for name in TRAJECTORY_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]
