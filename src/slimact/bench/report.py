"""Results JSON -> ``bench.md`` (tables, reading aids) + PNG plots -> BENCHMARKS.md.

A pure function of the JSON files (``load_results`` then ``render``), so it is testable on a fake
results set; every output path is a parameter of :func:`write_report`. One section per model case
(``case`` label, e.g. ``llama-20m (V=32000)``): how its step times were taken (interleaved rounds
and the load around them, from ``meta.timing``), the loss head's share of the baseline's saved
bytes, the table (:mod:`slimact.bench.tables`: saved bytes, head share, peak, step-time ratio with
its min-max spread, ...), plots, Pareto front, anchors and findings. Schema-1 files (no peak, no
spread, no head share, points timed one by one) still render, with ``-`` where a key is missing.

Which runs are shown: every suite whose JSON exists. For the CPU suites, ``full`` is preferred
over ``quick`` when both exist (the other is mentioned); a filtered run (``<suite>-subset.json``)
is shown only when no complete file of that suite exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from slimact.bench import document, plots
from slimact.bench.tables import (  # noqa: F401  (model_table, pareto_front: public here too)
    MIB,
    PEAK_DECIDES,
    anchor_lines,
    by_case,
    findings,
    measured,
    model_table,
    pareto_front,
    timed,
)

SUITE_ORDER = ("full", "quick", "gpu")
READING = "bench_reading.md"
READING_PLACEHOLDER = (
    "## Reading: slimact against each paper's headline claim and the anchors\n\n"
    "_To be written by hand after the `full` run._\n"
)

MEANING = """\
- **saved MiB**: bytes autograd keeps for backward after the first forward (the meter: unique
  storages, parameters excluded, codec payloads at their packed size, tensors a checkpoint holds
  included); **ratio** is against `none` of the same case in the same run.
