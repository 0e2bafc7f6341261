"""The first-step budget check; adaptive policy evolution lives in ``slimact.planner.evolve``
(re-exported here: ``PlanEvolver``, ``backoff_steps``, ``is_tracking_step``, ``plan_diff``).

``BudgetCheck`` (installed by the ``auto`` and ``plan`` strategies) checks the first training
forward's *measured* stored bytes (the meter's count, ``slimact.meter.Meter`` listening to the
router) against the plan's budget. A plan solved under other conditions (another batch shape,
parameter dtype or autocast state) or more than ``tolerance`` (2%) over its budget is re-planned
before the next forward: the model is profiled again under the current conditions (cache
bypassed) and the MILP re-solved. If the re-planned plan still misses, or nothing can re-plan
(a loaded ``Plan``), a ``BudgetWarning`` names the budget, the measured bytes and the gap.
Under torchrun every rank judges the largest measured bytes over ranks, so all ranks take the
same verdict (the plans they re-solve are reconciled by ``PlanEvolver`` at its next tracking
step, rank 0 deciding).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn as nn

from slimact import sites, spec
from slimact.budget import BudgetWarning
from slimact.classify import call_batch
from slimact.meter import Meter
from slimact.planner.apply import runtime_of
from slimact.planner.evolve import (
    PLANNER_THREAD,
    EvolveConfig,
    PlanEvolver,
    backoff_steps,
    close_metered,
    is_tracking_step,
    plan_diff,
)
from slimact.planner.plan import Plan
from slimact.planner.profile import autocast_state
from slimact.state import peek, prune, state_of
from slimact.utils import fmt_bytes

__all__ = [
    "PLANNER_THREAD",
    "BudgetCheck",
    "BudgetWarning",
    "EvolveConfig",
    "PlanEvolver",
    "backoff_steps",
    "budget_check_of",
    "is_tracking_step",
    "plan_diff",
]


def _max_over_ranks(n: int) -> int:
    """The largest ``n`` over ranks (under torchrun), so every rank reaches the same verdict:
    a re-plan on some ranks only would run the profiling forward's collectives on those only."""
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return n
    dev = (
        torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else None
    )
    t = torch.tensor([n], dtype=torch.int64, device=dev)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item())


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
        self._open = sites.RootCalls(close_metered)  # per root call: (stack, meter, conditions)
        # a watcher of the runtime's root calls: ``before`` runs before the runtime enters its
        # plan, so a re-plan is in place for this call's policy
        self._unwatch = rt.watch(self)
        state_of(model).budget_check = self

    def remove(self) -> None:
        self._unwatch()
        self._open.close_all()  # a step interrupted by a BaseException: ``after`` never ran
        state_of(self.model).budget_check = None
        prune(self.model)

    # -- the runtime's root calls ----------------------------------------------------------------
    def before(self, args: tuple, kwargs: dict) -> None:
        self._open.close_stale()
        ids, tgt = call_batch(self.model, args, kwargs)
        if self.phase == "done" or not torch.is_grad_enabled() or not isinstance(ids, torch.Tensor):
            self._open.push(None)
            return
        if self.phase == "replan":
            self._replan(ids, tgt)
            if self.phase == "done":  # re-planning failed (and said so): nothing to verify
                self._open.push(None)
                return
        meter = Meter(self.model)
        stack = ExitStack()
        stack.enter_context(sites.listening(meter))
        self._open.push((stack, meter, self._conditions(ids)))

    def after(self, output: Any) -> None:
        entry = self._open.pop()
        if entry is None:
            return
        stack, meter, cond = entry
        stack.close()
        measured = _max_over_ranks(int(meter.report.total_bytes))
        meter.release()
        if self.rt.plan is not None and self.rt.plan.layers and self.rt.plan.budget:
            self._judge(measured, cond)  # a plan with no budget (merged, written) has none to hold

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
        relative_stale = bool(stale) and spec.parse_budget(plan.budget).relative
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
