"""PNG plots of one model's bench points (matplotlib, Agg backend; imported lazily).

* :func:`pareto_plot`: saved MiB vs step time, one point per strategy/anchor, the Pareto front
  (not dominated in both) joined by a line and ringed;
* :func:`loss_plot`: the training loss per step of every point that trained;
* :func:`sites_plot`: per-site bytes of one block, the baseline next to a few strategies, grouped
  by the module inside the block.
"""

from __future__ import annotations

from pathlib import Path

from slimact.utils import require

MIB = 2**20
SITE_PREFERENCE = ("invact", "int4", "prac", "cola-m", "invact+int4", "auto@25%", "recompute")


def _plt():
    require("matplotlib", "plot", "slimact bench's plots").use("Agg")
    return require("matplotlib.pyplot", "plot", "slimact bench's plots")


def pareto_plot(points: list[dict], front: list[int], path: Path, title: str) -> Path:
    """``points``: measured records (no skipped ones); ``front``: indices into ``points``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, p in enumerate(points):
        x, y = p["saved_bytes"] / MIB, p["step_time_s"]
        anchor = p["kind"] == "anchor"
        ax.scatter(
            x,
            y,
            marker="s" if anchor else "o",
            color="tab:orange" if anchor else ("tab:gray" if p["point"] == "none" else "tab:blue"),
            zorder=3,
        )
        ax.annotate(
            p["point"],
            (x, y),
            textcoords="offset points",
            xytext=(4, 4 if i % 2 else -10),
            fontsize=7,
        )
    if front:
        fp = sorted((points[i]["saved_bytes"] / MIB, points[i]["step_time_s"]) for i in front)
        ax.plot(
            [a for a, _ in fp], [b for _, b in fp], "-", color="tab:red", lw=1.2, zorder=2,
            label="Pareto front",
        )  # fmt: skip
        ax.scatter(
            [a for a, _ in fp], [b for _, b in fp], s=140, facecolors="none",
            edgecolors="tab:red", zorder=4,
        )  # fmt: skip
    ax.scatter([], [], marker="o", color="tab:blue", label="slimact strategy")
    ax.scatter([], [], marker="s", color="tab:orange", label="PyTorch anchor")
    ax.set_xlabel("saved for backward (MiB, meter)")
    ax.set_ylabel("step time (s, median fwd+bwd over interleaved rounds)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_plot(points: list[dict], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for p in points:
        losses = (p.get("train") or {}).get("losses")
        if not losses:
            continue
        style = "--" if p["kind"] == "anchor" else "-"
        lw = 2.2 if p["point"] == "none" else 1.0
        ax.plot(range(1, len(losses) + 1), losses, style, lw=lw, label=p["point"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def site_groups(points: list[dict], limit: int = 4) -> list[dict]:
    """The baseline plus up to ``limit - 1`` strategies with per-site data, by preference."""
    by_name = {p["point"]: p for p in points if p.get("sites")}
    chosen = [by_name["none"]] if "none" in by_name else []
    for name in SITE_PREFERENCE:
        if name in by_name and len(chosen) < limit:
            chosen.append(by_name[name])
    return chosen


def sites_plot(points: list[dict], path: Path, title: str) -> Path:
    plt = _plt()
    chosen = site_groups(points)
    modules: list[str] = []
    for p in chosen:
        for s in p["sites"]:
            if s["module"] not in modules:
                modules.append(s["module"])
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.42 * len(modules) * max(1, len(chosen)) / 2)))
    height = 0.8 / max(1, len(chosen))
    for k, p in enumerate(chosen):
        per = {m: 0 for m in modules}
        for s in p["sites"]:
            per[s["module"]] += s["bytes"]
        ys = [i + k * height for i in range(len(modules))]
        ax.barh(ys, [per[m] / MIB for m in modules], height=height, label=p["point"])
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(modules))])
    ax.set_yticklabels(modules, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("MiB saved for backward in this block")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
