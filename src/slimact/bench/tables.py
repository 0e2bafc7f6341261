"""Pure helpers of the bench report: the per-case table, the Pareto front, the findings.

Every function takes point records as the runner writes them (:mod:`slimact.bench.runner`) and
tolerates the keys an older results file lacks (schema 1: no ``peak_bytes``, ``peak_ratio``,
``head_share``, ``step_time_ratio_spread``), and a point not timed (``step_time_s`` None):
such cells read ``-``.
"""

from __future__ import annotations

from collections.abc import Sequence

from slimact.utils import fmt_bytes

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


COLUMNS = (  # (key, header); the table's columns in their default order
    ("point", "point"),
    ("saved", "saved MiB"),
    ("ratio", "ratio"),
    ("head", "head share"),
    ("peak", "peak MiB"),
    ("peak_ratio", "peak ratio"),
    ("step", "step s"),
    ("step_ratio", "step ratio (min-max)"),
    ("tps", "tokens/s"),
    ("cos", "grad_cos"),
    ("loss", "loss{n}"),
    ("dloss", "Δloss vs none"),
    ("note", "note"),
)
# on CUDA the peak decides whether a run fits: peak and max batch lead
PEAK_FIRST = ("point", "peak", "peak_ratio", "max_batch", "saved", "ratio", "head", "step",
              "step_ratio", "tps", "cos", "loss", "dloss", "note")  # fmt: skip
HEADERS = {**dict(COLUMNS), "max_batch": "max batch"}
HEADER = "| " + " | ".join(h for _, h in COLUMNS) + " |"
N_COLUMNS = len(COLUMNS)


def _max_batch_cell(p: dict) -> str:
    b = p.get("max_batch")
    if b is None:
        return MISSING
    return f"{b}" if p.get("max_batch_exact") else f"≥ {b}"


def model_table(
    points: list[dict], train_steps: int | None = None, lead_with_peak: bool = False
) -> str:
    """The per-case table (baseline first); skipped points get a row saying why.
    ``lead_with_peak`` (CUDA): peak, peak ratio and max batch first (``PEAK_FIRST``)."""
    keys = list(PEAK_FIRST) if lead_with_peak else [k for k, _ in COLUMNS]
    base = next((p for p in points if p["point"] == "none" and not p.get("skipped")), None)
    base_loss = _loss(base) if base else None
    n = f"@{train_steps}" if train_steps else "@N"
    lines = [
        "| " + " | ".join(HEADERS[k].format(n=n) for k in keys) + " |",
        "| --- |" + " ---: |" * (len(keys) - 2) + " --- |",
    ]
    for p in points:
        name = point_label(p)
        if p.get("skipped"):
            reason = _short(p["skipped"]).replace("|", "\\|")
            lines.append(f"| {name} |" + " |" * (len(keys) - 2) + f" skipped: {reason} |")
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
        cells = {
            "point": name,
            "saved": f"{p['saved_bytes'] / MIB:,.2f}",
            "ratio": _f(p.get("ratio"), ".3f"),
            "head": _f(p.get("head_share"), ".1%"),
            "peak": MISSING if peak is None else f"{peak / MIB:,.1f}",
            "peak_ratio": _f(p.get("peak_ratio"), ".2f"),
            "max_batch": _max_batch_cell(p),
            "step": _f(p.get("step_time_s"), ".3f"),
            "step_ratio": step_ratio_cell(p),
            "tps": _f(p.get("tokens_per_s"), ",.0f"),
            "cos": f"{p['grad_cosine']:.5f}",
            "loss": _f(loss, ".4f"),
            "dloss": _f(dloss, "+.4f"),
            "note": note.replace("|", "\\|"),
        }
        lines.append("| " + " | ".join(cells[k] for k in keys) + " |")
    return "\n".join(lines)


PEAK_DECIDES = (
    "peak (the CUDA allocator's maximum over forward+backward above the pre-step level, "
    "gradients included) is what decides whether a run fits; act = bytes autograd holds after "
    "the forward (the meter)"
)


def _dominated_note(p: dict, pts: list[dict]) -> str:
    """``dominated by X``: the fastest measured point with no higher peak and a shorter step
    (slimact's points only: an anchor is a reference, not a choice to warn about)."""
    if p["kind"] != "strategy" or p["point"] == "none":
        return ""
    rivals = [
        a
        for a in measured(pts)
        if a is not p
        and _dominates(a, p, "peak_bytes")
        and a["peak_bytes"] <= p["peak_bytes"]
        and a["step_time_s"] < p["step_time_s"]
    ]
    if not rivals:
        return ""
    best = min(rivals, key=lambda a: a["step_time_s"])
    return f"dominated here by `{best['point']}` (no higher peak, faster)"


