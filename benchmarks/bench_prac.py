"""PRAC / PAC / RAC benchmarks (prac.txt §6): memory, gradients, speed, training, SVD cost.

    PYTHONPATH=src python benchmarks/bench_prac.py memory --model llama-20m --batch 16 --seq 256
    PYTHONPATH=src python benchmarks/bench_prac.py train --strategy prac      # one 300-step run
    PYTHONPATH=src python benchmarks/bench_prac.py svd                        # exact vs randomized
    PYTHONPATH=src python benchmarks/bench_prac.py report                     # JSON -> md + png

Every subcommand merges its results into ``benchmarks/results/prac.json`` (with machine, torch
version, thread count and the command line) and ``report`` writes ``prac.md`` and
``prac_loss_<model>_b<B>s<S>.png``. Training runs use ``slimact.train.train`` on the embedded corpus; their lazy
update interval is scaled to the run (T1 = T2 = ``--interval``, default 20 of 300 steps, where the
paper uses 500 of 10K+): runs are named ``<strategy>-t<T1>-<T2>[-rsvd][-all]``.

Speed comparisons are taken in interleaved rounds in one process (``slimact.timing``): ``memory``
through ``slimact.compare`` (baseline, strategy, baseline, ...), ``svd`` with exact and every
randomized variant once per round; both report the median of per-round ratios with its min-max
spread (``*_spread``), and every record carries the load average. The training runs' tokens/s
come from separate runs one after the other, not interleaved: not a speed comparison.
``--results-dir`` (before the subcommand) writes elsewhere. Smoke::

    python benchmarks/bench_prac.py --results-dir /tmp/prac memory --model llama-tiny \
        --strategies prac --batch 1 --seq 16 --steps 2
    python benchmarks/bench_prac.py --results-dir /tmp/prac svd --model llama-tiny --layer 1 \
        --batch 1 --seq 16 --rounds 2
    python benchmarks/bench_prac.py --results-dir /tmp/prac report
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slimact.envinfo import machine_info
from slimact.timing import interleaved, load_average

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
JSON_PATH = RESULTS / "prac.json"
RUNS = RESULTS / "prac_runs"
NITERS = (0, 1, 2, 4)


def machine() -> dict:
    """Machine, versions, git commit, command and load average (shared by every benchmark)."""
    return machine_info() | {"load_avg": load_average()}


def merge(section: str, key: str, value: dict) -> None:
    """Merge one result into prac.json (under a file lock: runs may finish concurrently)."""
    import fcntl

    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(Path(tempfile.gettempdir()) / "slimact-bench-prac.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
        data.setdefault(section, {})[key] = {**value, "machine": machine()}
        tmp = JSON_PATH.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(JSON_PATH)


def _run_strategy(args: argparse.Namespace) -> tuple[str, str]:
    """(run name, strategy spec) of a run, e.g. ``("prac-t20-1-rsvd", "prac@t1=20,t2=1,...")``."""
    if args.strategy == "none":
        return "none", "none"
    t1, t2 = args.t1 or args.interval, args.t2 or args.interval
    name = f"{args.strategy}-t{t1}-{t2}" + ("-rsvd" if args.svd == "randomized" else "")
    name += "-all" if args.compress_all else ""
    spec = f"{args.strategy}@t1={t1},t2={t2},svd={args.svd},only_if_smaller={not args.compress_all}"
    return name, spec


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cmd_train(args: argparse.Namespace) -> None:
    """One training run; ``--from-run DIR`` records a finished run of the same command instead."""
    from slimact.train import TrainConfig, train

    torch.set_num_threads(args.threads)
    name, spec = _run_strategy(args)
    out = RUNS / f"{args.model}-{name}-b{args.batch}s{args.seq}-seed{args.seed}"
    cfg = TrainConfig(
        model=args.model,
        strategy=spec,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        out=str(out),
        threads=args.threads,
        ckpt_every=0,
        keep_last=1,
        progress=False,
    )
    t0 = time.perf_counter()
    if args.from_run:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(args.from_run) / "metrics.jsonl", out / "metrics.jsonl")
        history = _history(out)
        assert history[-1]["step"] == args.steps, (
            f"{args.from_run} did not finish {args.steps} steps"
        )
    else:
        train(cfg)
        history = _history(out)
    wall = time.perf_counter() - t0
    for ckpt in out.glob("ckpt-*"):  # the trainer's final checkpoint: 200+ MiB, not kept
        shutil.rmtree(ckpt)
    curve = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    train_curve = [(r["step"], r["loss"]) for r in history]
    merge(
        "train",
        f"{args.model}/{name}/b{args.batch}s{args.seq}",
        {
            "strategy": name,
            "steps": history[-1]["step"],
            "batch": args.batch,
            "seq": args.seq,
            "seed": args.seed,
            "t1": args.t1 or args.interval,
            "t2": args.t2 or args.interval,
            "svd": args.svd,
            "compress_all": args.compress_all,
            "final_val_loss": curve[-1][1],
            "final_train_loss": history[-1]["loss"],
            "saved_bytes_first_step": history[0].get("saved_bytes"),
            # median of this run's logged steps; runs go one after the other (not interleaved)
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in history[1:]),
            "wall_s": None if args.from_run else wall,
            "val_curve": curve,
            "train_curve": train_curve,
            "run_dir": str(
                out.relative_to(ROOT.parent) if out.is_relative_to(ROOT.parent) else out
            ),
        },
    )
    print(json.dumps({"strategy": name, "final_val_loss": curve[-1][1], "wall_s": wall}))


def cmd_memory(args: argparse.Namespace) -> None:
    from slimact.compare import CompareConfig, compare

    torch.set_num_threads(args.threads)
    for strategy in args.strategies:
        res = compare(
            CompareConfig(
                model=args.model,
                strategy=strategy,
                batch=args.batch,
                seq=args.seq,
                seed=args.seed,
                steps=args.steps,
                warmup=args.warmup,
                vocab_size=args.vocab,
            )
        )
        keep = (
            "saved_bytes baseline_saved_bytes ratio step_time_s baseline_step_time_s "
            "step_time_ratio step_time_ratio_spread grad_cosine loss baseline_loss params"
        ).split()
        row = {k: res[k] for k in keep}
        row["timing_load_avg"] = [res["timing"]["load_before"], res["timing"]["load_after"]]
        row.update(batch=args.batch, seq=args.seq, tokens=args.batch * args.seq)
        merge("memory", f"{args.model}/{strategy}/b{args.batch}s{args.seq}", row)
        print(json.dumps({"model": args.model, "strategy": strategy, **row}))


def cmd_ratio(args: argparse.Namespace) -> None:
    """Saved-bytes ratio vs tokens per step (forward only: the meter needs no backward)."""
    import slimact
    from slimact.models import build_model
    from slimact.strategies.prac import prac_report

    torch.set_num_threads(args.threads)
    for b, s in [tuple(int(v) for v in bs.split("x")) for bs in args.shapes]:
        row = {}
        for strategy in ("none", args.strategy):
            torch.manual_seed(args.seed)
            model = build_model(args.model, vocab_size=args.vocab)
            slimact.apply(model, strategy)
            x = torch.randint(0, model.config.vocab_size, (b, s))
            with slimact.measure(model, n_tokens=x.numel()) as m:
                model(x, targets=x)
            row["none" if strategy == "none" else "prac"] = m.report.total_bytes
            if strategy != "none":
                rep = prac_report(model)
                row["projection_bytes"] = sum(c["basis_bytes"] for c in rep["compressed"].values())
                row["sites_kept_not_worth_it"] = sum(
                    "pays off from" in why for why in rep["skipped"].values()
                )
            del model, m
        row.update(tokens=b * s, ratio=row["prac"] / row["none"], strategy=args.strategy)
        row["ratio_without_projections"] = (row["prac"] - row["projection_bytes"]) / row["none"]
        suffix = "" if args.strategy == "prac" else f"/{args.strategy}"
        merge("ratio", f"{args.model}/b{b}s{s}{suffix}", row)
        print(json.dumps({"model": args.model, "batch": b, "seq": s, **row}))


def cmd_svd(args: argparse.Namespace) -> None:
    """Exact SVD vs randomized range finder for Q1 on real llama-20m activations."""
    import slimact
    from slimact import sites
    from slimact.codecs.prac import principal_basis_ref, randomized_basis_ref
    from slimact.models import build_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args.model, vocab_size=args.vocab)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    want = {
        f"layers.{args.layer}.{s}" for s in ("self_attn.q_proj:linear#0", "mlp.down_proj:linear#0")
    }
    acts: dict[str, torch.Tensor] = {}

    def grab(site: str, t: torch.Tensor):
        if site in want and site not in acts:
            acts[site] = t.detach().reshape(-1, t.shape[-1]).clone()

    with sites.tracking(model), sites.policy(grab), torch.no_grad():
        with torch.enable_grad():
            model(x)
    del slimact
    for site, a in acts.items():
        n = a.shape[1]
        r1 = int(0.3 * n)
        exact = principal_basis_ref(a, r1)
        best = float((a @ exact).square().sum())
        tail = float(a.square().sum()) - best
        # exact and every randomized variant once per round (exact, niter0, niter1, ...)
        points = {"exact": functools.partial(principal_basis_ref, a, r1)}
        for niter in NITERS:
            gen = torch.Generator().manual_seed(0)
            points[f"niter{niter}"] = functools.partial(
                randomized_basis_ref, a, r1, gen, niter=niter
            )
        t = interleaved(points, rounds=args.rounds, warmup=1)
        row = {
            "shape": list(a.shape),
            "r1": r1,
            "exact_s": t.median_s("exact"),
            "rounds": args.rounds,
            "timing_load_avg": [t.load_before, t.load_after],
        }
        for niter in NITERS:
            gen = torch.Generator().manual_seed(0)
            q = randomized_basis_ref(a, r1, gen, niter=niter)
            got = float((a @ q).square().sum())
            ratio = t.ratio(f"niter{niter}", "exact")
            row[f"randomized_niter{niter}"] = {
                "s": t.median_s(f"niter{niter}"),
                "s_vs_exact": ratio.median,
                "s_vs_exact_spread": ratio.to_dict(),
                "captured_energy_vs_exact": got / best,
                "tail_energy_vs_exact": (float(a.square().sum()) - got) / tail,
            }
        merge("svd", f"{args.model}/{site}/b{args.batch}s{args.seq}", row)
        print(json.dumps({"site": site, **row}))


def _spread(r: dict, key: str) -> str:
    """``1.07 (0.98-1.15)``: the median of per-round ratios and its min-max, where recorded."""
    sp = r.get(f"{key}_spread")
    if not sp:  # recorded before the interleaved rounds: a ratio of medians, no spread
        return "–" if r.get(key) is None else f"{r[key]:.2f}"
    return f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f})"


def _plot(runs: dict, title: str, path: Path) -> None:
    """Training (10-step mean) and validation loss of every run in one (model, B×S) group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in sorted(runs.items(), key=lambda kv: (kv[0] != "none", kv[0])):
        steps, losses = zip(*run["train_curve"])
        k = 10  # moving average of the training loss
        smooth = [
            sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
            for i in range(len(losses))
        ]
        style = {"color": "black", "lw": 2} if name == "none" else {}
        axes[0].plot(steps, smooth, label=name, **style)
        vs, vl = zip(*run["val_curve"])
        axes[1].plot(vs, vl, marker="o", ms=3, label=name, **style)
    axes[0].set(title=f"{title}: training loss (10-step mean)", xlabel="step", ylabel="loss")
    axes[1].set(title=f"{title}: validation loss", xlabel="step", ylabel="loss")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report() -> None:
    """prac.json -> prac.md (tables) and prac_loss.png (the ablation curves)."""
    data = json.loads(JSON_PATH.read_text())
    lines = ["# PRAC / PAC / RAC (prac.txt) on CPU", ""]
    notes = RESULTS / "prac_notes.md"  # the hand-written reading of the numbers below
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    mem = data.get("memory", {})
    if mem:
        lines += [
            "## Saved activations, gradients, step time (`compare`, fp32, 1 thread)",
            "",
            "Step-time ratio: strategy / baseline, median of per-round ratios over interleaved "
            "rounds (min-max); a value without a spread was recorded before interleaving (one "
            "model timed after the other).",
            "",
            "| model | strategy | B×S | saved | baseline | ratio | grad_cosine | step-time ratio |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for key, r in sorted(mem.items()):
            model, strategy, _ = key.split("/")
            lines.append(
                f"| {model} | {strategy} | {r['batch']}×{r['seq']} | {r['saved_bytes'] / 2**20:.1f} MiB"
                f" | {r['baseline_saved_bytes'] / 2**20:.1f} MiB | {r['ratio']:.3f} "
                f"| {r['grad_cosine']:.3f} | {_spread(r, 'step_time_ratio')} |"
            )
        lines.append("")
    ratio = data.get("ratio", {})
    if ratio:
        lines += [
            "## Saved-bytes ratio vs tokens per step (meter, forward only; vs `none`)",
            "",
            "| model | strategy | B×S | tokens | ratio | basis | ratio without basis "
            "| sites kept (not worth it) |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for key, r in sorted(ratio.items(), key=lambda kv: kv[1]["tokens"]):
            model, bs = key.split("/")[:2]
            lines.append(
                f"| {model} | {r.get('strategy', 'prac')} | {bs} | {r['tokens']} | {r['ratio']:.3f} "
                f"| {r['projection_bytes'] / 2**20:.1f} MiB | {r['ratio_without_projections']:.3f} "
                f"| {r.get('sites_kept_not_worth_it', '–')} |"
            )
        lines.append("")
    train = data.get("train", {})
    groups: dict[tuple[str, str], dict] = {}
    for key, r in train.items():
        model, name, bs = key.split("/")
        groups.setdefault((model, bs), {})[name] = r
    for (model, bs), runs in sorted(groups.items(), key=lambda kv: kv[0][1] != "b8s256"):
        r0 = next(iter(runs.values()))
        shape = f"{r0['batch']}×{r0['seq']}"
        base = runs.get("none", {}).get("final_val_loss")
        lines += [
            f"## {r0['steps']}-step training, {model}, {shape} tokens per step (same seed, 1 thread)",
            "",
            "| run | T1 | T2 | Q1 by | sites | final val loss | vs none | tokens/s | saved (1st step) |",
            "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
        ]
        notes_tps = "tokens/s: median of each run's logged steps; the runs went one after the "
        notes_tps += "other, not interleaved, so the column is not a speed comparison."
        for name, r in sorted(runs.items(), key=lambda kv: (kv[0] != "none", kv[0])):
            rel = f"{(r['final_val_loss'] / base - 1) * 100:+.2f}%" if base else "–"
            prac = name != "none"
            lines.append(
                f"| {name} | {r['t1'] if prac else '–'} | {r['t2'] if prac else '–'} "
                f"| {r['svd'] if prac else '–'} "
                f"| {('all' if r['compress_all'] else 'where smaller') if prac else '–'} "
                f"| {r['final_val_loss']:.4f} | {rel} | {r['tokens_per_s']:.0f} "
                f"| {r['saved_bytes_first_step'] / 2**20:.1f} MiB |"
            )
        png = f"prac_loss_{model}_{bs}.png"
        _plot(runs, f"{model} {shape}", RESULTS / png)
        lines += ["", notes_tps, "", f"![loss curves, {model} {shape}]({png})", ""]
    svd = data.get("svd", {})
    if svd:
        lines += [
            "## Q1: exact SVD vs randomized range finder (real activations, 1 thread)",
            "",
            "Times: medians over rounds in which exact and every randomized variant ran once "
            "each; time vs exact: median of per-round ratios (min-max). Rows without it were "
            "timed one after the other (recorded before interleaving).",
            "",
            "| site | X shape | r1 | exact (s) | niter | randomized (s) | time vs exact "
            "| energy vs exact | tail vs exact |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for key, r in svd.items():
            for niter in (0, 1, 2, 4):
                q = r[f"randomized_niter{niter}"]
                lines.append(
                    f"| {key.split('/')[1]} | {r['shape']} | {r['r1']} | {r['exact_s']:.3f} "
                    f"| {niter} | {q['s']:.3f} | {_spread(q, 's_vs_exact')} "
                    f"| {q['captured_energy_vs_exact']:.4f} "
                    f"| {q['tail_energy_vs_exact']:.4f} |"
                )
        lines.append("")
    sub = data.get("subspace", {})
    if sub:
        lines += [
            "## Is Q1 stable across batches? (layer 2 at init, real text, Q1 from batch 1)",
            "",
            "Relative error ‖X̃ − X‖/‖X‖ on batch 1 (fresh Q1) and batches 2, 3 (stale Q1, "
            "as between lazy updates).",
            "",
            "| tokens | site | (r1, r2) | fresh | stale (batch 2, 3) |",
            "| ---: | --- | --- | ---: | ---: |",
        ]
        for _key, r in sorted(sub.items(), key=lambda kv: kv[1]["tokens"]):
            for site, v in r.items():
                if site in ("tokens", "machine"):
                    continue
                lines.append(
                    f"| {r['tokens']} | {site} | {tuple(v['ranks'])} | {v['fresh']:.3f} "
                    f"| {', '.join(f'{e:.3f}' for e in v['stale'])} |"
                )
        lines.append("")
    cmds = sorted({v["machine"]["command"] for sec in data.values() for v in sec.values()})
    m = next(iter(next(iter(data.values())).values()))["machine"]
    lines += [
        "## Reproduce",
        "",
        f"Machine: {m['processor']}, {m.get('cores', m.get('cpu_count'))} cores (shared), "
        f"torch {m['torch']}, "
        f"Python {m['python']}.",
        "",
        "```",
        *cmds,
        "PYTHONPATH=src python benchmarks/bench_prac.py report",
        "```",
        "",
    ]
    (RESULTS / "prac.md").write_text("\n".join(lines))


def cmd_subspace(args: argparse.Namespace) -> None:
    """Relative reconstruction error with Q1 from this batch (fresh) vs the previous one (stale).

    Lazy updates assume the principal subspace is stable across batches; this measures it on
    real text (the embedded corpus) for several tokens-per-step, at initialization.
    """
    from slimact import sites
    from slimact.codecs.prac import PracCodec, PracCodecConfig
    from slimact.data import BatchLoader, load_data
    from slimact.models import build_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args.model, vocab_size=args.vocab)
    train_split = load_data(None).train
    want = [f"layers.{args.layer}.{s}" for s in args.sites]
    for b, s in [tuple(int(v) for v in bs.split("x")) for bs in args.shapes]:
        loader = BatchLoader(train_split, b, s, args.seed)
        acts = []
        for _ in range(3):
            got: dict[str, torch.Tensor] = {}

            def grab(site: str, t: torch.Tensor, got=got):
                if site in want and site not in got:
                    got[site] = t.detach().reshape(-1, t.shape[-1]).clone()

            with sites.tracking(model), sites.policy(grab), torch.enable_grad():
                model(loader.next_batch()[0])
            acts.append(got)
        row = {}
        for site in want:
            f = 0.3 if site.endswith(":linear#0") else 0.2
            codec = PracCodec(PracCodecConfig(r1=f, r2=f, t1=10**9, t2=10**9), name=site)
            errs = []
            for got in acts:
                x = got[site]
                errs.append(float((codec.decode(codec.encode(x)) - x).norm() / x.norm()))
            row[site] = {"fresh": errs[0], "stale": errs[1:], "ranks": [codec.r1, codec.r2]}
        merge("subspace", f"{args.model}/b{b}s{s}", {"tokens": b * s, **row})
        print(json.dumps({"tokens": b * s, **row}))


def main() -> None:
    global RESULTS, JSON_PATH, RUNS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="llama-20m")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--threads", type=int, default=1)
    common.add_argument("--vocab", type=int, default=257)
    t = sub.add_parser("train", parents=[common])
    t.add_argument("--strategy", required=True, choices=["none", "prac", "pac", "rac"])
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--interval", type=int, default=20, help="T1 = T2 unless --t1/--t2 are given")
    t.add_argument("--t1", type=int, default=None)
    t.add_argument("--t2", type=int, default=None)
    t.add_argument("--svd", default="exact", choices=["exact", "randomized"])
    t.add_argument(
        "--compress-all",
        action="store_true",
        help="only_if_smaller=False: compress even where Z + basis outweigh X (small batches)",
    )
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--eval-batches", type=int, default=8)
    t.add_argument("--from-run", default=None, help="record this finished run of the command")
    m = sub.add_parser("memory", parents=[common])
    m.add_argument("--strategies", nargs="+", default=["prac", "pac", "rac"])
    m.add_argument("--batch", type=int, default=16)
    m.add_argument("--seq", type=int, default=256)
    m.add_argument("--steps", type=int, default=1, help="interleaved timing rounds")
    m.add_argument("--warmup", type=int, default=1)
    r = sub.add_parser("ratio", parents=[common])
    r.add_argument("--shapes", nargs="+", default=["4x128", "4x256", "8x256", "16x256", "32x256"])
    r.add_argument("--strategy", default="prac", help="a PRAC-family strategy, e.g. invact+prac")
    s = sub.add_parser("svd", parents=[common])
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--seq", type=int, default=256)
    s.add_argument("--layer", type=int, default=2, help="the block whose activations are used")
    s.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    q = sub.add_parser("subspace", parents=[common])
    q.add_argument("--shapes", nargs="+", default=["4x96", "16x256"])
    q.add_argument("--layer", type=int, default=2)
    q.add_argument(
        "--sites",
        nargs="+",
        default=[
            "input_layernorm:pow#0",
            "self_attn.q_proj:linear#0",
            "mlp.act_fn:silu#0",
            "mlp:mul#1",
            "mlp.down_proj:linear#0",
        ],
    )
    sub.add_parser("report")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="where prac.* go")
    args = p.parse_args()
    RESULTS, JSON_PATH, RUNS = (
        args.results_dir,
        args.results_dir / "prac.json",
        args.results_dir / "prac_runs",
    )
    if args.cmd == "report":
        write_report()
        return
    cmds = {"train": cmd_train, "memory": cmd_memory, "ratio": cmd_ratio, "svd": cmd_svd}
    cmds["subspace"] = cmd_subspace
    cmds[args.cmd](args)


if __name__ == "__main__":
    main()
