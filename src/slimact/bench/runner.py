"""Run one suite in one process and write its results JSON.

Every model case runs in two phases, all points from the same seed on the same batch
(``Data.batch``) with the same forward (and autocast context), each on a copy of one model built
once per case in the suite's dtype (``float32``, or ``bfloat16`` weights):

**Phase 1, one point after another** (baseline ``none`` first):

1. the first step with the meter on (``slimact.compare.measured_step``): saved bytes (unique
   storages, parameters excluded), the per-site report of one block (the middle one), the loss
   head's saved bytes and share (``head_saved_bytes``: sites outside blocks in the output
   projection ``lm_head`` / HF's ``cls`` head or at the root, i.e. the loss), and ``grad_cosine``
   against the baseline's gradients;
2. the peak over one more step (``slimact.peak.step_peak``: live bytes above those at its start;
   CPU from the profiler's memory events, CUDA from the allocator): ``peak_bytes``, and
   ``peak_ratio`` against the baseline. That step is never timed;
3. unless ``train_steps`` is 0, a short training run: ``train_steps`` AdamW steps (``slimact.train.make_optimizer``,
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
to ``meta.timing``. Then the anchors are undone and the models freed. A case with
``timing="pairs"`` times each point against ``none`` right after its phase 1 instead
(``timing_phase.PairTiming``) and frees its model then.

**Max batch** (a case with ``maxbatch``): the largest batch of some points under a memory cap,
on their prepared models, in a few probes predicted from the peak already measured
(``maxbatch_phase.max_batch_phase``); ``max_batch`` in their records, the probes in ``meta.maxbatch``.

**Time limits** (:mod:`slimact.bench.deadline`): each point but the baseline runs under
``point_timeout_s`` cut to what is left of the suite's ``time_budget_s`` (less the max-batch
phase's reserve); a point past it is recorded as timed out, points past the budget as not run.
A whole-model compile (``compile-budget``) has its saved bytes read off the autograd graph on a
call without the meter (``anchors.graph_saved_bytes``), so it is compiled once.

A point that cannot run (``cola-m`` on a non-CoLA model, a strategy failing on a model) is recorded
with ``skipped`` = the exception message, never dropped, and is not in the timing rounds. The JSON
is rewritten after every point and after each case's timing, so an interrupted run leaves what it
measured (``meta.complete`` is false until the end); a suite with ``summary`` also rewrites
``<suite>.summary.md``, the peak-first table of ``tables.summary_table``.
"""

from __future__ import annotations

import copy
import dataclasses
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
import torch._dynamo
import torch.nn as nn

from slimact import sites, spec
from slimact.bench import anchors
from slimact.bench.case_data import Data, build, loss_fn, train_point
from slimact.bench.cases import BenchPoint, ModelCase, Suite
from slimact.bench.deadline import Deadline, PointTimeout, planner_threads, time_limit
from slimact.bench.maxbatch_phase import max_batch_phase
from slimact.bench.tables import summary_table
from slimact.bench.timing_phase import BASELINE, Live, PairTiming, release, time_case
from slimact.compare import grad_cosine, grads_of, measured_step, train_step_fn
from slimact.data import load_data
from slimact.envinfo import machine_info
from slimact.peak import step_peak
from slimact.spec import compiles_blocks
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


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def case_model(case: ModelCase, suite: Suite, device: torch.device) -> nn.Module:
    """The case's model from the suite's seed, on ``device``, in the suite's dtype: built once
    per case and deep-copied for every point (a 350M-parameter model takes seconds to build)."""
    model = build(case.model, device, suite.seed, case.vocab_size)
    return model.to(_DTYPES[suite.dtype])


