"""A compiled plan: what every block compiles under, what the eager root takes, and the eager
plan applied before the blocks compile.

``CompiledPlan`` is the one plan form of a spec under ``compile=True``
(``slimact.planner.compiled`` solves one, ``strategies/compiled_presets.py``'s
``compiled_plan_of`` states any compiled spec as one):

    choices   one ``BlockChoice`` per block path: compile's region budget, a traced codec,
              offload (``slimact.compiled.blocks``)
    root      the eager root's option (``slimact.planner.compiled_root.RootOption``: a chunked
              head, inverted final norm, a codec on the root's saves), or None: keep
    eager     the eager ``Plan`` installed on the plan runtime before the blocks compile (the
              compile-safe eager parts of the spec: ``invact@ops=none``, ``invact-act``,
              ``chunked-ce``, as ``plan_of`` states them), or None

The runtime takes one plan, so a plan with both an eager part and a root option runs
:meth:`CompiledPlan.runtime_plan`, the two merged by ``Plan.merge`` (a site where they conflict,
e.g. the root's codec on a tensor the eager part no longer saves, is named in one error, before
anything is installed).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from slimact.compiled.blocks import BlockChoice
from slimact.planner.compiled_root import RootOption
from slimact.planner.plan import Plan
from slimact.utils import fmt_bytes


@dataclass
class CompiledPlan:
    """A choice per block path, with the predicted (and, once verified, measured) bytes; the
    root's option and the eager plan installed before the blocks compile (module docstring)."""

    choices: dict[str, BlockChoice]
    budget: str
    allowed_bytes: int
    predicted_bytes: int
    predicted_seconds: float  # sum of the blocks' fwd+bwd seconds
    baseline_bytes: int
    measured_bytes: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    root: RootOption | None = None  # the eager root's option (None: keep)
    eager: Plan | None = None  # installed before the blocks compile (None: nothing eager)

    def runtime_plan(self) -> Plan | None:
        """The one plan the runtime installs: the eager part merged with the root's option
        (``Plan.merge``: a conflict is a ``ValueError`` naming its sites), either alone, or
        None where the plan has neither."""
        root = self.root.plan() if self.root is not None and not self.root.keeps else None
        if self.eager is None or root is None:
            return self.eager or root
        own = self.eager.layer("")
        if own is not None:  # the root's row under the eager plan's name for it (its kind)
            layers = tuple(dataclasses.replace(lp, kind=own.kind) for lp in root.layers)
            root = dataclasses.replace(root, layers=layers)
        try:
            return self.eager + root
        except ValueError as e:
            raise ValueError(
                f"the compiled plan's eager part and its root's option {self.root.label} do "
                f"not compose on the plan runtime: {e}"
            ) from e

    def eager_label(self) -> str:
        """The eager part in one phrase: each distinct reformulation and recompute with its
        count of modules, then its lazy rules ("" without an eager part)."""
        if self.eager is None:
            return ""
        counts: dict[str, int] = {}
        for action in self.eager.site_actions().values():
            counts[action] = counts.get(action, 0) + 1
        parts = [f"{n} x {a}" for a, n in counts.items()]
        parts += [f"rule {r.describe()}" for r in self.eager.rules]
        return ", ".join(parts) or "nothing"

    def rows(self) -> list[dict[str, Any]]:
        rows = [{"block": p, "action": c.label, **c.to_dict()} for p, c in self.choices.items()]
        root = self.root.label if self.root is not None else "keep"
        rows.append({"block": "(root)", "action": root, "budget": None, "codec": None})
        if self.eager is not None:
            eager = {"block": "(eager)", "action": self.eager_label(), "budget": None}
            rows.append({**eager, "codec": None})
        return rows

    def table(self) -> str:
        lines = [f"{'block':<24} action"]
        lines += [f"{r['block']:<24} {r['action']}" for r in self.rows()]
        if self.eager is not None:
            lines += ["", "eager part (on the plan runtime, before the blocks compile):"]
            lines += [f"  {line}" for line in self.eager.table().splitlines() if line]
        base = max(self.baseline_bytes, 1)
        if self.budget:  # (a fixed strategy's plan has none: ``compiled_plan_of``)
            lines.append(
                f"predicted {fmt_bytes(self.predicted_bytes)} ({self.predicted_bytes / base:.3f} "
                f"of eager), allowed {fmt_bytes(self.allowed_bytes)} (budget {self.budget})"
            )
        if self.measured_bytes is not None:
            lines.append(f"measured {fmt_bytes(self.measured_bytes)}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: each distinct block action with its count, the root's, the eager part's,
        and the bytes (measured once verified, else predicted) against the budget's
        allowance."""
        counts: dict[str, int] = {}
        for c in self.choices.values():
            counts[c.label] = counts.get(c.label, 0) + 1
        blocks = ", ".join(f"{n} x {label}" for label, n in counts.items())
        root = self.root.label if self.root is not None else "keep"
        eager = f"; eager {self.eager_label()}" if self.eager is not None else ""
        kept = self.measured_bytes if self.measured_bytes is not None else self.predicted_bytes
        word = "keeps" if self.measured_bytes is not None else "predicted to keep"
        host = self.meta.get("measured_host_bytes", self.meta.get("host_bytes", 0))
        if not self.budget:  # a fixed strategy's plan (``compiled_plan_of``): no bytes solved
            return f"blocks {blocks}; root {root}{eager}"
        return (
            f"blocks {blocks}; root {root}{eager}; {word} {fmt_bytes(kept)} of "
            f"{fmt_bytes(self.allowed_bytes)} allowed"
            + (f", {fmt_bytes(host)} offloaded to host memory" if host else "")
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["choices"] = {p: c.to_dict() for p, c in self.choices.items()}
        d["root"] = self.root.to_dict() if self.root is not None else None
        d["eager"] = self.eager.to_dict() if self.eager is not None else None
        d["rows"] = self.rows()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompiledPlan:
        """Inverse of :meth:`to_dict` (``rows`` is derived and ignored; a plan saved before
        plans had an eager part loads with none)."""
        try:
            eager = None if d.get("eager") is None else Plan.from_dict(d["eager"])
        except ValueError as e:
            raise ValueError(f"the compiled plan's eager part (a Plan's JSON, or null): {e}") from e
        return cls(
            choices={p: BlockChoice.from_dict(c) for p, c in d["choices"].items()},
            budget=str(d["budget"]),
            allowed_bytes=int(d["allowed_bytes"]),
            predicted_bytes=int(d["predicted_bytes"]),
            predicted_seconds=float(d["predicted_seconds"]),
            baseline_bytes=int(d["baseline_bytes"]),
            measured_bytes=None if d.get("measured_bytes") is None else int(d["measured_bytes"]),
            meta=dict(d.get("meta") or {}),
            root=None if d.get("root") is None else RootOption.from_dict(d["root"]),
            eager=eager,
        )
