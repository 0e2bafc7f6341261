"""Adaptive policy evolution (adacc.txt §3.4): track the data, re-solve, swap plans between steps.

Outliers, and with them the payload of outlier-separated codecs, change during training (adacc.txt
Fig. 4: fast early, stable later), so a plan solved at step 0 can overrun its budget or waste
time later. ``PlanEvolver`` does what §3.4 describes:

- **tracking iterations** by exponential back-off: steps 1, 2, 4, ..., ``cap``, then every
  ``cap`` steps (``backoff_steps``; the paper's intervals 1, 2, ..., 2^n with 2^n = ``cap``; it
  does not say what follows 2^n, we keep the last interval). Step 1 is tracked: the evolver
  exists before the first forward (``slimact.train`` builds it with the model);
- **what is tracked**, during a tracking step's forward (the plan's codec policy shows the
  evolver every saved tensor, each (block, storage) once): the outlier-channel count (Z-score > 3,
  ``count_outlier_channels``) and, for every non-stateful candidate codec of the profile, the
  payload bytes (the compression rate, ``CRate_i``) *and* the encode and decode seconds, measured
  once on the real activation (the paper re-measures only rates; times are ours, since a codec's
  speed on outlier-heavy data and the machine's load both drift). Also the stored bytes of the
  forward (the meter), against the budget. Storages the current plan recomputes are not saved,
  so not seen: they keep their figures;
- **re-planning**, after every tracking step (``on_step``), whatever the drift (the paper: "at
  each tracking iteration ... inputs the updated tensor information into the MILP cost model"):
  per-block bytes and outlier counts replace the profile's; each codec's times are rescaled by
  its tracked/profiled ratio (per storage: the median over the sampled blocks; per codec: the
  median over storages) when that ratio leaves [1/``time_band``, ``time_band``] (2x: one
  in-training timing on a shared machine is noisy, and recompute times are not re-measured, so
  smaller swings are treated as noise, not as a cheaper or dearer codec); the MILP is
  re-solved for the same budget. *Beyond the paper* (it installs any changed policy): the new
  plan is installed when the current plan no longer fits the budget under the updated figures,
  or when the new one is predicted faster by more than ``min_gain`` of the current plan's time
  (both plans costed on the same updated profile, ``plan_cost``), so that timing noise does not
  swap plans back and forth; ``min_gain=0`` installs every faster plan. Codec instances of
  unchanged storages keep their state across a swap (``PlanRuntime.set_plan``);
- **events** (``events``; ``log_path``: one JSON line each): step, drifts (bytes, times, outlier
  channels), measured stored bytes and budget, the re-solve's verdict (``reason``), the changed
  sites/modules, predicted bytes and time of both plans, seconds spent tracking and solving.

**Ranks** (torchrun DDP / FSDP2): every rank tracks its own rows of the batch; at each tracking
step the rows go to rank 0 (``gather_object``), which merges them conservatively (bytes,
outliers, times: the largest over ranks, so the plan fits and is costed on every rank), updates
its profile, solves and decides; its plan (changed or not) is broadcast and installed by every
rank whose plan differs, so all ranks run the same plan from the next step on (plans solved
lazily on each rank's own rows at step 1 are reconciled at once). Rank 0's profile is the one
re-solved from and checkpointed; the log is written by rank 0 only.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as tdist
import torch.nn as nn

from slimact import sites
from slimact.codecs.build import build_codec
from slimact.codecs.outlier import count_outlier_channels
from slimact.codecs.saving import hidden_channels
from slimact.meter import Meter
from slimact.planner.apply import runtime_of
from slimact.planner.plan import Plan, abs_site
from slimact.planner.profile import _payload_bytes, run_policy
from slimact.planner.replan import (
    EvolveConfig,
    backoff_steps,
    is_tracking_step,
    merge_rows,
    plan_cost,
    plan_diff,
    update_profile,
)
from slimact.planner.solve import solve_plan
from slimact.utils import PLANNER_THREAD

__all__ = [
    "PLANNER_THREAD",
    "EvolveConfig",
    "PlanEvolver",
    "backoff_steps",
    "is_tracking_step",
    "plan_cost",
    "plan_diff",
]


def _world() -> int:
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def close_metered(entry: tuple[Any, ...] | None) -> None:
    """Close a root call's metered entry, ``(ExitStack, Meter, ...)``: at its forward hook, or,
    for a call a BaseException interrupted, at the next call (``sites.RootCalls``)."""
    if entry is not None:
        entry[0].close()
        entry[1].release()


class PlanEvolver:
    """Re-plans a model's applied plan at tracking steps (see the module docstring).

    ``default_config`` is what an evolver built without a config uses (``slimact.train`` builds
    it so): time-driven decisions differ between runs, so a test that needs two runs to agree
    bit for bit sets ``EvolveConfig(time_codecs=False)`` there."""

    default_config: ClassVar[EvolveConfig] = EvolveConfig()

    def __init__(
        self,
        model: nn.Module,
        config: EvolveConfig | None = None,
        *,
        log_path: str | Path | None = None,
        solve_options: dict[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        rt = runtime_of(model)
        if rt is None:
            raise ValueError("model has no slimact plan; apply 'auto@<budget>' or a Plan first")
        if config is None:
            config = dataclasses.replace(self.default_config, **fields)
        elif fields:
            raise ValueError(f"give an EvolveConfig or its fields, not both: {sorted(fields)}")
        self.config = config
        self.model, self.rt = model, rt
        self.log_path = Path(log_path) if log_path is not None else None
        self.solve_options = dict(solve_options or rt.solve_options)
        self.events: list[dict[str, Any]] = []
        self._rows: dict[str, dict[str, Any]] = {}  # owner site -> tracked figures
        self._sites: dict[str, tuple[int, str, int]] = {}
        self._indexed: Any = None  # the profile ``_sites`` indexes (a re-plan replaces it)
        self._measured: list[int] = []
        self._open = sites.RootCalls(close_metered)  # per root call: (stack, meter)
        self._track_s = 0.0
        self._armed = False
        self._unwatch = rt.watch(self)  # a watcher of the runtime's root calls
        self._arm(1)

    @property
    def cap(self) -> int:
        return self.config.cap

    @classmethod
    def for_model(cls, model: nn.Module, **kwargs: Any) -> PlanEvolver | None:
        """An evolver if ``model`` carries a plan runtime with a planner, else None."""
        rt = runtime_of(model)
        return cls(model, **kwargs) if rt is not None and rt.planner is not None else None

    def remove(self) -> None:
        """Stop tracking: its watch on the runtime and its observer go."""
        self._unwatch()
        self._open.close_all()  # a step interrupted by a BaseException: ``after`` never ran
        self._armed = False
        self.rt.observer = None

    # -- tracking ---------------------------------------------------------------------------------
    def _arm(self, step: int) -> None:
        self._armed = is_tracking_step(step, self.cap)
        self._rows, self._measured, self._track_s = {}, [], 0.0
        self.rt.observer = self._observe if self._armed else None

    def before(self, args: tuple, kwargs: dict) -> None:
        self._open.close_stale()
        if not (self._armed and torch.is_grad_enabled()):
            self._open.push(None)
            return
        meter = Meter(self.model)
        stack = ExitStack()
        stack.enter_context(sites.listening(meter))
        self._open.push((stack, meter))

    def after(self, output: Any) -> None:
        entry = self._open.pop()
        if entry is not None:
            stack, meter = entry
            stack.close()
            self._measured.append(int(meter.report.total_bytes))
            meter.release()

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
        prof = self.rt.profile
        if prof is None:
            return
        if not self._sites or self._indexed is not prof:
            self._index()
        key = self._sites.get(site)
        if key is None:
            return
        ki, b, sid = key
        s = prof.kinds[ki].storages[sid]
        owner = abs_site(s.sites[0], b)
        if owner in self._rows:
            return
        t0 = time.perf_counter()
        row: dict[str, Any] = {"bytes": {}, "times": {}}
        if t.is_floating_point() and t.dim() > 0 and t.numel():
            row["outliers"] = count_outlier_channels(t, channels=hidden_channels(t))
        for c in s.codecs:
            codec = build_codec(c, t)
            if codec.state_dict():  # stateful (PRAC): payload fixed by its rank, SVD amortized
                continue
            e0 = time.perf_counter()
            stored = run_policy(codec, [(site, t.detach())])
            e1 = time.perf_counter()
            if self.config.time_codecs:
                for st in stored:
                    st.unpack()
                row["times"][c] = [e1 - e0, time.perf_counter() - e1]
            row["bytes"][c] = _payload_bytes(stored)
        self._rows[owner] = row
        self._track_s += time.perf_counter() - t0

    # -- the step hook ---------------------------------------------------------------------------
    def on_step(self, step: int, model: nn.Module | None = None) -> dict[str, Any] | None:
        """Call after optimizer step ``step`` (1-based) on every rank; re-plans between steps."""
        event = None
        if self._armed:
            event = self._check(step)
        self._arm(step + 1)
        return event

    def _check(self, step: int) -> dict[str, Any] | None:
        world = _world()
        mine = {"rows": self._rows, "measured": max(self._measured, default=0),
                "track_s": self._track_s}  # fmt: skip
        if world == 1:
            event = self._decide(step, [mine])
            return self._log(event) if event is not None else None
        gathered: list[Any] = [None] * world if tdist.get_rank() == 0 else []
        tdist.gather_object(mine, gathered if tdist.get_rank() == 0 else None, dst=0)
        msg: list[Any] = [None, None]
        if tdist.get_rank() == 0:
            event = self._decide(step, gathered)
            plan = self.rt.plan
            msg = [event, plan.to_dict() if plan is not None else None]
        tdist.broadcast_object_list(msg, src=0)
        event, plan_d = msg
        if tdist.get_rank() != 0 and plan_d is not None:
            new = Plan.from_dict(plan_d)
            if self.rt.plan is None or plan_diff(self.rt.plan, new):
                self.rt.set_plan(new)
                self._sites = {}
        if event is None:
            return None
        event["world"] = world
        return self._log(event)  # every rank keeps it; only rank 0 has a log_path in training

    def _decide(self, step: int, ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
        rt, old = self.rt, self.rt.plan
        prof = rt.profile
        if old is None or prof is None:
            return None
        if not self._sites or self._indexed is not prof:
            self._index()
        rows = merge_rows(ranks, self._sites)
        measured = max(r["measured"] for r in ranks)
        event: dict[str, Any] = {
            "step": step, "sampled": len(rows), "measured_bytes": measured,
            "budget": old.budget, "budget_bytes": int(old.budget_bytes),
            "track_s": max(r["track_s"] for r in ranks),
        }  # fmt: skip
        event.update(update_profile(prof, rows, self.config.time_band))
        cur_b, cur_t = plan_cost(old, prof)
        event.update(current_bytes=cur_b, current_time_s=cur_t)
        t0 = time.perf_counter()
        try:
            new = solve_plan(prof, old.budget, **self.solve_options)
        except ValueError as e:
            event.update(applied=False, changed=[], reason="infeasible", error=str(e))
            return event
        event["solve_s"] = time.perf_counter() - t0
        new_b, new_t = plan_cost(new, prof)
        changed = plan_diff(old, new)
        over = cur_b > old.budget_bytes
        faster = new_t < cur_t * (1 - self.config.min_gain)
        if not changed:
            reason = "same plan"
        elif over:
            reason = "current plan over budget"
        elif faster:
            reason = "faster"
        else:
            reason = f"gain below min_gain={self.config.min_gain}"
        apply = bool(changed) and (over or faster) and self.config.replan
        if bool(changed) and (over or faster) and not apply:
            reason = f"{reason} (not installed: replan=False)"
        if apply:
            rt.set_plan(new)
            self._sites = {}
        event.update(
            applied=apply, reason=reason, changed=[list(c) for c in changed] if apply else [],
            predicted_bytes=new_b, predicted_time_s=new_t, n_differ=len(changed),
        )  # fmt: skip
        return event

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
        return {"cap": self.cap, "min_gain": self.config.min_gain, "events": list(self.events)}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Restore after optimizer step ``step``: the next tracked step is as if never stopped."""
        if state["cap"] != self.cap or state.get("min_gain", self.config.min_gain) != (
            self.config.min_gain
        ):
            raise ValueError(
                f"evolver state has cap={state['cap']}, min_gain={state.get('min_gain')}; this "
                f"evolver has cap={self.cap}, min_gain={self.config.min_gain}"
            )
        self.events = list(state["events"])
        self._sites = {}
        self._arm(step + 1)
