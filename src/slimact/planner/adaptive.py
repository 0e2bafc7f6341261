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

``BudgetCheck`` (installed by the ``auto`` and ``plan`` strategies) checks the first training
forward's *measured* stored bytes (the meter's count, ``slimact.meter.Meter`` listening to the
router) against the plan's budget. A plan solved under other conditions (another batch shape,
parameter dtype or autocast state) or more than ``tolerance`` (2%) over its budget is re-planned
before the next forward: the model is profiled again under the current conditions (cache
bypassed) and the MILP re-solved. If the re-planned plan still misses, or nothing can re-plan
(a loaded ``Plan``), a ``BudgetWarning`` names the budget, the measured bytes and the gap.

Training-loop hook (3 lines)::

    evolver = PlanEvolver.for_model(model, log_path=run_dir / "plan_changes.jsonl")
    ...                                        # after each optimizer step:
    if evolver is not None: evolver.on_step(step, model)
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from slimact import sites
from slimact.classify import call_batch, hidden_channels
from slimact.codecs.build import build_codec
from slimact.codecs.outlier import count_outlier_channels
from slimact.meter import Meter
from slimact.planner.apply import PlanRuntime, runtime_of
from slimact.planner.plan import Plan, abs_site, is_relative
from slimact.planner.profile import _payload_bytes, autocast_state, run_policy
from slimact.planner.solve import solve_plan
from slimact.state import peek, prune, state_of
from slimact.utils import fmt_bytes

