"""Pure helpers of the bench report: the per-case table, the Pareto front, the findings.

Every function takes point records as the runner writes them (:mod:`slimact.bench.runner`) and
tolerates the keys an older results file lacks (schema 1: no ``peak_bytes``, ``peak_ratio``,
``head_share``, ``step_time_ratio_spread``), and a point not timed (``step_time_s`` None):
such cells read ``-``.
"""

from __future__ import annotations

from collections.abc import Sequence

MIB = 2**20
MISSING = "-"


def pareto_front(xy: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated when minimizing both coordinates.

    ``q`` dominates ``p`` when it is no worse in both and strictly better in one; equal points
    do not dominate each other. Returned in input order."""
    front = []
    for i, (x, y) in enumerate(xy):
        dominated = any(
            (a <= x and b <= y) and (a < x or b < y) for j, (a, b) in enumerate(xy) if j != i
        )
        if not dominated:
            front.append(i)
    return front


def measured(points: list[dict]) -> list[dict]:
    return [p for p in points if not p.get("skipped")]


def timed(points: list[dict]) -> list[dict]:
    """Measured points with a step time (the Pareto front and dominance need one)."""
    return [p for p in measured(points) if p.get("step_time_s") is not None]


def case_of(p: dict) -> str:
    """The case a point belongs to: its ``case`` label (schema 2), else its model."""
    return p.get("case") or p["model"]


def by_case(points: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(case_of(p), []).append(p)
    return out


def _f(v, fmt: str, empty: str = MISSING) -> str:
    return empty if v is None else format(v, fmt)


def _loss(p: dict) -> float | None:
    return (p.get("train") or {}).get("val_loss")


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def step_ratio_cell(p: dict) -> str:
    """``1.07 (0.98-1.15)``: median of per-round ratios and its min-max (just the median when
    there is no spread, e.g. the baseline or a schema-1 file)."""
    r = p.get("step_time_ratio")
    if r is None:
        return MISSING
    sp = p.get("step_time_ratio_spread") or {}
    if sp.get("min") is None or sp.get("max") is None or sp["min"] == sp["max"]:
        return f"{r:.2f}"
    return f"{r:.2f} ({sp['min']:.2f}-{sp['max']:.2f})"


def point_label(p: dict) -> str:
    if p["kind"] == "anchor":
        return f"anchor `{p['point'][len('anchor:') :]}`"
    return f"`{p['point']}`"


HEADER = (
    "| point | saved MiB | ratio | head share | peak MiB | peak ratio | step s "
    "| step ratio (min-max) | tokens/s | grad_cos | loss{n} | Δloss vs none | note |"
)
N_COLUMNS = 13


def model_table(points: list[dict], train_steps: int | None = None) -> str:
    """The per-case table (baseline first); skipped points get a row saying why."""
    base = next((p for p in points if p["point"] == "none" and not p.get("skipped")), None)
    base_loss = _loss(base) if base else None
    n = f"@{train_steps}" if train_steps else "@N"
    lines = [
        HEADER.format(n=n),
        "| --- |" + " ---: |" * (N_COLUMNS - 2) + " --- |",
    ]
    for p in points:
        name = point_label(p)
        if p.get("skipped"):
            reason = _short(p["skipped"]).replace("|", "\\|")
            lines.append(f"| {name} |" + " |" * (N_COLUMNS - 2) + f" skipped: {reason} |")
            continue
        loss = _loss(p)
        dloss = None if loss is None or base_loss is None else loss - base_loss
        notes = [p.get("note") or ""]
        err = (p.get("train") or {}).get("error")
        if err:
            notes.append(f"training failed: {err}")
        if p.get("timing_error"):
            notes.append(f"not timed: {_short(p['timing_error'], 80)}")
        note = "; ".join(x for x in notes if x)
        peak = p.get("peak_bytes")
        cells = [
            name,
            f"{p['saved_bytes'] / MIB:,.2f}",
            _f(p.get("ratio"), ".3f"),
            _f(p.get("head_share"), ".1%"),
            MISSING if peak is None else f"{peak / MIB:,.1f}",
            _f(p.get("peak_ratio"), ".2f"),
            _f(p.get("step_time_s"), ".3f"),
            step_ratio_cell(p),
            _f(p.get("tokens_per_s"), ",.0f"),
            f"{p['grad_cosine']:.5f}",
            _f(loss, ".4f"),
            _f(dloss, "+.4f"),
            note.replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _dominates(a: dict, p: dict) -> bool:
    x, y, u, v = a["saved_bytes"], a.get("step_time_s"), p["saved_bytes"], p.get("step_time_s")
    if y is None or v is None:
        return False
    return x <= u and y <= v and (x < u or y < v)


def _moves_nothing(p: dict) -> bool:
    return (p.get("note") or "").startswith("save_on_cpu on a CPU")


def findings(points: list[dict]) -> list[str]:
    """Plain statements where a point falls short: stores more than `none`, peaks higher, changes
    the gradient, trains worse, is beaten on both axes (bytes, step time) by a PyTorch anchor or
    by another slimact point; and what was skipped or not timed."""
    out = []
    ok = measured(points)
    base = next((p for p in ok if p["point"] == "none"), None)
    bl = _loss(base) if base else None
    for p in ok:
        if p["point"] == "none":
            continue
        name = f"`{p['point']}`"
        if p.get("ratio") is not None and p["ratio"] > 1:
            out.append(f"{name} stores **more** than `none` ({p['ratio']:.2f}x).")
        if p.get("peak_ratio") is not None and p["peak_ratio"] > 1.01:
            out.append(f"{name} peaks **higher** than `none` over a step ({p['peak_ratio']:.2f}x).")
        if p["grad_cosine"] < 0.99:
            out.append(
                f"{name} changes the first-step gradient: grad_cos {p['grad_cosine']:.4f} < 0.99."
            )
        loss = _loss(p)
        if loss is not None and bl is not None and loss - bl > 0.01 * abs(bl):
            out.append(
                f"{name} trains worse than `none`: loss {loss:.4f} vs {bl:.4f} (+{loss - bl:.4f})."
            )
        if p["kind"] != "strategy":
            continue
        rivals = [a for a in ok if a is not p and not _moves_nothing(a) and _dominates(a, p)]
        anchors = [a["point"][len("anchor:") :] for a in rivals if a["kind"] == "anchor"]
        ours = [a["point"] for a in rivals if a["kind"] != "anchor"]
        if anchors:
            out.append(
                f"{name} is dominated by the PyTorch anchor(s) {', '.join(anchors)} "
                "(no more bytes, no slower, better in one)."
            )
        if ours:
            out.append(f"{name} is dominated by {', '.join(f'`{o}`' for o in ours)}.")
    for p in points:
        if p.get("skipped"):
            out.append(f"`{p['point']}` did not run: {_short(p['skipped'])}")
        elif p.get("timing_error"):
            out.append(f"`{p['point']}` was not timed: {_short(p['timing_error'])}")
    return out


def anchor_lines(points: list[dict]) -> list[str]:
    """Per anchor: its ratio/step ratio and the slimact points that beat it on memory at no
    greater step time."""
    ok = measured(points)
    out = []
    for a in (p for p in ok if p["kind"] == "anchor"):
        beats = [
            p["point"]
            for p in ok
            if p["kind"] == "strategy"
            and p["point"] != "none"
            and p["saved_bytes"] < a["saved_bytes"]
            and p.get("step_time_s") is not None
            and a.get("step_time_s") is not None
            and p["step_time_s"] <= a["step_time_s"]
        ]
        out.append(
            f"anchor `{a['point'][len('anchor:') :]}`: ratio {_f(a.get('ratio'), '.3f')}, peak "
            f"ratio {_f(a.get('peak_ratio'), '.2f')}, step ratio {step_ratio_cell(a)}; slimact "
            "points with fewer bytes at no greater step time: "
            f"{', '.join(f'`{b}`' for b in beats) or 'none'}."
        )
    return out
