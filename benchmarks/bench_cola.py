"""CoLA / CoLA-M on our CPU (cola.txt Tables 4, 7, 9, 11; Figs. 2, 7).

Parts (``--parts``, default all), each merged into ``benchmarks/results/cola.json``:

- ``speed``   training step time, tokens/s and measured activation bytes of llama-20m vs cola-20m
              with none / recompute / cola-m, in one process, interleaved rounds (each of the
              five configs runs ``--steps`` optimizer steps per round, ``slimact.timing``);
              ``speedup_vs_llama_none`` is the median of per-round ratios, with its spread;
              measured bytes per block per token next to Table 4's formulas.
- ``flops``   calculator table (Tables 2-3) for our and the paper's sizes, and recompute FLOPs
              measured with FlopCounterMode (vanilla checkpointing of llama-20m vs CoLA-M of
              cola-20m; Fig. 7's 4.6x is for LLaMA-1B at n = 256).
- ``infer``   forward tokens/s at batch 32 (Table 11; seq scaled down for CPU) + weight bytes;
              both models once per round, ``cola_over_llama_forward_time`` the median of
              per-round ratios, with its spread.
- ``quality`` 500-step runs of llama-20m, cola-20m and llama-20m-control (same tokens, seed and
              hyper-parameters) through ``slimact.train``; finished runs are reused. Their
              tokens/s come from runs one after the other: not a speed comparison.
- ``rank``    r(α) of every projection / MLP activation of the trained llama-20m (and cola-20m)
              checkpoints, with the Fig. 2-style plot.

    PYTHONPATH=src python benchmarks/bench_cola.py --threads 1
    PYTHONPATH=src python benchmarks/bench_cola.py --parts speed,infer --threads 1
    python benchmarks/bench_cola.py --parts speed,infer --batch 1 --seq 8 --steps 1 --rounds 2 \
        --infer-batch 2 --infer-seq 8 --results-dir /tmp/cola   # smoke

Every part's record carries the load average (``machine.load_avg``); timed parts also the load
before and after their rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import slimact
from slimact.cola.flops import (
    activation_memory,
    count_flops,
    model_dims,
    recompute_flops,
    training_flops,
)
from slimact.models import build_model, count_params
from slimact.timing import interleaved, load_average

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RUNS = Path("runs/cola-quality")
QUALITY = dict(steps=500, batch=4, seq=64, seed=0, eval_every=100, eval_batches=32)


def machine(threads: int) -> dict:
    return {
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "load_avg_at_start": os.getloadavg()[0],  # (in fact when the part's record is written)
        "load_avg": load_average(),  # when the part's record is written, after it ran
    }


def _train_step(model, opt, x):
    loss = model(x, targets=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def part_speed(batch: int, seq: int, steps: int, rounds: int) -> dict:
    configs = [("llama-20m", "none"), ("llama-20m", "recompute"), ("cola-20m", "none"),
               ("cola-20m", "recompute"), ("cola-20m", "cola-m")]  # fmt: skip
    x = torch.randint(0, 257, (batch, seq), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, strat in configs:
        torch.manual_seed(0)
        m = slimact.apply(build_model(name), strat)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        with slimact.measure(m, n_tokens=x.numel()) as meter:
            loss = m(x, targets=x).loss
        loss.backward()
        opt.zero_grad(set_to_none=True)
        rep = meter.report
        runs[(name, strat)] = {"model": m, "opt": opt, "times": [], "report": rep}

    def point(r):
        def run_steps():
            for _ in range(steps):
                _train_step(r["model"], r["opt"], x)

        return run_steps

    # one call of every config per round (``steps`` optimizer steps each), so load changes hit
    # every config alike; the speedup is the median of per-round ratios
    points = {f"{name}/{strat}": point(r) for (name, strat), r in runs.items()}
    timing = interleaved(points, rounds=rounds, warmup=1)
    out = []
    for (name, strat), r in runs.items():
        key = f"{name}/{strat}"
        r["times"] = [s / steps for s in timing.times[key]]
        dm = model_dims(name)
        rep = r["report"]
        t = timing.median_s(key) / steps
        speedup = timing.ratio("llama-20m/none", key)  # per round: t(llama none) / t(this)
        per_tok_block = rep.bytes_per_token_per_block()
        method = {"none": "cola" if name.startswith("cola") else "full-rank",
                  "recompute": "vanilla-gcp", "cola-m": "cola-m"}[strat]  # fmt: skip
        formula = activation_memory(
            method, seq, dm.d, dm.n_heads, dm.rank, both_sigma=dm.both_sigma
        )
        out.append(
            {
                "model": name,
                "strategy": strat,
                "params": count_params(r["model"]),
                "step_time_s_median": t,
                "step_times_s": r["times"],
                "tokens_per_s": batch * seq / t,
                "speedup_vs_llama_none": speedup.median,
                "speedup_vs_llama_none_spread": speedup.to_dict(),
                "saved_bytes": rep.total_bytes,
                "block_bytes": rep.block_bytes,
                "bytes_per_token_per_block": per_tok_block,
                "formula": method,
                "formula_bytes_per_token_per_block": formula / seq * 4,
                "measured_over_formula": per_tok_block / (formula / seq * 4),
            }
        )
    return {
        "batch": batch,
        "seq": seq,
        "timed_steps_per_round": steps,
        "rounds": rounds,
        "step_times_s_note": "per round: the round's time / timed_steps_per_round",
        "timing_load_avg": [timing.load_before, timing.load_after],
        "runs": out,
    }


def part_flops(seq: int) -> dict:
    table = {}
    for name in ("llama-20m", "llama-60m", "llama-130m", "llama-350m", "llama-1b", "llama-7b"):
        rank = model_dims(name.replace("llama", "cola")).rank  # the paper's r for this size
        res = training_flops(name, seq=seq, rank=rank)
        body = training_flops(name, seq=seq, rank=rank, include_head=False)
        table[name] = {
            "rank": res["rank"],
            "flops_per_token": {k: v["flops_per_token"] for k, v in res["methods"].items()},
            "vs_full_rank": {k: v["vs_full_rank"] for k, v in res["methods"].items()},
            "vs_full_rank_without_head": {k: v["vs_full_rank"] for k, v in body["methods"].items()},
            "recompute_per_layer": res["recompute_per_layer"],
        }
    x = torch.randint(0, 257, (1, seq), generator=torch.Generator().manual_seed(0))
    measured = {}
    for name, strat in (("llama-20m", "recompute"), ("cola-20m", "cola-m")):
        torch.manual_seed(0)
        base = build_model(name)
        other = slimact.apply(copy.deepcopy(base), strat)
        fb, fo = count_flops(base, x), count_flops(other, x)
        layers = base.config.n_layers
        measured[f"{name}/{strat}"] = {
            "train_flops": fb["total"],
            "train_flops_with_strategy": fo["total"],
            "recompute_per_layer": (fo["total"] - fb["total"]) / layers,
        }
    v = measured["llama-20m/recompute"]["recompute_per_layer"]
    c = measured["cola-20m/cola-m"]["recompute_per_layer"]
    d20 = model_dims("cola-20m")
    return {
        "seq": seq,
        "calculator": table,
        "measured_flop_counter": measured,
        "measured_recompute_ratio_vanilla_over_colam": v / c,
        "eq16_over_eq18_for_20m": recompute_flops("vanilla-gcp", seq, d20.d)
        / recompute_flops("cola-m", seq, d20.d, r=d20.rank),
        "eq16_over_eq18_for_1b_n256": recompute_flops("vanilla-gcp", 256, 2048)
        / recompute_flops("cola-m", 256, 2048, r=512),
    }


@torch.no_grad()
def part_infer(batch: int, seq: int, reps: int) -> dict:
    x = torch.randint(0, 257, (batch, seq), generator=torch.Generator().manual_seed(0))
    models = {n: build_model(n).eval() for n in ("llama-20m", "cola-20m")}
    # llama, cola, llama, cola, ...: one forward of each per round
    timing = interleaved({n: (lambda m=m: m(x)) for n, m in models.items()}, rounds=reps)
    out = {}
    for n, m in models.items():
        t = timing.median_s(n)
        out[n] = {
            "tokens_per_s": batch * seq / t,
            "forward_s_median": t,
            "weight_bytes_fp32": sum(p.numel() * 4 for p in m.parameters()),
        }
    paper = {}
    for n in ("llama-1b", "cola-1b", "llama-7b", "cola-7b"):
        paper[n] = {"weight_bytes_bf16": count_params(n) * 2}
    ratio = timing.ratio("cola-20m", "llama-20m")
    return {"batch": batch, "seq": seq, "reps": reps, "ours": out,
            "cola_over_llama_forward_time": ratio.median,
            "cola_over_llama_forward_time_spread": ratio.to_dict(),
            "timing_load_avg": [timing.load_before, timing.load_after],
            "paper_sizes_weights": paper}  # fmt: skip


def part_quality(threads: int) -> dict:
    from slimact.train import TrainConfig, read_metrics, train

    out = {}
    for name in ("llama-20m", "cola-20m", "llama-20m-control"):
        run = RUNS / name
        cfg = TrainConfig(model=name, out=str(run), resume=True, threads=threads, progress=False,
                          ckpt_every=0, **QUALITY)  # fmt: skip
        t0 = time.perf_counter()
        res = train(cfg)
        hist = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        evals = {r["step"]: r["eval_loss"] for r in hist if "eval_loss" in r}
        tps = [r["tokens_per_s"] for r in hist if "tokens_per_s" in r]
        out[name] = {
            "params": res.params,
            "final_val_loss": res.final_val_loss,
            "final_val_ppl": res.final_val_ppl,
            "final_train_loss": res.final_train_loss,
            "eval_loss_by_step": evals,
            # separate runs one after the other, not interleaved: not a speed comparison
            "median_tokens_per_s_logged": statistics.median(tps) if tps else None,
            "train_flops_per_token": training_flops(name, seq=QUALITY["seq"])["methods"][
                "cola" if name.startswith("cola") else "full-rank"
            ]["flops_per_token"],
            "wall_s_this_call": time.perf_counter() - t0,
        }
    base = out["llama-20m"]["train_flops_per_token"]
    for v in out.values():
        v["flops_vs_llama_20m"] = v["train_flops_per_token"] / base
    _plot_quality(out)
    return {"config": QUALITY, "runs": out}


def _plot_quality(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, v in out.items():
        steps = sorted(int(s) for s in v["eval_loss_by_step"])
        ax.plot(steps, [v["eval_loss_by_step"][s] for s in steps], marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("500 steps, same tokens / seed / hyper-parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "cola_quality.png", dpi=120)
    plt.close(fig)


def part_rank(batches: int, batch: int, seq: int) -> dict:
    from slimact.data import fixed_batches, load_data
    from slimact.train.rank import activation_ranks, load_trained, plot_spectra, ranks_to_json

    val = load_data(None).val
    xs = [x for x, _ in fixed_batches(val, batch, seq, batches)]
    out = {}
    for name in ("llama-20m", "cola-20m", "llama-20m@init"):
        base = name.split("@")[0]
        if name.endswith("@init"):  # the same architecture before training, for contrast
            torch.manual_seed(0)
            model, what = build_model(base), "at initialisation (seed 0)"
        else:
            run = RUNS / name
            if not run.exists():
                out[name] = {"error": f"no run at {run}; run the quality part first"}
                continue
            model, what = load_trained(name, run), "after 500 steps"
        rows, spectra = activation_ranks(model, xs, 0.95)
        png = RESULTS / f"cola_rank_{name.replace('@', '_')}.png"
        plot_spectra(rows, spectra, png, title=f"{base} {what}, r(0.95)")
        out[name] = {
            "plot": str(png.relative_to(ROOT) if png.is_relative_to(ROOT) else png),
            "layers": ranks_to_json(rows),
        }
    return {"alpha": 0.95, "tokens": sum(x.numel() for x in xs), "models": out}


def main() -> None:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="speed,flops,infer,quality,rank")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2, help="timed steps per config per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (speed)")
    p.add_argument("--infer-batch", type=int, default=32)
    p.add_argument("--infer-seq", type=int, default=64)
    p.add_argument("--infer-reps", type=int, default=5, help="interleaved rounds (infer)")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="where cola.* go")
    args = p.parse_args()
    RESULTS = args.results_dir
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "cola.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        if part == "speed":
            res = part_speed(args.batch, args.seq, args.steps, args.rounds)
        elif part == "flops":
            res = part_flops(256)
        elif part == "infer":
            res = part_infer(args.infer_batch, args.infer_seq, args.infer_reps)
        elif part == "quality":
            res = part_quality(args.threads)
        elif part == "rank":
            res = part_rank(4, 8, 256)
        else:
            raise SystemExit(f"unknown part {part!r}")
        res["machine"] = machine(args.threads)
        res["wall_s"] = time.perf_counter() - t0
        results[part] = res
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"{part}: done in {res['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
