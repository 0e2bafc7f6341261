"""Results JSON -> ``bench.md`` (tables, reading aids) + PNG plots -> BENCHMARKS.md.

A pure function of the JSON files (``load_results`` then ``render``), so it is testable on a fake
results set; every output path is a parameter of :func:`write_report`.

Which runs are shown: every suite whose JSON exists. For the CPU suites, ``full`` is preferred
over ``quick`` when both exist (the other is mentioned); a filtered run (``<suite>-subset.json``)
is shown only when no complete file of that suite exists.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from slimact.bench import plots

MIB = 2**20
SUITE_ORDER = ("full", "quick", "gpu")
READING = "bench_reading.md"
READING_PLACEHOLDER = (
    "## Reading: slimact against each paper's headline claim and the anchors\n\n"
    "_To be written by hand after the `full` run._\n"
)

MEANING = """\
- **saved MiB**: bytes autograd keeps for backward after the first forward (the meter: unique
  storages, parameters excluded, codec payloads at their packed size, tensors a checkpoint holds
  included); **ratio** is against `none` of the same model in the same run.
- **step s**: median forward+backward time over a few steps after warm-up (no optimizer);
  **step ratio** against `none`; **tokens/s** = tokens per step / step s.
- **grad_cos**: minimum over parameters of the cosine between this point's and `none`'s
  first-step gradients (same seed, same batch); 1.0 means the same gradient.
- **loss@N**: validation loss after N AdamW steps from the same initial weights on the same
  batches (fixed validation windows); **Δloss** is against `none`. N is small: it shows whether a
  point trains the same, not final quality.
- **peak MiB (GPU)**: `torch.cuda.max_memory_allocated` during the measured step (weights and
  gradients included); empty on CPU.
- **models**: random initial weights from the suite's seed; slimact's models use the byte
  tokenizer's 257-token vocabulary (so `gpt2-124m` has 86M parameters here, its 124M count is
  with GPT-2's 50,257 tokens); `hf-bert-base` is `BertForMaskedLM(BertConfig())` (30,522 tokens,
  dropout 0.1, fed byte ids, 15% masked with `slimact.hf.mlm_batch`).
- **anchors** (plain PyTorch, same meter, same run): `torch-checkpoint` = per-block
  `torch.utils.checkpoint` (non-reentrant); `compile-budget` = `torch.compile` (inductor) of the
  whole loss with `torch._functorch.config.activation_memory_budget`; `save-on-cpu` =
  `torch.autograd.graph.save_on_cpu` (on a CPU machine it moves nothing: the host *is* the device).
