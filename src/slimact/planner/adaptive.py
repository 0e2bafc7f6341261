"""Adaptive policy evolution (adacc.txt §3.4): track compression rates, re-plan on drift.

Outliers, and with them the payload of outlier-separated codecs, change during training (adacc.txt
Fig. 4: fast early, stable later), so a plan solved at step 0 can overrun its budget or waste
time later. ``PlanEvolver`` samples the data at *tracking iterations* chosen by exponential
back-off, 1, 2, 4, ... ``cap``, then every ``cap`` steps (``backoff_steps``), and between steps:

1. during a tracking step's forward, the plan's codec policy shows the evolver every tensor it
   sees (each storage once per block): the evolver counts outlier channels and re-measures the
   payload bytes of every non-stateful candidate codec on the real activation. Storages that the
   current plan recomputes are invisible (nothing is saved) and keep their profiled figures;
2. after the step (``on_step``), the *drift* is the largest relative change of those bytes
   against the profile. Past ``threshold`` the profile is updated and the MILP re-solved for the
   same budget; if the plan differs it is installed before the next step (codec instances of
   unchanged storages, with their state, are kept);
3. every check is logged (``events``; ``log_path``: one JSON line each): step, drift, whether a
   new plan was applied, the changed sites/modules, and the new predicted bytes and time.

Training-loop hook (3 lines)::

    evolver = PlanEvolver.for_model(model, log_path=run_dir / "plan_changes.jsonl")
    ...                                        # after each optimizer step:
    if evolver is not None: evolver.on_step(step, model)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from slimact.planner.apply import PlanRuntime, runtime_of
from slimact.planner.milp import solve_plan
from slimact.planner.plan import Plan, abs_site
from slimact.planner.profile import _payload_bytes, build_codec, run_policy


def backoff_steps(cap: int, limit: int) -> list[int]:
    """Tracking iterations up to ``limit``: 1, 2, 4, ..., cap, then every ``cap`` steps."""
    if not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be an int >= 1, got {cap!r}")
    return [s for s in range(1, limit + 1) if is_tracking_step(s, cap)]


def is_tracking_step(step: int, cap: int) -> bool:
    if step < 1:
        return False
    if step <= cap:
        return step & (step - 1) == 0 or step == cap
    return step % cap == 0


def plan_diff(old: Plan, new: Plan) -> list[tuple[str, str, str]]:
    """(site or module, old action, new action) for everything that changed."""
    a, b = old.site_actions(), new.site_actions()
    return [(k, a.get(k, "keep"), b.get(k, "keep")) for k in sorted(set(a) | set(b))
            if a.get(k, "keep") != b.get(k, "keep")]  # fmt: skip


class PlanEvolver:
    """Re-plans a model's applied plan when compression rates drift (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        cap: int = 64,
        threshold: float = 0.05,
        log_path: str | Path | None = None,
        solve_options: dict[str, Any] | None = None,
    ) -> None:
        rt = runtime_of(model)
        if rt is None:
            raise ValueError("model has no slimact plan; apply 'auto@<budget>' or a Plan first")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        backoff_steps(cap, 1)
        self.rt: PlanRuntime = rt
        self.cap, self.threshold = cap, threshold
        self.log_path = Path(log_path) if log_path is not None else None
        self.solve_options = dict(solve_options or rt.solve_options)
        self.events: list[dict[str, Any]] = []
        self._rows: dict[tuple[int, str, int], dict[str, int]] = {}
        self._sites: dict[str, tuple[int, str, int]] = {}
        self._armed = False
        self._arm(1)

    @classmethod
    def for_model(cls, model: nn.Module, **kwargs: Any) -> PlanEvolver | None:
        """An evolver if ``model`` carries a plan runtime with a planner, else None."""
        rt = runtime_of(model)
        return cls(model, **kwargs) if rt is not None and rt.planner is not None else None

    # -- sampling ---------------------------------------------------------------------------------
    def _arm(self, step: int) -> None:
        self._armed = is_tracking_step(step, self.cap)
        self._rows.clear()
        self.rt.observer = self._observe if self._armed else None

    def _index(self) -> None:
        prof = self.rt.profile
        self._sites = {
            abs_site(x, b): (ki, b, s.id)
            for ki, kind in enumerate(prof.kinds)
            for b in kind.blocks
            for s in kind.storages
            for x in s.sites
            if x != "!extern"
        }

    @torch.no_grad()
    def _observe(self, site: str, t: torch.Tensor) -> None:
        if self.rt.profile is None:
            return
        if not self._sites:
            self._index()
        key = self._sites.get(site)
        if key is None or key in self._rows:
            return
        from slimact.codecs.outlier import count_outlier_channels
        from slimact.strategies.int4 import hidden_channels

        kind = self.rt.profile.kinds[key[0]]
        s = kind.storages[key[2]]
        row = {}
        if t.is_floating_point() and t.dim() > 0 and t.numel():
            row["outliers"] = count_outlier_channels(t, channels=hidden_channels(t))
        for c in s.codecs:
            codec = build_codec(c, t)
            if not codec.state_dict():
                row[c] = _payload_bytes(run_policy(codec, [(site, t.detach())]))
        self._rows[key] = row

    # -- the step hook ---------------------------------------------------------------------------
    def on_step(self, step: int, model: nn.Module | None = None) -> dict[str, Any] | None:
        """Call after optimizer step ``step`` (1-based); re-plans between steps if needed."""
        event = None
        if self._armed and self._rows and self.rt.plan is not None:
            event = self._check(step)
        self._arm(step + 1)
        return event

    def drift(self) -> float:
        """Largest relative change of a sampled codec payload against the profile."""
        worst = 0.0
        for (ki, b, sid), row in self._rows.items():
            old = self.rt.profile.kinds[ki].per_block.get(b, {}).get(str(sid), {})
            for c, v in row.items():
                if c != "outliers" and old.get(c):
                    worst = max(worst, abs(v - old[c]) / old[c])
        return worst

    def _check(self, step: int) -> dict[str, Any]:
        d = self.drift()
        old = self.rt.plan
        event: dict[str, Any] = {"step": step, "drift": d, "sampled": len(self._rows)}
        outliers = {f"{b}|{sid}": r["outliers"] for (_, b, sid), r in self._rows.items()
                    if "outliers" in r}  # fmt: skip
        event["outlier_channels"] = sum(outliers.values())
        if d > self.threshold:
            for (ki, b, sid), row in self._rows.items():
                self.rt.profile.kinds[ki].per_block.setdefault(b, {}).setdefault(str(sid), {})
                self.rt.profile.kinds[ki].per_block[b][str(sid)].update(row)
            try:
                new = solve_plan(self.rt.profile, old.budget, **self.solve_options)
            except ValueError as e:
                event.update(applied=False, error=str(e))
                return self._log(event)
            changed = plan_diff(old, new)
            if changed:
                self.rt.set_plan(new)
                self._sites = {}
            event.update(
                applied=bool(changed),
                changed=[list(c) for c in changed],
                predicted_bytes=new.predicted_bytes,
                predicted_time_s=new.predicted_time_s,
                budget_bytes=new.budget_bytes,
            )
        else:
            event.update(applied=False, changed=[])
        return self._log(event)

    def _log(self, event: dict[str, Any]) -> dict[str, Any]:
        self.events.append(event)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as f:
                f.write(json.dumps(event) + "\n")
        return event
