"""Metrics sinks: ``metrics.jsonl`` in the run dir (one JSON object per step) and TensorBoard.

The JSONL file is the source of truth. On resume it is cut back to the checkpoint's step (a run
that died after its last checkpoint may have logged steps that will now be redone), so the file of
a resumed run reads exactly like that of an uninterrupted one. TensorBoard events are written to
``<run dir>/tb`` when ``torch.utils.tensorboard`` imports (it needs the ``tensorboard`` package)
and silently skipped otherwise.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics file (a run dir or the file itself); a torn last line is dropped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _tensorboard_writer(log_dir: Path) -> Any | None:
    try:  # optional: needs the tensorboard package, not a slimact dependency
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    try:
        return SummaryWriter(log_dir=str(log_dir))
    except Exception:  # a broken tensorboard install must not stop training
        return None


class MetricsLog:
    """Append-only JSONL log (+ TensorBoard). ``resume_step`` keeps records up to that step."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.history: list[dict[str, Any]] = []
        if resume_step is not None:
            self.history = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in self.history)
        os.replace(tmp, self.path)
        self._fh = self.path.open("a")
        self._tb = _tensorboard_writer(self.run_dir / "tb")

    def log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