PLANNER_THREAD = "slimact-planner"  # the worker thread slimact.planner.apply profiles in


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
        self._indexed: Any = None  # the profile ``_sites`` indexes (a re-plan replaces it)
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
        prof = self._indexed = self.rt.profile
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
        if not self._sites or self._indexed is not self.rt.profile:
            self._index()
        key = self._sites.get(site)
        if key is None or key in self._rows:
            return
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

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (the profile it re-solves from is the runtime's: save it apart)."""
        return {"cap": self.cap, "threshold": self.threshold, "events": list(self.events)}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Restore after optimizer step ``step``: the next sampled step is as if never stopped."""
        if (state["cap"], state["threshold"]) != (self.cap, self.threshold):
            raise ValueError(
                f"evolver state has cap={state['cap']}, threshold={state['threshold']}; "
                f"this evolver has cap={self.cap}, threshold={self.threshold}"
            )
        self.events = list(state["events"])
        self._sites = {}
        self._arm(step + 1)


class BudgetWarning(RuntimeWarning):
    """The measured stored bytes of a planned model exceed its budget (see ``BudgetCheck``)."""


class BudgetCheck:
    """Measures the first training forward under a plan and compares it with the budget.

    Phases: ``measure`` (the first grad-enabled forward under a plan; may trigger a re-plan),
    ``replan`` (done at the next forward, before the runtime enters its policy), ``verify``
    (measure once more; warn if still over), ``done``. ``events`` lists every verdict:
    ``action`` is ``ok``, ``replan`` or ``warn``. ``replanner(input_ids, targets)`` returns
    (plan, profile) and must not read a cache; without one (a loaded ``Plan``) it only warns.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tolerance: float = 0.02,
        replanner: Callable[..., Any] | None = None,
    ) -> None:
        rt = runtime_of(model)
        if rt is None:
            raise ValueError("model has no slimact plan; apply 'auto@<budget>' or a Plan first")
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
        self.model, self.rt = model, rt
        self.tolerance = tolerance
        self.replanner = replanner
        self.phase = "measure"
        self.events: list[dict[str, Any]] = []
        self._open: list[tuple[ExitStack, Meter, dict[str, Any]] | None] = []
        self._hooks = [  # pre runs before the runtime's, so a new plan is in place for its policy
            model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._post, always_call=True),
        ]
        state_of(model).budget_check = self

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        state_of(self.model).budget_check = None
        prune(self.model)

    # -- hooks ----------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids, tgt = call_batch(self.model, args, kwargs)
        if (
            self.phase == "done"
            or threading.current_thread().name == PLANNER_THREAD
            or not torch.is_grad_enabled()
            or not isinstance(ids, torch.Tensor)
        ):
            self._open.append(None)
            return
        if self.phase == "replan":
            self._replan(ids, tgt)
            if self.phase == "done":  # re-planning failed (and said so): nothing to verify
                self._open.append(None)
                return
        meter = Meter(self.model)
        stack = ExitStack()
        stack.enter_context(sites.listening(meter))
        self._open.append((stack, meter, self._conditions(ids)))

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        entry = self._open.pop() if self._open else None
        if entry is None:
            return
        stack, meter, cond = entry
        stack.close()
        measured = int(meter.report.total_bytes)
        meter.release()
        if self.rt.plan is not None and self.rt.plan.layers:
            self._judge(measured, cond)

    # -- verdicts -------------------------------------------------------------------------------
    def _conditions(self, ids: torch.Tensor) -> dict[str, Any]:
        param = next(self.model.parameters(), None)
        return {
            "batch": int(ids.shape[0]),
            "seq": int(ids.shape[-1]),
            "dtype": str(param.dtype).replace("torch.", "") if param is not None else "",
            "autocast": autocast_state(ids.device),
        }

    def _stale(self, cond: dict[str, Any]) -> list[str]:
        """How the conditions of this forward differ from those the plan was solved under."""
        plan = self.rt.plan
        meta = dict(plan.meta)
        prof = self.rt.profile
        if "autocast" not in meta and prof is not None:
            meta["autocast"] = prof.meta.get("autocast")
        then = {"batch": plan.batch, "seq": plan.seq, "dtype": plan.dtype}
        if "autocast" in meta:
            then["autocast"] = meta["autocast"]
        return [f"{k} {then[k]} -> {cond[k]}" for k in then if then[k] != cond[k]]

    def _judge(self, measured: int, cond: dict[str, Any]) -> None:
        plan = self.rt.plan
        limit = int(plan.budget_bytes)
        gap = measured - limit
        over = measured > limit * (1 + self.tolerance)
        stale = self._stale(cond)
        relative_stale = bool(stale) and is_relative(plan.budget)
        event: dict[str, Any] = {
            "check": self.phase,
            "budget": plan.budget,
            "budget_bytes": limit,
            "predicted_bytes": int(plan.predicted_bytes),
            "measured_bytes": measured,
            "gap_bytes": gap,
            "stale": stale,
        }
        can_replan = self.replanner is not None or self.rt.planner is not None
        if self.phase == "measure" and (over or relative_stale) and can_replan:
            event["action"], self.phase = "replan", "replan"
        elif over or relative_stale:
            event["action"], self.phase = "warn", "done"
            warnings.warn(self._message(event), BudgetWarning, stacklevel=2)
        else:
            event["action"], self.phase = "ok", "done"
        self.events.append(event)

    def _message(self, ev: dict[str, Any]) -> str:
        limit, measured, gap = ev["budget_bytes"], ev["measured_bytes"], ev["gap_bytes"]
        share = f" ({gap / limit:+.1%})" if limit > 0 else ""
        head = (
            f"slimact: the first step stored {fmt_bytes(measured)} ({measured} B) of activations; "
            f"the plan's budget {ev['budget']!r} allows {fmt_bytes(limit)} ({limit} B): "
            f"{'over' if gap > 0 else 'under'} by {fmt_bytes(abs(gap))}{share}"
        )
        if ev["stale"]:
            head += f"; the plan was solved under other conditions ({', '.join(ev['stale'])})"
        if ev["check"] == "verify":
            return head + ", even after re-planning under the current conditions"
        if ev.get("error"):
            return head + f"; re-planning failed: {ev['error']}"
        return head + "; nothing can re-plan a loaded Plan: solve it for these conditions"

    def _replan(self, ids: torch.Tensor, tgt: torch.Tensor | None) -> None:
        """Profile again under this forward's conditions (no patches, no cache) and re-solve."""
        rt, old = self.rt, self.rt.plan
        planner, saved = self.replanner or rt.planner, rt.planner
        rt.planner = planner
        try:
            rt.set_plan(Plan())  # profile the bare model, not the old plan's patches
            new = rt.plan_now(ids, tgt)
        except ValueError as e:  # e.g. the budget is infeasible under these conditions
            rt.set_plan(old)
            self.events[-1]["error"] = str(e)
            warnings.warn(self._message(self.events[-1]), BudgetWarning, stacklevel=3)
            self.phase = "done"
            return
        finally:
            rt.planner = saved
        rt.set_plan(new)
        self.events[-1].update(
            changed=[list(c) for c in plan_diff(old, new)],
            new_budget_bytes=int(new.budget_bytes),
            new_predicted_bytes=int(new.predicted_bytes),
        )
        self.phase = "verify"

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "events": list(self.events)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run measures its first step again but re-plans only if the interrupted
        run had not got that far (a restored plan stays, so the run stays bit-exact)."""
        self.events = list(state["events"])
        self.phase = "verify" if state["phase"] == "done" else state["phase"]


def budget_check_of(model: nn.Module) -> BudgetCheck | None:
    st = peek(model)
    return st.budget_check if st is not None else None