def summary_table(result: dict, case: str | None = None) -> str:
    """The issue-style table of a run, peak first: per case, each point against eager ``none``
    (peak, max batch, act bytes, step time, min per-parameter gradient cosine, and the seconds
    the point took, compiles included), skipped and unfinished points included, so a run cut
    short still reads as a table."""
    meta = result.get("meta", {})
    suite = meta.get("suite", {})
    configs = {c.get("case") or c["model"]: c for c in suite.get("cases", [])}
    mb_meta = meta.get("maxbatch") or {}
    out = []
    for label, pts in by_case(result.get("points", [])).items():
        if case is not None and label != case:
            continue
        c = configs.get(label, {})
        base = next((p for p in measured(pts) if p["point"] == "none"), None)
        dtype = suite.get("dtype", "float32") + (" + bf16 autocast" if suite.get("bf16") else "")
        lines = [
            f"### {label}: {suite.get('name')} on {meta.get('gpu') or suite.get('device')}, "
            f"{dtype}, {c.get('batch')} x {c.get('seq')} tokens",
            "",
            f"{PEAK_DECIDES}. Every ratio is against eager `none` on the same weights and batch; "
            f"step: median of {c.get('timing_steps')} interleaved rounds "
            f"({c.get('timing', 'rounds')}).",
        ]
        if base is not None:
            step = base.get("step_time_s")
            lines.append(
                f"Eager `none`: act {fmt_bytes(base['saved_bytes'])}, peak "
                f"{fmt_bytes(base['peak_bytes'])}, step "
                f"{'-' if step is None else f'{step * 1e3:.1f} ms'}."
            )
        mb = c.get("maxbatch") or mb_meta.get(label)
        if mb:
            lines.append(
                f"Max batch: the largest batch at seq {c.get('seq')} whose weights, AdamW moments "
                f"and step peak fit {fmt_bytes(mb.get('cap_bytes') or 0)}, from "
                f"{mb.get('probes')} probes at most per point (≥: a lower bound)."
            )
        lines += [
            "",
            "| point | peak / none | max batch | act / none | step / none | min param grad cos "
            "| peak | act | step ms | wall s | note |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for p in pts:
            name = point_label(p)
            if p.get("skipped"):
                why = _short(p["skipped"], 120).replace("|", "\\|")
                wall = _f(p.get("point_wall_s", p.get("wall_s")), ".0f")
                lines.append(f"| {name} |" + " |" * 8 + f" {wall} | {why} |")
                continue
            step = p.get("step_time_s")
            note = p.get("timing_error") or _dominated_note(p, pts)
            cells = [
                name,
                _f(p.get("peak_ratio"), ".3f"),
                _max_batch_cell(p),
                _f(p.get("ratio"), ".3f"),
                _f(p.get("step_time_ratio"), ".2f"),
                f"{p['grad_cosine']:.4f}",
                fmt_bytes(p["peak_bytes"]),
                fmt_bytes(p["saved_bytes"]),
                MISSING if step is None else f"{step * 1e3:.1f}",
                _f(p.get("point_wall_s", p.get("wall_s")), ".0f"),
                _short(note, 80).replace("|", "\\|"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    if not out:
        return "(no points measured yet)\n"
    wall = meta.get("wall_s")
    tail = (
        f"\n\nWall {wall / 60:.1f} min{'' if meta.get('complete') else ' (incomplete run)'}."
        if wall is not None
        else ""
    )
    return "\n\n".join(out) + tail + "\n"


def _dominates(a: dict, p: dict, key: str = "saved_bytes") -> bool:
    x, y, u, v = a.get(key), a.get("step_time_s"), p.get(key), p.get("step_time_s")
    if None in (x, y, u, v):
        return False
    return x <= u and y <= v and (x < u or y < v)


def _moves_nothing(p: dict) -> bool:
    return (p.get("note") or "").startswith("save_on_cpu on a CPU")


def findings(points: list[dict], by_peak: bool = False) -> list[str]:
    """Plain statements where a point falls short: stores more than `none`, peaks higher, changes
    the gradient, trains worse, is beaten on both axes (bytes, step time) by a PyTorch anchor or
    by another slimact point; and what was skipped or not timed. ``by_peak`` (CUDA): beaten on
    the peak and step time, the peak being what decides whether a run fits there."""
    key, what = ("peak_bytes", "peak") if by_peak else ("saved_bytes", "bytes")
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
        rivals = [a for a in ok if a is not p and not _moves_nothing(a) and _dominates(a, p, key)]
        anchors = [a["point"][len("anchor:") :] for a in rivals if a["kind"] == "anchor"]
        ours = [a["point"] for a in rivals if a["kind"] != "anchor"]
        if anchors:
            out.append(
                f"{name} is dominated by the PyTorch anchor(s) {', '.join(anchors)} "
                f"(no more {what}, no slower, better in one)."
            )
        if ours:
            out.append(
                f"{name} is dominated by {', '.join(f'`{o}`' for o in ours)}"
                + (" (peak and step time)." if by_peak else ".")
            )
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
