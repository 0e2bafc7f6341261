"""Run one suite in one process and write its results JSON.

For each model case the baseline (``none``) is measured first, then every other point back to
back, all from the same seed on the same batch:

1. **one step** (``slimact.compare.run_steps``): saved bytes from the meter (unique storages,
   parameters excluded) with the per-site report of one block (the middle one), the median step
   time over ``timing_steps`` forward+backward after ``warmup``, tokens/s = tokens per step /
   step time, ``grad_cosine`` against the baseline's gradients, and on CUDA the peak allocated
   memory of that step;
2. **a short training run**: ``train_steps`` AdamW steps (``slimact.train.make_optimizer``,
   ``WarmupCosine``, clipping 0.5) on the embedded corpus (``slimact.data``: byte tokens,
   ``BatchLoader`` from the suite's seed, so every point sees the same batches), giving the loss
   curve, and the validation loss after N steps (``loss@N``: fixed val windows). For BERT the
   batches are masked with ``slimact.hf.mlm_batch``. ``auto`` runs its plan evolver as
   ``slimact train`` does.

A point that cannot run (``cola-m`` on a non-CoLA model, a strategy failing on a model) is recorded
with ``skipped`` = the exception message, never dropped. The JSON is rewritten after every point,
so an interrupted run leaves what it measured (``meta.complete`` is false until the end).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from slimact.bench.suites import ModelCase, Suite

SCHEMA_VERSION = 1
MASK_TOKEN_ID = 103  # BERT's [MASK]
Log = Callable[[str], None]


def default_results_dir() -> Path:
    """``benchmarks/results/bench`` of the source checkout, else of the working directory."""
    root = Path(__file__).resolve().parents[3]
    if (root / "benchmarks").is_dir():
        return root / "benchmarks" / "results" / "bench"
    return Path.cwd() / "benchmarks" / "results" / "bench"


# ----------------------------------------------------------------------------- models and data
def build(model_name: str, device: torch.device, seed: int) -> nn.Module:
    """The model of a case, built from ``seed`` (random weights) on ``device``, in train mode."""
    from slimact.bench.suites import HF_MODELS
    from slimact.data import ByteTokenizer
    from slimact.utils import seed_everything

    seed_everything(seed)
    if model_name in HF_MODELS:
        from transformers import BertConfig, BertForMaskedLM

        model = BertForMaskedLM(BertConfig())
    else:
        from slimact.models import build_model

        model = build_model(model_name, vocab_size=ByteTokenizer().vocab_size)
    return model.to(device).train()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from slimact.hf import lm_loss

    return lm_loss(model, x, y)


class Data:
    """Batches of one case: the measurement batch, a training loader, fixed val batches."""

    def __init__(self, case: ModelCase, splits: Any, seed: int, device: torch.device) -> None:
        from slimact.bench.suites import HF_MODELS
        from slimact.data import BatchLoader, fixed_batches

        self.mlm = case.model in HF_MODELS
        self.device = device
        self.case, self.splits, self.seed = case, splits, seed
        self.batch = self._prep(
            BatchLoader(splits.train, case.batch, case.seq, seed + 1).next_batch(), 0
        )
        val = fixed_batches(splits.val, case.batch, case.seq, case.eval_batches)
        self.val = [self._prep(b, 10_000 + i) for i, b in enumerate(val)]

    def _prep(self, b: tuple[torch.Tensor, torch.Tensor], mask_seed: int):
        x, y = b
        if self.mlm:
            from slimact.hf import mlm_batch

            x, y = mlm_batch(x, MASK_TOKEN_ID, seed=self.seed + mask_seed)
        return x.to(self.device), y.to(self.device)

    def train_batches(self):
        from slimact.data import BatchLoader

        loader = BatchLoader(self.splits.train, self.case.batch, self.case.seq, self.seed)
        step = 0
        while True:
            step += 1
            yield self._prep(loader.next_batch(), step)


# ----------------------------------------------------------------------------- one point
def _autocast(device: torch.device, bf16: bool):
    if bf16 and device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext


def _block_sites(report: Any, blocks: list[str]) -> tuple[str, list[dict]]:
    """The per-site bytes of the middle block, with site names relative to the block."""
    if not blocks:
        return "", []
    block = blocks[len(blocks) // 2]
    out = []
    for s in report.sites:
        if s.block != block or s.bytes <= 0:
            continue
        rel_module = s.module[len(block) + 1 :] if s.module.startswith(block + ".") else ""
        out.append(
            {
                "site": f"{rel_module}:{s.site.split(':', 1)[1]}",
                "module": rel_module or "(block)",
                "op": s.op,
                "action": s.action,
                "bytes": int(s.bytes),
            }
        )
    return block, out


def _train(model, forward, data: Data, case: ModelCase, seed: int) -> dict:
    from slimact.planner import PlanEvolver
    from slimact.train import WarmupCosine, make_optimizer
    from slimact.utils import seed_everything

    seed_everything(seed)
    opt = make_optimizer(model, case.lr, 0.01)
    sched = WarmupCosine(case.lr, case.train_steps, max(1, case.train_steps // 10), 0.1)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses, t_train = [], 0.0
    device = data.device
    with tempfile.TemporaryDirectory() as tmp:
        evolver = PlanEvolver.for_model(model, log_path=Path(tmp) / "plan_changes.jsonl")
        batches = data.train_batches()
        for step in range(case.train_steps):
            sched.set_lr(opt, step)
            x, y = next(batches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = forward(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            value = float(loss.detach().float().item())
            t_train += time.perf_counter() - t0
            if not math.isfinite(value):
                raise FloatingPointError(f"training loss became {value} at step {step + 1}")
            losses.append(value)
            if evolver is not None:
                evolver.on_step(step + 1, model)
    with torch.no_grad():
        was = model.training
        model.eval()
        val = [float(loss_fn(model, x, y).float().item()) for x, y in data.val]
        model.train(was)
    return {
        "steps": case.train_steps,
        "losses": losses,
        "final_train_loss": losses[-1],
        "val_loss": sum(val) / len(val),
        "train_tokens_per_s": case.train_steps * case.tokens_per_step / t_train,
    }


def measure_point(
    case: ModelCase,
    point_name: str,
    data: Data,
    suite: Suite,
    baseline: dict | None,
    base_grads: dict[str, torch.Tensor] | None,
    log: Log,
) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Measure one (model, point); returns its record and, for the baseline, its gradients."""
    import slimact
    from slimact import sites
    from slimact.bench import anchors
    from slimact.bench.suites import BenchPoint
    from slimact.compare import grad_cosine, grads_of, run_steps
    from slimact.utils import seed_everything

    point = BenchPoint(point_name)
    device = data.device
    rec: dict[str, Any] = {
        "model": case.model,
        "point": point.name,
        "kind": point.kind,
        "skipped": None,
        "note": "",
    }
    t_start = time.perf_counter()
    ac = _autocast(device, suite.bf16)
    model = build(case.model, device, suite.seed)
    rec["params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    prepared = None
    try:
        if point.is_anchor:
            prepared = anchors.prepare(point.anchor, model, loss_fn, device, suite.compile_budget)
            forward, rec["note"] = prepared.forward, prepared.note
        else:
            slimact.apply(model, point.name)
            forward = loss_fn
            skipped = [c for c in slimact.applied(model) if c.skipped]
            if skipped:
                rec["note"] = (
                    f"{len(skipped)} target(s) skipped, e.g. {skipped[0].path}: {skipped[0].detail}"
                )

        def fwd(m, x, y):
            with ac():
                return forward(m, x, y)

        x, y = data.batch
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        seed_everything(suite.seed)
        report, loss, step_s = run_steps(model, x, y, case.timing_steps, case.warmup, forward=fwd)
        grads = grads_of(model) if baseline is None else None
        saved = int(report.total_bytes)
        if prepared is not None and not prepared.meter_sees_saves and device.type != "cuda":
            saved = int(baseline["saved_bytes"]) if baseline else saved
        block, site_rows = _block_sites(report, sites.block_paths(model))
        rec.update(
            saved_bytes=saved,
            block_saved_bytes=int(report.block_bytes),
            step_time_s=step_s,
            tokens_per_s=case.tokens_per_step / step_s,
            first_loss=loss,
            grad_cosine=1.0 if baseline is None else grad_cosine(base_grads, model),
            peak_allocated_bytes=report.peak_allocated_bytes,
            resident_bytes_before=resident,
            sites_block=block,
            sites=site_rows,
        )
        if baseline is not None:
            rec["ratio"] = saved / baseline["saved_bytes"] if baseline["saved_bytes"] else None
            rec["step_time_ratio"] = step_s / baseline["step_time_s"]
        else:
            rec["ratio"], rec["step_time_ratio"] = 1.0, 1.0
        log(
            f"  {case.model:<13} {point.name:<26} saved {saved / 2**20:9.2f} MiB  "
            f"ratio {rec['ratio'] or 0:6.3f}  step {step_s:7.3f} s  cos {rec['grad_cosine']:.5f}"
        )
        try:
            rec["train"] = _train(model, fwd, data, case, suite.seed)
            log(
                f"  {'':<13} {'':<26} loss@{case.train_steps} {rec['train']['val_loss']:.4f} "
                f"(train {rec['train']['final_train_loss']:.4f})"
            )
        except Exception as e:  # the measurement stands; the training failure is recorded
            rec["train"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {'':<13} {'':<26} training failed: {e}")
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        rec["skipped"] = f"{type(e).__name__}: {e}".strip()
        rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-3:]
        log(f"  {case.model:<13} {point.name:<26} skipped: {rec['skipped'][:150]}")
        grads = None
    finally:
        if prepared is not None:
            prepared.restore()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rec["wall_s"] = time.perf_counter() - t_start
    return rec, grads


# ----------------------------------------------------------------------------- the suite
def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def _dirty_files() -> list[str] | None:
    """Tracked files under src/ that differ from the commit (the run used them as they are)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "src"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [ln[3:] for ln in out.stdout.splitlines() if ln.strip()]


def _load() -> list[float] | None:
    """1/5/15-minute load averages (how busy the machine was; timings move with it)."""
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_suite(
    suite: Suite,
    out_dir: str | Path | None = None,
    threads: int | None = None,
    data: str | None = None,
    selection: dict | None = None,
    log: Log = print,
    command: str | None = None,
) -> Path:
    """Run every point of ``suite``; write and return ``<out_dir>/<suite>.json``."""
    from slimact.data import load_data
    from slimact.envinfo import machine_info

    if threads:
        torch.set_num_threads(threads)
    device = torch.device(suite.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"suite {suite.name!r} needs CUDA, but no GPU is visible")
    out = Path(out_dir) if out_dir is not None else default_results_dir()
    name = suite.name if not selection else f"{suite.name}-subset"
    path = out / f"{name}.json"
    t0 = time.perf_counter()
    meta = {
        "schema": SCHEMA_VERSION,
        **machine_info(),
        **({"command": command} if command else {}),
        "suite": suite.config(),
        "selection": selection or {},
        "uncommitted_src": _dirty_files(),
        "data": data or "embedded stdlib corpus (byte tokens)",
        "start": _now(),
        "load_avg_start": _load(),
        "end": None,
        "wall_s": None,
        "complete": False,
    }
    if device.type == "cuda":
        meta["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    result: dict[str, Any] = {"meta": meta, "points": []}
    splits = load_data(data)
    log(f"slimact bench {suite.name}: {sum(len(c.points) for c in suite.cases)} points -> {path}")
    for case in suite.cases:
        case_data = Data(case, splits, suite.seed, device)
        baseline, base_grads = None, None
        for p in case.points:
            rec, grads = measure_point(case, p.name, case_data, suite, baseline, base_grads, log)
            if baseline is None:
                if rec["skipped"]:
                    raise RuntimeError(f"the baseline of {case.model} failed: {rec['skipped']}")
                baseline, base_grads = rec, grads
            result["points"].append(rec)
            meta["wall_s"] = time.perf_counter() - t0
            _write(path, result)
    meta.update(end=_now(), wall_s=time.perf_counter() - t0, complete=True, load_avg_end=_load())
    _write(path, result)
    log(f"wrote {path} ({meta['wall_s'] / 60:.1f} min)")
    return path