- **head share**: the loss head's part of the saved bytes: sites outside the blocks in the output
  projection (`lm_head`; BERT's `cls` head) or at the model's root (the loss: its logits and
  softmax); `-` where the meter cannot attribute saves (`compile-budget`'s compiled graph).
- **peak MiB**: the peak of live bytes over one whole forward+backward above what was live at its
  start (weights, optimizer state and the batch excluded; the step's gradients, temporaries and
  recomputation included): on CPU from the torch profiler's memory events, on CUDA from the
  allocator (`max_memory_allocated`). Taken on a separate, untimed step; **peak ratio** is
  against `none`.
- **step s**: median time of one forward+backward (no optimizer) over interleaved rounds: each
  round runs every point of the case once, `none` first, after warm-up rounds, so every point of
  a round sees about the same machine load. **step ratio** is the median over rounds of
  t(point) / t(`none`) in the same round, with its min-max over the rounds in parentheses;
  **tokens/s** = tokens per step / step s. Timing runs after the training run (below), on the
  measurement batch.
- **grad_cos**: minimum over parameters of the cosine between this point's and `none`'s
  first-step gradients (same seed, same batch); 1.0 means the same gradient.
- **loss@N**: validation loss after N AdamW steps from the same initial weights on the same
  batches (fixed validation windows); **Δloss** is against `none`. N is small: it shows whether a
  point trains the same, not final quality.
- **models**: random initial weights from the suite's seed; slimact's models use the byte
  tokenizer's 257-token vocabulary (so `gpt2-124m` has 86M parameters here, its 124M count is
  with GPT-2's 50,257 tokens), except cases named `(V=...)`: that vocabulary, on random token ids
  (memory and speed do not depend on the ids; their loss only checks that points train alike);
  `hf-bert-base` is `BertForMaskedLM(BertConfig())` (30,522 tokens, dropout 0.1, fed byte ids, 15%
  masked with `slimact.hf.mlm_batch`).
- **anchors** (plain PyTorch, same meter, same run): `torch-checkpoint` = per-block
  `torch.utils.checkpoint` (non-reentrant); `compile-budget` = `torch.compile` (inductor) of the
  whole loss with `torch._functorch.config.activation_memory_budget`; `save-on-cpu` =
  `torch.autograd.graph.save_on_cpu` (on a CPU machine it moves nothing: the host *is* the device).
- `-`: not measured (a results file of an older schema, or a point that failed its timing).
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
    """(suites shown in full, suites only mentioned): ``full`` hides an older ``quick``; a
    ``quick`` run newer than ``full`` (e.g. after a change of the measurement) is shown too."""
    names = sorted(results, key=lambda n: (SUITE_ORDER.index(n) if n in SUITE_ORDER else 99, n))
    hidden = []
    if "full" in results and "quick" in results:
        start = {n: str(results[n]["meta"].get("start") or "") for n in ("full", "quick")}
        if start["quick"] <= start["full"]:
            hidden = ["quick"]
        else:
            names.remove("quick")
            names.insert(names.index("full"), "quick")
    return [n for n in names if n not in hidden], hidden


# ----------------------------------------------------------------------------- rendering
def _machine(meta: dict) -> str:
    dev = meta["suite"]["device"]
    gpu = f", GPU {meta['gpu']}" if meta.get("gpu") else ""
    return (
        f"{meta.get('processor')} ({meta.get('cpu_count')} cores, {meta.get('torch_threads')} "
        f"torch threads){gpu}, device {dev}{' bf16 autocast' if meta['suite'].get('bf16') else ', fp32'}; "
        f"python {meta.get('python')}, torch {meta.get('torch')}, {meta.get('platform')}"
    )


def _dtype_note(suite: dict) -> str:
    dtype, backend = suite.get("dtype"), suite.get("compile_backend")
    parts = [f"weights {dtype}"] if dtype and dtype != "float32" else []
    if backend and backend != "inductor":
        parts.append(f"compile backend {backend}")
    return "".join(f", {p}" for p in parts)


def plot_names(suite: str, case: str) -> dict[str, str]:
    """PNG names of one case: ``bench_<suite>_<case slug>_<kind>.png`` (``llama-20m (V=32000)``
    -> ``llama-20m_V_32000``)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", case).strip("_")
    return {k: f"bench_{suite}_{slug}_{k}.png" for k in ("pareto", "loss", "sites")}


def _timing_line(c: dict, timing: dict | None) -> str:
    """How the case's step times were taken (schema 2: interleaved rounds; 1: one by one)."""
    if timing is None:
        return (
            f"step time median of {c.get('timing_steps')} after {c.get('warmup')} warm-up, each "
            "point timed alone one after another (an older results file: ratios include load drift)"
        )

    def load(v) -> str:
        return "?" if v is None else f"{v:.2f}"

    failed = f", {len(timing['failed'])} failed" if timing.get("failed") else ""
    if timing.get("mode") == "pairs":
        return (
            f"step time: each point against `none` right after it was measured, "
            f"{timing.get('rounds')} interleaved rounds after {timing.get('warmup')} warm-up "
            f"({len(timing.get('points', []))} points timed{failed}), 1-min load average "
            f"{load(timing.get('load_before'))} -> {load(timing.get('load_after'))}"
        )
    return (
        f"step time: {timing.get('rounds')} interleaved rounds of {len(timing.get('points', []))} "
        f"points after {timing.get('warmup')} warm-up{failed}, 1-min load average "
        f"{load(timing.get('load_before'))} -> {load(timing.get('load_after'))} during the rounds"
    )


def _case_section(
    suite: str,
    label: str,
    pts: list[dict],
    c: dict,
    timing: dict | None,
    plot_dir: Path | None,
    cuda: bool = False,
) -> list[str]:
    steps = c.get("train_steps")
    params = next((p.get("params") for p in pts if p.get("params")), None)
    vocab = c.get("vocab_size")
    training = f"{steps} training steps (lr {c.get('lr')})" if steps else "no training run"
    lines = [
        "",
        f"### {label}",
        "",
        f"{'' if params is None else f'{params:,} parameters; '}"
        f"{f'vocabulary {vocab:,}, random token ids; ' if vocab else ''}batch {c.get('batch')} x "
        f"seq {c.get('seq')}; {_timing_line(c, timing)}; {training}.",
    ]
    if cuda:
        lines += ["", f"On CUDA the table leads with the peak: {PEAK_DECIDES}."]
        mb = c.get("maxbatch")
        if mb:
            lines.append(
                f"Max batch: the largest batch at seq {c.get('seq')} whose weights, AdamW "
                f"moments and step peak fit {mb.get('cap')}, found in at most "
                f"{mb.get('probes')} measured probes per point (≥: a lower bound)."
            )
    base = next((p for p in measured(pts) if p["point"] == "none"), None)
    if base is not None and base.get("head_share") is not None:
        lines += [
            "",
            f"The loss head (output projection and loss) holds {base['head_share']:.1%} of "
            f"`none`'s saved bytes ({base['head_saved_bytes'] / MIB:,.2f} MiB).",
        ]
    lines += ["", model_table(pts, steps, lead_with_peak=cuda)]
    ok, fast = measured(pts), timed(pts)
    front = pareto_front([(p["saved_bytes"], p["step_time_s"]) for p in fast])
    if plot_dir is not None and ok:
        names = plot_names(suite, label)
        images = []
        if fast:
            title = f"{label} ({suite}): memory vs step time"
            plots.pareto_plot(fast, front, plot_dir / names["pareto"], title)
            images.append(("memory vs step time, Pareto front ringed", names["pareto"]))
        plots.loss_plot(ok, plot_dir / names["loss"], f"{label} ({suite}): training loss")
        images.append(("training loss per point", names["loss"]))
        if plots.site_groups(ok):
            block = next((p.get("sites_block") for p in ok if p.get("sites_block")), "")
            title = f"{label} ({suite}): per-site bytes of block {block}"
            plots.sites_plot(ok, plot_dir / names["sites"], title)
            images.append((f"per-site bytes of block `{block}`", names["sites"]))
        lines += ["", " ".join(f"![{alt}]({f})" for alt, f in images)]
    if fast:
        lines += [
            "",
            "Pareto front (saved bytes, step time): "
            + ", ".join(f"`{fast[i]['point']}`" for i in front)
            + ".",
        ]
    al = anchor_lines(pts)
    if al:
        lines += ["", "Against the anchors:", ""] + [f"- {x}" for x in al]
    fs = findings(pts, by_peak=cuda)
    lines += ["", "Where it falls short:", ""] + ([f"- {x}" for x in fs] or ["- nothing flagged."])
    return lines


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
        f"compile budget {meta['suite'].get('compile_budget')}"
        f"{_dtype_note(meta['suite'])}.",
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
    cases = {c.get("case") or c["model"]: c for c in meta["suite"]["cases"]}
    timings = meta.get("timing") or {}
    for label, pts in by_case(result["points"]).items():
        lines += _case_section(
            name,
            label,
            pts,
            cases.get(label, {}),
            timings.get(label),
            plot_dir,
            cuda=meta["suite"].get("device") == "cuda",
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
    if "full" in shown and "quick" in shown:
        lines.append(
            "The `quick` run is newer than the `full` run: both are shown, `quick` first; where "
            "they differ in method (e.g. the timing scheme) the newer one holds."
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
