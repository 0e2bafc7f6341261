"""Run one suite in one process and write its results JSON.

Every model case runs in two phases, all points from the same seed on the same batch
(``Data.batch``) with the same forward (and autocast context):

**Phase 1, one point after another** (baseline ``none`` first):

1. the first step with the meter on (``slimact.compare.measured_step``): saved bytes (unique
   storages, parameters excluded), the per-site report of one block (the middle one), the loss
   head's saved bytes and share (``head_saved_bytes``: sites outside blocks in the output
   projection ``lm_head`` / HF's ``cls`` head or at the root, i.e. the loss), and ``grad_cosine``
   against the baseline's gradients;
2. the peak over one more step (``slimact.peak.step_peak``: live bytes above those at its start;
   CPU from the profiler's memory events, CUDA from the allocator): ``peak_bytes``, and
   ``peak_ratio`` against the baseline. That step is never timed;
3. a short training run: ``train_steps`` AdamW steps (``slimact.train.make_optimizer``,
   ``WarmupCosine``, clipping 0.5) on the embedded corpus (``slimact.data``: byte tokens,
   ``BatchLoader`` from the suite's seed, so every point sees the same batches) or, for a case
   with ``vocab_size``, on random ids from a seeded generator; giving the loss curve and the
   validation loss after N steps (``loss@N``). For BERT the batches are masked with
   ``slimact.hf.mlm_batch``. ``auto`` runs its plan evolver as ``slimact train`` does.

The point's prepared model is then kept (gradients freed, the optimizer gone with the run; an
anchor keeps its prepared forward) for

**Phase 2, all points together** (:mod:`slimact.bench.timing_phase`): ``timing_steps``
interleaved rounds after ``warmup`` (``slimact.timing.interleaved``, baseline first in each
round), giving ``step_time_s`` (median), ``step_time_ratio`` (median of per-round ratios against
``none``) with its spread, and tokens/s; the case's load average before and after the rounds goes
to ``meta.timing``. Then the anchors are undone and the models freed.

A point that cannot run (``cola-m`` on a non-CoLA model, a strategy failing on a model) is recorded
with ``skipped`` = the exception message, never dropped, and is not in the timing rounds. The JSON
is rewritten after every point and after each case's timing, so an interrupted run leaves what it
measured (``meta.complete`` is false until the end).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from slimact import sites
from slimact.bench import anchors
from slimact.bench.case_data import Data, build, loss_fn, train_point
from slimact.bench.cases import BenchPoint, ModelCase, Suite
from slimact.bench.timing_phase import Live, release, time_case
from slimact.compare import grad_cosine, grads_of, measured_step, train_step_fn
from slimact.data import load_data
from slimact.envinfo import machine_info
from slimact.peak import step_peak
from slimact.strategies import applied, apply
from slimact.utils import seed_everything

SCHEMA_VERSION = 2
HEAD_MODULES = ("lm_head", "cls")  # the output projection: slimact's models, HF BERT's MLM head
Log = Callable[[str], None]


def default_results_dir() -> Path:
    """``benchmarks/results/bench`` of the source checkout, else of the working directory."""
    root = Path(__file__).resolve().parents[3]
    if (root / "benchmarks").is_dir():
        return root / "benchmarks" / "results" / "bench"
    return Path.cwd() / "benchmarks" / "results" / "bench"


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


def head_bytes(report: Any) -> int:
    """Saved bytes of the loss head: sites outside blocks (empty ``block``) whose module is the
    output projection (``HEAD_MODULES`` and below) or the root, where the loss is computed."""
    return sum(
        int(s.bytes)
        for s in report.sites
        if not s.block and (s.module == "" or s.module.split(".")[0] in HEAD_MODULES)
    )


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def measure_point(
    case: ModelCase,
    point_name: str,
    data: Data,
    suite: Suite,
    baseline: dict | None,
    base_grads: dict[str, torch.Tensor] | None,
    log: Log,
) -> tuple[dict, dict[str, torch.Tensor] | None, Live | None]:
    """Phase 1 of one (case, point): its record, the baseline's gradients (for the baseline
    only), and the prepared model kept for the timing rounds (None when skipped)."""
    point = BenchPoint(point_name)
    device = data.device
    rec: dict[str, Any] = {
        "model": case.model,
        "case": case.label,
        "point": point.name,
        "kind": point.kind,
        "skipped": None,
        "note": "",
    }
    t_start = time.perf_counter()
    ac = _autocast(device, suite.bf16)
    model = build(case.model, device, suite.seed, case.vocab_size)
    rec["params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    rec["vocab_size"] = int(model.config.vocab_size)
    prepared, grads, live = None, None, None
    try:
        if point.is_anchor:
            prepared = anchors.prepare(point.anchor, model, loss_fn, device, suite.compile_budget)
            forward, rec["note"] = prepared.forward, prepared.note
        else:
            apply(model, point.name)
            forward = loss_fn
            skipped = [c for c in applied(model) if c.skipped]
            if skipped:
                rec["note"] = (
                    f"{len(skipped)} target(s) skipped, e.g. {skipped[0].path}: {skipped[0].detail}"
                )

        def fwd(m, x, y):
            with ac():
                return forward(m, x, y)

        x, y = data.batch
        seed_everything(suite.seed)
        report, loss = measured_step(model, x, y, fwd)
        grads = grads_of(model) if baseline is None else None
        cosine = 1.0 if baseline is None else grad_cosine(base_grads, model)
        saved, head = int(report.total_bytes), head_bytes(report)
        if prepared is not None and prepared.compiled:
            head = None  # the compiled graph's saves reach the meter unnamed
        if prepared is not None and not prepared.meter_sees_saves and device.type != "cuda":
            saved = int(baseline["saved_bytes"]) if baseline else saved
            head = baseline.get("head_saved_bytes") if baseline else head
        step = train_step_fn(model, x, y, fwd)
        if prepared is not None and prepared.compiled:
            step()  # a call without the meter's hooks may recompile: not inside the peak
        model.zero_grad(set_to_none=True)  # the peak counts the step's gradients as its own
        peak = step_peak(step, device)
        model.zero_grad(set_to_none=True)
        block, site_rows = _block_sites(report, sites.block_paths(model))
        rec.update(
            saved_bytes=saved,
            block_saved_bytes=int(report.block_bytes),
            head_saved_bytes=head,
            head_share=_ratio(head, saved),
            first_loss=loss,
            grad_cosine=cosine,
            peak_bytes=int(peak),
            sites_block=block,
            sites=site_rows,
        )
        if baseline is not None:
            rec["ratio"] = _ratio(saved, baseline["saved_bytes"])
            rec["peak_ratio"] = _ratio(peak, baseline.get("peak_bytes"))
        else:
            rec["ratio"], rec["peak_ratio"] = 1.0, 1.0
        share = "-" if rec["head_share"] is None else f"{rec['head_share']:.1%}"
        log(
            f"  {case.label:<22} {point.name:<26} saved {saved / 2**20:9.2f} MiB  "
            f"ratio {rec['ratio'] or 0:6.3f}  peak {peak / 2**20:9.2f} MiB  head {share}  "
            f"cos {cosine:.5f}"
        )
        try:
            rec["train"] = train_point(model, fwd, data, case, suite.seed)
            log(
                f"  {'':<22} {'':<26} loss@{case.train_steps} {rec['train']['val_loss']:.4f} "
                f"(train {rec['train']['final_train_loss']:.4f})"
            )
            if rec["train"].get("plan_changes"):
                rec["note"] = (rec["note"] + "; " if rec["note"] else "") + (
                    f"plan re-solved {rec['train']['plan_changes']}x in training: bytes and peak "
                    "are of the first plan, step time of the last"
                )
        except Exception as e:  # the measurement stands; the training failure is recorded
            rec["train"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {'':<22} {'':<26} training failed: {e}")
        model.zero_grad(set_to_none=True)
        live = Live(model, step, prepared.restore if prepared is not None else lambda: None)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        rec["skipped"] = f"{type(e).__name__}: {e}".strip()
        rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-3:]
        log(f"  {case.label:<22} {point.name:<26} skipped: {rec['skipped'][:150]}")
        grads = None
    finally:
        if live is None:
            if prepared is not None:
                prepared.restore()
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rec["wall_s"] = time.perf_counter() - t_start
    return rec, grads, live


# ----------------------------------------------------------------------------- the suite
def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def _dirty_files() -> list[str] | None:
    """Tracked files under src/ that differ from the commit (the run used them as they are)."""
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
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _data_note(data: str | None, n_byte: int, n_cases: int) -> str:
    corpus = data or "embedded stdlib corpus (byte tokens)"
    if n_byte == n_cases:
        return corpus
    vocab = "random token ids at the case's vocabulary"
    return vocab if n_byte == 0 else f"{corpus}; cases with vocab_size: {vocab}"


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
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(suite.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"suite {suite.name!r} needs CUDA, but no GPU is visible")
    out = Path(out_dir) if out_dir is not None else default_results_dir()
    name = suite.name if not selection else f"{suite.name}-subset"
    path = out / f"{name}.json"
    t0 = time.perf_counter()
    byte_cases = [c for c in suite.cases if c.vocab_size is None]
    meta = {
        "schema": SCHEMA_VERSION,
        **machine_info(),
        **({"command": command} if command else {}),
        "suite": suite.config(),
        "selection": selection or {},
        "uncommitted_src": _dirty_files(),
        "data": _data_note(data, len(byte_cases), len(suite.cases)),
        "start": _now(),
        "load_avg_start": _load(),
        "end": None,
        "wall_s": None,
        "complete": False,
        "timing": {},
    }
    if device.type == "cuda":
        meta["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    result: dict[str, Any] = {"meta": meta, "points": []}
    splits = load_data(data) if byte_cases else None
    log(f"slimact bench {suite.name}: {sum(len(c.points) for c in suite.cases)} points -> {path}")
    for case in suite.cases:
        case_data = Data(case, splits, suite.seed, device)
        baseline, base_grads = None, None
        live: dict[str, Live] = {}
        records: dict[str, dict] = {}
        try:
            for p in case.points:  # phase 1: one point after another
                rec, grads, kept = measure_point(
                    case, p.name, case_data, suite, baseline, base_grads, log
                )
                if baseline is None:
                    if rec["skipped"]:
                        raise RuntimeError(f"the baseline of {case.label} failed: {rec['skipped']}")
                    baseline, base_grads = rec, grads
                if kept is not None:
                    live[p.name] = kept
                records[p.name] = rec
                result["points"].append(rec)
                meta["wall_s"] = time.perf_counter() - t0
                _write(path, result)
            base_grads = None
            meta["timing"][case.label] = time_case(case, live, records, log)  # phase 2
        finally:
            release(live, device)
        meta["wall_s"] = time.perf_counter() - t0
        _write(path, result)
    meta.update(end=_now(), wall_s=time.perf_counter() - t0, complete=True, load_avg_end=_load())
    _write(path, result)
    log(f"wrote {path} ({meta['wall_s'] / 60:.1f} min)")
    return path