"""


# ----------------------------------------------------------------------------- loading
def load_results(results_dir: Path) -> dict[str, dict]:
    """``{suite name: result}`` from ``results_dir/*.json``; complete files win over subsets."""
    chosen: dict[str, tuple[int, dict]] = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            name = data["meta"]["suite"]["name"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a slimact bench results file: {e}") from None
        data["meta"]["_file"] = path.name
        rank = (0 if data["meta"].get("selection") else 2) + (
            1 if data["meta"].get("complete") else 0
        )
        if name not in chosen or rank > chosen[name][0]:
            chosen[name] = (rank, data)
    return {n: d for n, (_, d) in chosen.items()}


def shown_suites(results: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(suites shown in full, suites only mentioned): ``full`` hides ``quick``."""
    names = sorted(results, key=lambda n: (SUITE_ORDER.index(n) if n in SUITE_ORDER else 99, n))
    hidden = ["quick"] if "full" in results and "quick" in results else []
    return [n for n in names if n not in hidden], hidden


# ----------------------------------------------------------------------------- pure helpers
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


def by_model(points: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p["model"], []).append(p)
    return out


def _f(v, fmt: str, empty: str = "") -> str:
    return empty if v is None else format(v, fmt)


def _loss(p: dict) -> float | None:
    return (p.get("train") or {}).get("val_loss")


def model_table(points: list[dict], train_steps: int | None = None) -> str:
    """The per-model table (baseline first); skipped points get a row saying why."""
    base = next((p for p in points if p["point"] == "none" and not p.get("skipped")), None)
    base_loss = _loss(base) if base else None
    n = f"@{train_steps}" if train_steps else "@N"
    lines = [
        f"| point | saved MiB | ratio | step s | step ratio | tokens/s | grad_cos | loss{n} "
        "| Δloss vs none | peak MiB (GPU) | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for p in points:
        name = (
            f"anchor `{p['point'][len('anchor:') :]}`"
            if p["kind"] == "anchor"
            else f"`{p['point']}`"
        )
        if p.get("skipped"):
            reason = _short(p["skipped"]).replace("|", "\\|")
            lines.append(f"| {name} | | | | | | | | | | skipped: {reason} |")
            continue
        loss = _loss(p)
        dloss = None if loss is None or base_loss is None else loss - base_loss
        note = p.get("note") or ""
        err = (p.get("train") or {}).get("error")
        if err:
            note = (note + "; " if note else "") + f"training failed: {err}"
        peak = p.get("peak_allocated_bytes")
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    f"{p['saved_bytes'] / MIB:,.2f}",
                    _f(p.get("ratio"), ".3f"),
                    f"{p['step_time_s']:.3f}",
                    _f(p.get("step_time_ratio"), ".2f"),
                    f"{p['tokens_per_s']:,.0f}",
                    f"{p['grad_cosine']:.5f}",
                    _f(loss, ".4f"),
                    _f(dloss, "+.4f"),
                    "" if peak is None else f"{peak / MIB:,.1f}",
                    note.replace("|", "\\|"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _dominates(a: dict, p: dict) -> bool:
    x, y, u, v = a["saved_bytes"], a["step_time_s"], p["saved_bytes"], p["step_time_s"]
    return x <= u and y <= v and (x < u or y < v)


def _moves_nothing(p: dict) -> bool:
    return (p.get("note") or "").startswith("save_on_cpu on a CPU")


def findings(points: list[dict]) -> list[str]:
    """Plain statements where a point falls short: stores more than `none`, changes the gradient,
    trains worse, is beaten on both axes (bytes, step time) by a PyTorch anchor or by another
    slimact point; and what was skipped."""
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
    return out


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


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
            and p["step_time_s"] <= a["step_time_s"]
        ]
        out.append(
            f"anchor `{a['point'][len('anchor:') :]}`: ratio {_f(a.get('ratio'), '.3f')}, step "
            f"ratio {_f(a.get('step_time_ratio'), '.2f')}; slimact points with fewer bytes at no "
            f"greater step time: {', '.join(f'`{b}`' for b in beats) or 'none'}."
        )
    return out


# ----------------------------------------------------------------------------- rendering
def _machine(meta: dict) -> str:
    dev = meta["suite"]["device"]
    gpu = f", GPU {meta['gpu']}" if meta.get("gpu") else ""
    return (
        f"{meta.get('processor')} ({meta.get('cpu_count')} cores, {meta.get('torch_threads')} "
        f"torch threads){gpu}, device {dev}{' bf16 autocast' if meta['suite'].get('bf16') else ', fp32'}; "
        f"python {meta.get('python')}, torch {meta.get('torch')}, {meta.get('platform')}"
    )


def plot_names(suite: str, model: str) -> dict[str, str]:
    return {k: f"bench_{suite}_{model}_{k}.png" for k in ("pareto", "loss", "sites")}


def render_suite(name: str, result: dict, plot_dir: Path | None) -> str:
    """Markdown for one suite; writes its plots into ``plot_dir`` (skipped when None)."""
    meta = result["meta"]
    wall = meta.get("wall_s")
    lines = [
        f"## Suite `{name}`",
        "",
        f"- Machine: {_machine(meta)}.",
        f"- Git commit `{meta.get('git_commit')}`; command `{meta.get('command')}`; started "
        f"{meta.get('start')}, wall {'' if wall is None else f'{wall / 60:.1f} min'}"
        f"{'' if meta.get('complete') else ' (**incomplete run**)'}; data: {meta.get('data')}.",
        f"- Suite: {meta['suite'].get('description')}; seed {meta['suite'].get('seed')}, "
        f"compile budget {meta['suite'].get('compile_budget')}.",
    ]
    if meta.get("load_avg_start") or meta.get("load_avg_end"):
        when = [
            f"at {k} {meta[f'load_avg_{k}']}" for k in ("start", "end") if meta.get(f"load_avg_{k}")
        ]
        lines.append(
            f"- Load average (1/5/15 min) {', '.join(when)} on {meta.get('cpu_count')} cores: "
            "above the core count means other jobs shared the CPU and absolute times are inflated."
        )
    if meta.get("uncommitted_src"):
        lines.append(
            "- The run used uncommitted changes to: "
            + ", ".join(f"`{f}`" for f in meta["uncommitted_src"])
            + "."
        )
    if meta.get("selection"):
        lines.append(f"- Filtered run: {meta['selection']}.")
    amended = meta.get("amended")
    if amended:  # points replaced by a later partial run of the same suite (recorded, not hidden)
        lines.append(
            f"- Amended: the `{amended.get('points')}` points of "
            f"{', '.join(amended.get('models', []))} come from a later run at commit "
            f"`{amended.get('git_commit')}` (`{amended.get('command')}`): {amended.get('reason')}."
        )
    cases = {c["model"]: c for c in meta["suite"]["cases"]}
    for model, pts in by_model(result["points"]).items():
        c = cases.get(model, {})
        steps = c.get("train_steps")
        params = next((p.get("params") for p in pts if p.get("params")), None)
        lines += [
            "",
            f"### {model}",
            "",
            f"{'' if params is None else f'{params:,} parameters; '}batch {c.get('batch')} x seq "
            f"{c.get('seq')}; step time median of {c.get('timing_steps')} after "
            f"{c.get('warmup')} warm-up; {steps} training steps (lr {c.get('lr')}).",
            "",
            model_table(pts, steps),
        ]
        ok = measured(pts)
        if plot_dir is not None and ok:
            names = plot_names(name, model)
            front = pareto_front([(p["saved_bytes"], p["step_time_s"]) for p in ok])
            plots.pareto_plot(
                ok, front, plot_dir / names["pareto"], f"{model} ({name}): memory vs step time"
            )
            plots.loss_plot(ok, plot_dir / names["loss"], f"{model} ({name}): training loss")
            images = [("memory vs step time, Pareto front ringed", names["pareto"])]
            images.append(("training loss per point", names["loss"]))
            if plots.site_groups(ok):
                block = next((p.get("sites_block") for p in ok if p.get("sites_block")), "")
                plots.sites_plot(
                    ok,
                    plot_dir / names["sites"],
                    f"{model} ({name}): per-site bytes of block {block}",
                )
                images.append((f"per-site bytes of block `{block}`", names["sites"]))
            lines += ["", " ".join(f"![{alt}]({f})" for alt, f in images)]
        if ok:
            front = pareto_front([(p["saved_bytes"], p["step_time_s"]) for p in ok])
            lines += [
                "",
                "Pareto front (saved bytes, step time): "
                + ", ".join(f"`{ok[i]['point']}`" for i in front)
                + ".",
            ]
        al = anchor_lines(pts)
        if al:
            lines += ["", "Against the anchors:", ""] + [f"- {x}" for x in al]
        fs = findings(pts)
        lines += ["", "Where it falls short:", ""] + (
            [f"- {x}" for x in fs] or ["- nothing flagged."]
        )
    return "\n".join(lines)


def render(results: dict[str, dict], plot_dir: Path | None = None) -> str:
    """The whole ``bench.md``; plots go to ``plot_dir`` (none written when None)."""
    shown, hidden = shown_suites(results)
    lines = [
        "# Side by side (slimact bench)",
        "",
        "Generated by `slimact bench` (`slimact bench --report-only` regenerates it) from "
        "`benchmarks/results/bench/*.json`. Each suite measures, in one process, every strategy "
        "and the PyTorch anchors on the same model, seed and batch, baseline first, so the "
        "ratios hold even where absolute timings move with machine load.",
        "",
        "Run: " + ", ".join(f"`{n}` ({results[n]['meta'].get('_file')})" for n in shown) + ".",
    ]
    for h in hidden:
        m = results[h]["meta"]
        w = m.get("wall_s")
        lines.append(
            f"A `{h}` run also exists ({m.get('_file')}, {'' if w is None else f'{w / 60:.1f} min, '}"
            f"commit `{m.get('git_commit')}`); `full` is shown instead."
        )
    lines += ["", "What the numbers mean:", "", MEANING.rstrip()]
    for n in shown:
        lines += ["", render_suite(n, results[n], plot_dir)]
    return "\n".join(lines) + "\n"


def write_report(
    results_dir: Path,
    out_md: Path,
    plot_dir: Path | None = None,
    benchmarks_md: Path | None = None,
) -> list[Path]:
    """Write ``out_md`` (bench.md) and its plots (next to it unless ``plot_dir``), create the
    reading placeholder next to it if missing, and, with ``benchmarks_md``, rebuild that file
    from ``out_md``'s directory (``slimact.bench.document``). Returns the files written."""
    from slimact.bench import document

    results = load_results(results_dir)
    if not results:
        raise FileNotFoundError(
            f"no results JSON in {results_dir}; run `slimact bench quick` first"
        )
    out_md = Path(out_md)
    plot_dir = Path(plot_dir) if plot_dir is not None else out_md.parent
    plot_dir.mkdir(parents=True, exist_ok=True)
    out_md.write_text(render(results, plot_dir))
    shown, _ = shown_suites(results)
    written = [out_md, *sorted(f for n in shown for f in plot_dir.glob(f"bench_{n}_*.png"))]
    reading = out_md.parent / READING
    if not reading.exists():
        reading.write_text(READING_PLACEHOLDER)
        written.append(reading)
    if benchmarks_md is not None:
        written.append(document.write(out_md.parent, Path(benchmarks_md)))
    return written
