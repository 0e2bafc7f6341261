"""The figures of adaptive evolution (``slimact.planner.evolve``): the tracking schedule, the
cost of a plan under a profile, merging ranks' tracked rows, and writing them into the profile."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from slimact import actions
from slimact.planner.offload import stall_s
from slimact.planner.plan import Plan, Profile


def is_tracking_step(step: int, cap: int) -> bool:
    if step < 1:
        return False
    if step <= cap:
        return step & (step - 1) == 0 or step == cap
    return step % cap == 0


def backoff_steps(cap: int, limit: int) -> list[int]:
    """Tracking iterations up to ``limit``: 1, 2, 4, ..., cap, then every ``cap`` steps."""
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"cap must be an int >= 1, got {cap!r}")
    return [s for s in range(1, limit + 1) if is_tracking_step(s, cap)]


def plan_diff(old: Plan, new: Plan) -> list[tuple[str, str, str]]:
    """(site or module, old action, new action) for everything that changed."""
    a, b = old.site_actions(), new.site_actions()
    return [(k, a.get(k, "keep"), b.get(k, "keep")) for k in sorted(set(a) | set(b))
            if a.get(k, "keep") != b.get(k, "keep")]  # fmt: skip


def plan_cost(plan: Plan, profile: Profile) -> tuple[int, float]:
    """(stored bytes, added seconds) of ``plan`` under ``profile``'s current figures, costed as
    ``solve.make_plan`` costs a solution, so an installed plan and a re-solved one compare."""
    kinds = {(k.kind, b): k for k in profile.kinds for b in k.blocks}
    total_b, total_t = 0, 0.0
    bandwidth = dict(plan.meta).get("link_bandwidth")  # a plan that offloads (planner.offload)
    for lp in plan.layers:
        kind = kinds.get((lp.kind, lp.block))
        if kind is None:
            raise ValueError(f"plan block {lp.block!r} ({lp.kind}) is not in the profile")
        sid = {s.name: s.id for s in kind.storages}
        total_t += sum(m.recompute_s for m in kind.modules if m.path in lp.recompute)
        total_t += sum(max(r.delta_s, 0.0) for r in kind.reforms if r.path in lp.reform)
        total_b += sum(r.extra_bytes for r in kind.reforms if r.path in lp.reform)
        copies = 0.0  # bytes this block offloads (to the host and back)
        for name, action, _, _ in lp.storages:
            s, act = kind.storages[sid[name]], actions.parse(action)
            if act.kind in (actions.CODEC, actions.OFFLOAD) and act.detail in s.codecs:
                st = s.codecs[act.detail]
                total_t += st.encode_s + st.decode_s
                if act.kind == actions.CODEC:
                    total_b += kind.bytes_of(lp.block, s.id, act.detail)
            elif act.kind == actions.KEEP:
                total_b += kind.bytes_of(lp.block, s.id, "raw")
            if act.kind == actions.OFFLOAD:
                copies += kind.bytes_of(lp.block, s.id, act.detail or "raw")
        if copies and bandwidth:
            forward = next((m.recompute_s for m in kind.modules if m.path == ""), 0.0)
            total_t += stall_s(copies / bandwidth, forward)
    return total_b, total_t


@dataclass(frozen=True)
class EvolveConfig:
    """``cap``: back-off cap (tracking steps 1, 2, 4, ..., cap, then every cap). ``min_gain``:
    a re-solved plan that is not needed for the budget replaces the current one only if it is
    predicted faster by more than this share of the current plan's time. ``time_codecs``:
    re-measure codec encode/decode seconds at tracking steps (not only bytes). ``time_band``:
    a codec's profiled times are rescaled only when its tracked/profiled ratio (the median
    over its storages) leaves [1/band, band]. ``replan``:
    False tracks and re-solves but never installs (a frozen plan's figures, for comparison)."""

    cap: int = 64
    min_gain: float = 0.02
    time_codecs: bool = True
    time_band: float = 2.0
    replan: bool = True

    def __post_init__(self) -> None:
        backoff_steps(self.cap, 1)
        if not isinstance(self.min_gain, (int, float)) or not 0 <= self.min_gain < 1:
            raise ValueError(f"EvolveConfig.min_gain must be in [0, 1), got {self.min_gain!r}")
        if not isinstance(self.time_band, (int, float)) or not self.time_band >= 1:
            raise ValueError(f"EvolveConfig.time_band must be >= 1, got {self.time_band!r}")
        for name in ("time_codecs", "replan"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EvolveConfig.{name} must be a bool, got {getattr(self, name)!r}")


def merge_rows(
    ranks: list[dict[str, Any]], index: dict[str, tuple[int, str, int]]
) -> dict[tuple[int, str, int], dict[str, Any]]:
    """Rows of every rank by storage key: the largest bytes, outliers and times."""
    out: dict[tuple[int, str, int], dict[str, Any]] = {}
    for r in ranks:
        for owner, row in r["rows"].items():
            key = index.get(owner)
            if key is None:
                continue
            m = out.setdefault(key, {"bytes": {}, "times": {}})
            if "outliers" in row:
                m["outliers"] = max(m.get("outliers", 0), row["outliers"])
            for c, v in row["bytes"].items():
                m["bytes"][c] = max(m["bytes"].get(c, 0), v)
            for c, v in row["times"].items():
                old = m["times"].get(c, [0.0, 0.0])
                m["times"][c] = [max(old[0], v[0]), max(old[1], v[1])]
    return out


def update_profile(prof: Profile, rows: dict, band: float) -> dict[str, Any]:
    """Write the tracked figures into ``prof``; returns the drifts against its old ones."""
    d_bytes = 0.0
    n_out = d_out = 0
    samples: dict[tuple[int, int, str], list[list[float]]] = {}
    for (ki, b, sid), row in rows.items():
        kind = prof.kinds[ki]
        cell = kind.per_block.setdefault(b, {}).setdefault(str(sid), {})
        for c, v in row["bytes"].items():
            old = kind.bytes_of(b, sid, c)
            if old:
                d_bytes = max(d_bytes, abs(v - old) / old)
            cell[c] = int(v)
        if "outliers" in row:
            n_out += row["outliers"]
            d_out += abs(row["outliers"] - cell.get("outliers", row["outliers"]))
            cell["outliers"] = int(row["outliers"])
        for c, v in row["times"].items():
            samples.setdefault((ki, sid, c), []).append(v)
    factors: dict[str, list[float]] = {}
    for (ki, sid, c), vs in samples.items():
        st = prof.kinds[ki].storages[sid].codecs[c]
        now = statistics.median(v[0] for v in vs) + statistics.median(v[1] for v in vs)
        if st.encode_s + st.decode_s > 0:
            factors.setdefault(c, []).append(now / (st.encode_s + st.decode_s))
    scale = {c: statistics.median(f) for c, f in factors.items()}
    d_time = max((abs(f - 1) for f in scale.values()), default=0.0)
    for c, f in scale.items():
        if 1 / band <= f <= band:
            continue  # within one measurement's noise: the profile's figures stay
        for kind in prof.kinds:
            for s in kind.storages:
                if c in s.codecs:
                    st = s.codecs[c]
                    st.encode_s, st.decode_s = st.encode_s * f, st.decode_s * f
    return {
        "drift": d_bytes, "bytes_drift": d_bytes, "time_drift": d_time,
        "outlier_channels": n_out, "outlier_change": d_out,
        "time_factors": {c: round(f, 4) for c, f in sorted(scale.items())},
    }  # fmt: skip