def _compiles_blocks(spec: str) -> bool:
    """Whether strategy ``spec`` compiles the blocks (a ``compiled-*`` part)."""
    return compiles_blocks(spec)


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def measure_point(
    case: ModelCase,
    point_name: str,
    data: Data,
    suite: Suite,
    baseline: dict | None,
    base_grads: dict[str, torch.Tensor] | None,
    log: Log,
    source: nn.Module | None = None,
) -> tuple[dict, dict[str, torch.Tensor] | None, Live | None]:
    """Phase 1 of one (case, point): its record, the baseline's gradients (for the baseline
    only), and the prepared model kept for the timing rounds (None when skipped). ``source``:
    the case's model (:func:`case_model`), copied for this point (None: built here). A
    :class:`~slimact.bench.deadline.PointTimeout` on the way is recorded as the point's
    ``skipped`` reason."""
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
    model = copy.deepcopy(source) if source is not None else case_model(case, suite, device)
    rec["params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    rec["vocab_size"] = int(model.config.vocab_size)
    prepared, grads, live = None, None, None
    try:
        if point.is_anchor:
            prepared = anchors.prepare(
                point.anchor, model, loss_fn, device, suite.compile_budget, suite.compile_backend
            )
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
        if prepared is not None and prepared.whole_graph:
            breaks = _graph_breaks()
            model.zero_grad(set_to_none=True)
            out = fwd(model, x, y)
            report, saved = None, anchors.graph_saved_bytes(out, model)
            out.backward()
            loss = float(out.detach().float())
            del out
            if _graph_breaks() > breaks:  # eager code between the graphs saves unseen bytes
                seed_everything(suite.seed)
                report, loss = measured_step(model, x, y, fwd)
                saved = int(report.total_bytes)
                rec["note"] += (
                    f"; {_graph_breaks() - breaks} graph break(s): saved bytes counted by the "
                    "meter (a second compile)"
                )
        else:
            report, loss = measured_step(model, x, y, fwd)
            saved = int(report.total_bytes)
        keep_on = device if device.type == "cuda" else "cpu"
        grads = grads_of(model, keep_on) if baseline is None else None
        cosine = 1.0 if baseline is None else grad_cosine(base_grads, model)
        head = head_bytes(report) if report is not None else None
        if prepared is not None and prepared.compiled:
            head = None  # the compiled graph's saves reach the meter unnamed
        if prepared is not None and not prepared.meter_sees_saves and device.type != "cuda":
            saved = int(baseline["saved_bytes"]) if baseline else saved
            head = baseline.get("head_saved_bytes") if baseline else head
        step = train_step_fn(model, x, y, fwd)
        if prepared is not None and prepared.compiled and not prepared.whole_graph:
            step()  # a call without the meter's hooks may recompile: not inside the peak
        elif prepared is None and _compiles_blocks(point.name):
            step()  # compiled blocks too (dynamo guards on the meter's torch-function mode)
        model.zero_grad(set_to_none=True)  # the peak counts the step's gradients as its own
        peak = step_peak(step, device)
        model.zero_grad(set_to_none=True)
        if report is not None:
            block, site_rows = _block_sites(report, sites.block_paths(model))
            block_bytes = int(report.block_bytes)
        else:
            block, site_rows, block_bytes = "", [], None
        rec.update(
            saved_bytes=saved,
            block_saved_bytes=block_bytes,
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
            f"cos {cosine:.5f}  ({time.perf_counter() - t_start:.1f} s)"
        )
        if case.train_steps > 0:
            _train(rec, model, fwd, data, case, suite, log)
        model.zero_grad(set_to_none=True)
        live = Live(
            model,
            step,
            prepared.restore if prepared is not None else lambda: None,
            forward=fwd,
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except PointTimeout as e:
        rec["skipped"] = f"timed out: {e}"
        threads = planner_threads()
        if threads:
            rec["skipped"] += f" ({threads} planner thread(s) still running when abandoned)"
        log(f"  {case.label:<22} {point.name:<26} {rec['skipped']}")
        grads = None
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


def _train(rec: dict, model, fwd, data: Data, case: ModelCase, suite: Suite, log: Log) -> None:
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


def _planner_key(point: str) -> str | None:
    """What a compiled-auto point's profile depends on besides its budget: its options."""
    part = spec.parse_part(point)
    return str(dataclasses.replace(part, budget=None)) if part.name == "compiled-auto" else None


def _why_not_run(point: str, limit: float | None, records: dict[str, dict]) -> str | None:
    """Why ``point`` is not started: the suite's time budget is spent, or an earlier
    compiled-auto point with the same options timed out profiling (the profile it would share
    was never cached, so this one would profile again and time out as well)."""
    if limit is not None and limit <= 0:
        return "not run: the suite's time budget was spent"
    key = _planner_key(point)
    if key is None:
        return None
    for name, rec in records.items():
        if _planner_key(name) == key and (rec.get("skipped") or "").startswith("timed out"):
            return f"not run: {name} timed out profiling the same options"
    return None


def not_run(case: ModelCase, point_name: str, why: str) -> dict:
    """The record of a point the run did not start (the suite's time budget was spent)."""
    point = BenchPoint(point_name)
    return {
        "model": case.model,
        "case": case.label,
        "point": point.name,
        "kind": point.kind,
        "skipped": why,
        "note": "",
        "wall_s": 0.0,
    }


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
    deadline = Deadline(suite.time_budget_s)
    budget = "" if suite.time_budget_s is None else f", time budget {suite.time_budget_s:.0f} s"
    log(
        f"slimact bench {suite.name}: {sum(len(c.points) for c in suite.cases)} points{budget} "
        f"-> {path}"
    )

    def save() -> None:
        meta["wall_s"] = time.perf_counter() - t0
        _write(path, result)
        if suite.summary:
            _write_text(path.with_suffix(".summary.md"), summary_table(result))

    for case in suite.cases:
        case_data = Data(case, splits, suite.seed, device)
        source = case_model(case, suite, device)
        reserve = case.maxbatch.reserve_s if case.maxbatch else 0.0
        keep = set(case.maxbatch.points) if case.maxbatch else set()
        baseline, base_grads = None, None
        live: dict[str, Live] = {}
        records: dict[str, dict] = {}
        pairs: PairTiming | None = None
        try:
            for p in case.points:  # phase 1: one point after another
                limit = deadline.limit(case.timeout_of(p.name), reserve)
                why = None if baseline is None else _why_not_run(p.name, limit, records)
                if why is not None:
                    rec = not_run(case, p.name, why)
                    records[p.name] = rec
                    result["points"].append(rec)
                    log(f"  {case.label:<22} {p.name:<26} {rec['skipped']}")
                    save()
                    continue
                kept, rec, t_point = None, None, time.perf_counter()
                try:
                    with time_limit(None if baseline is None else limit, f"point {p.name}"):
                        rec, grads, kept = measure_point(
                            case, p.name, case_data, suite, baseline, base_grads, log, source
                        )
                        records[p.name] = rec
                        if baseline is None:
                            if rec["skipped"]:
                                raise RuntimeError(
                                    f"the baseline of {case.label} failed: {rec['skipped']}"
                                )
                            baseline, base_grads = rec, grads
                            if case.timing == "pairs":
                                pairs = PairTiming(case, kept, records, log)
                        elif pairs is not None and kept is not None:
                            pairs.time(p.name, kept)
                except PointTimeout as e:  # in its timing rounds (measure_point records its own)
                    if rec is None:
                        rec = not_run(case, p.name, f"timed out: {e}")
                    else:
                        rec.update(timing_error=f"timed out: {e}", step_time_s=None)
                    records[p.name] = rec
                    log(f"  {case.label:<22} {p.name:<26} timed out: {e}")
                if kept is not None:
                    if pairs is None or p.name == BASELINE or p.name in keep:
                        live[p.name] = kept
                    else:
                        release({p.name: kept}, device)
                    del kept
                rec["point_wall_s"] = time.perf_counter() - t_point  # with its timing rounds
                if device.type == "cuda":  # what stays allocated: the live models, any leak
                    rec["cuda_allocated_after_bytes"] = torch.cuda.memory_allocated(device)
                result["points"].append(rec)
                save()
            base_grads = None
            if pairs is not None:  # phase 2 was done point by point
                meta["timing"][case.label] = pairs.summary()
            else:
                meta["timing"][case.label] = time_case(case, live, records, log)
            save()
            if case.maxbatch is not None:
                meta.setdefault("maxbatch", {})[case.label] = max_batch_phase(
                    case, live, records, case_data, suite, deadline, log
                )
        finally:
            release(live, device)
            del source
            if device.type == "cuda":
                torch.cuda.empty_cache()
        save()
        if suite.summary:
            log(summary_table(result, case.label))
    meta.update(end=_now(), wall_s=time.perf_counter() - t0, complete=True, load_avg_end=_load())
    save()
    log(f"wrote {path} ({meta['wall_s'] / 60:.1f} min)")
    return path


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
