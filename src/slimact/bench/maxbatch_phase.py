"""The max-batch phase of a bench case: the largest batch of some of its points under a cap.

Run after the case's table, on the points' prepared models (their strategy, anchor or compiled
plan as measured for the table: a planned point keeps the plan it made at the case's batch), in
a few probes each (:func:`slimact.bench.maxbatch.predicted_search`) from the peak already
measured at the case's batch, each point under its time limit cut to what is left of the
suite's budget (a point stopped midway reports the largest batch it measured to fit, as a lower
bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from slimact.bench.case_data import Data
from slimact.bench.cases import ModelCase, Suite
from slimact.bench.deadline import Deadline, PointTimeout, time_limit
from slimact.bench.maxbatch import Bracket, grad_bytes, peak_at, predicted_search, static_bytes
from slimact.bench.timing_phase import BASELINE, Live

Log = Callable[[str], None]


def max_batch_phase(
    case: ModelCase,
    live: dict[str, Live],
    records: dict[str, dict],
    data: Data,
    suite: Suite,
    deadline: Deadline,
    log: Log,
) -> dict:
    """The largest batch of each of ``case.maxbatch.points`` under its cap, on the point's
    prepared model (its strategy, anchor or compiled plan as measured for the table), in a
    few probes (``slimact.bench.maxbatch.predicted_search``) from the peak already measured
    at the case's batch. Fills ``max_batch`` / ``max_batch_exact`` of the records; returns
    ``meta.maxbatch[<case>]``."""
    spec = case.maxbatch
    assert spec is not None
    cap = spec.cap_bytes
    out: dict[str, Any] = {**spec.config(), "seq": case.seq, "points": {}}
    for name in spec.points:
        kept, rec = live.get(name), records.get(name, {})
        if kept is None or rec.get("peak_bytes") is None or kept.forward is None:
            out["points"][name] = {"skipped": "the point did not run"}
            continue
        left = deadline.limit(case.timeout_of(name))
        if left is not None and left <= 0:
            out["points"][name] = {"skipped": "not run: the suite's time budget was spent"}
            continue
        t0 = time.perf_counter()
        static = static_bytes(kept.model) if spec.include_static else 0
        vocab = int(kept.model.config.vocab_size)
        bracket, timed_out = Bracket(limit=spec.limit), None

        def measure(b: int, kept: Live = kept, vocab: int = vocab) -> int | None:
            return peak_at(kept.model, kept.forward, b, case.seq, vocab, data.device, suite.seed)

        try:
            with time_limit(left, f"max batch of {name}"):
                predicted_search(
                    measure,
                    [(case.batch, int(rec["peak_bytes"]))],
                    cap - static,
                    spec.probes,
                    spec.limit,
                    intercept=grad_bytes(kept.model),
                    bracket=bracket,
                )
        except PointTimeout as e:
            timed_out = str(e)
        except Exception as e:
            timed_out = f"{type(e).__name__}: {e}".strip()
        row = {
            "max_batch": bracket.fits,
            "exact": bracket.exact,
            "smallest_miss": bracket.misses,
            "probes": [[b, p] for b, p in bracket.probes],
            "static_bytes": static,
            "wall_s": time.perf_counter() - t0,
        }
        if timed_out:
            row["stopped"] = timed_out
        out["points"][name] = row
        rec.update(max_batch=bracket.fits, max_batch_exact=bracket.exact)
        bound = "" if bracket.exact else " (lower bound)"
        log(
            f"  {case.label:<22} {name:<26} max batch {bracket.fits}{bound} under "
            f"{cap / 2**30:.1f} GiB in {len(bracket.probes)} probe(s), "
            f"{row['wall_s']:.1f} s{'; ' + timed_out if timed_out else ''}"
        )
    base = (out["points"].get(BASELINE) or {}).get("max_batch")
    for row in out["points"].values():
        if "max_batch" in row:
            row["ratio_to_none"] = row["max_batch"] / base if base else None
    return out
