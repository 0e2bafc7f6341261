"""Adacc layer-specific compression (issue 4): memory, gradients, speed, training, outliers.

    PYTHONPATH=src python benchmarks/bench_quant.py memory   # slimact memory on both models
    PYTHONPATH=src python benchmarks/bench_quant.py train    # 200-step runs vs none (+ outliers)
    PYTHONPATH=src python benchmarks/bench_quant.py kernels  # encode/decode GB/s vs copy
    PYTHONPATH=src python benchmarks/bench_quant.py plot     # quant_outliers.png from train JSON

Results go to benchmarks/results/quant_<part>.json (loss curves included; run directories with
checkpoints go to the gitignored runs/quant/); the reading is in quant.md. ``train`` runs
the ``int4`` run as ``int4-track``: the same policy, plus a recorder of the outlier-channel
count of every ``act`` payload per training forward (adacc.txt Fig. 4).

Speed comparisons are taken in interleaved rounds in one process (``slimact.timing``): ``memory``
through ``slimact.compare`` (baseline, strategy, baseline, ...: ``step_time_ratio`` is the median
of per-round ratios, ``step_time_ratio_spread`` its spread), ``kernels`` with copy, every encode
and every decode of one (size, dtype) once per round (``*_frac_of_copy`` from per-round ratios,
``*_frac_of_copy_spread``). ``train``'s tokens/s come from runs one after the other: not a speed
comparison. Every JSON records the load average; ``--results-dir`` writes elsewhere. Smoke::

    python benchmarks/bench_quant.py memory --models llama-tiny --strategies int4 --batch 1 \
        --seq 16 --rounds 2 --results-dir /tmp/quant
    python benchmarks/bench_quant.py kernels --sizes 4096 --results-dir /tmp/quant
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from slimact.timing import RatioStats, interleaved, load_average

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = Path(__file__).resolve().parent.parent / "runs" / "quant"
STRATEGIES = ("int4", "int4-plain", "int8", "int4-paper")


def _write(name: str, payload: dict) -> Path:
    from slimact.envinfo import machine_info

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"quant_{name}.json"
    meta = machine_info() | {"load_avg": load_average()}
    path.write_text(json.dumps({"machine": meta, **payload}, indent=2))
    print(f"wrote {path}")
    return path


def bench_memory(args) -> None:
    from slimact.compare import CompareConfig, compare

    rows = []
    for model, batch, seq in ((m, args.batch, args.seq) for m in args.models):
        for strategy in args.strategies:
            t0 = time.perf_counter()
            cfg = CompareConfig(model, strategy, batch=batch, seq=seq, seed=0, steps=args.rounds)
            r = compare(cfg)
            keys = ("ratio", "grad_cosine", "step_time_ratio", "step_time_ratio_spread")
            keys += ("saved_bytes",)
            keys += ("baseline_saved_bytes", "step_time_s", "baseline_step_time_s")
            row = {"model": model, "strategy": strategy, "batch": batch, "seq": seq}
            row.update({k: r[k] for k in keys})
            row["timing_load_avg"] = [r["timing"]["load_before"], r["timing"]["load_after"]]
            rows.append(row)
            print(json.dumps(row), f"({time.perf_counter() - t0:.0f}s)", flush=True)
    _write("memory", {"threads": torch.get_num_threads(), "rows": rows})


def _register_tracking() -> dict:
    """Register ``int4-track``: the ``int4`` policy plus a per-forward outlier recorder."""
    from slimact.codecs.saving import CodecPolicy, install_policy
    from slimact.strategies import register_strategy, strategy_names
    from slimact.strategies.int4 import Int4Assign, Int4Config

    log: dict = {"steps": []}

    class Tracking(CodecPolicy):
        def reset(self) -> None:
            super().reset()
            if torch.is_grad_enabled():
                log["steps"].append({})

        def __call__(self, site, t):
            stored = super().__call__(site, t)
            meta = getattr(getattr(stored, "packed", None), "meta", {})
            if "n_outliers" in meta and log["steps"]:  # pack hooks run with grad off
                log["steps"][-1][site] = (meta["n_outliers"], meta["channels"])
            return stored

    def transform(model, config, filter_fn=None):
        change = install_policy(model, Tracking(Int4Assign(config, None)))
        change.action = "int4-track"
        return [change]

    @dataclass(frozen=True)
    class TrackConfig(Int4Config):
        """The ``int4`` defaults, under a type of its own so the registry finds ``transform``."""

    if "int4-track" not in strategy_names():
        register_strategy("int4-track", TrackConfig(), transform, "int4 + outlier recorder")
    return log


def bench_train(args) -> None:
    from slimact.train import TrainConfig, train

    log = _register_tracking()
    runs = {}
    for model in args.models:
        for strategy in ("none", *args.strategies):
            name = "int4-track" if strategy == "int4" else strategy
            out = RUNS / f"{model}_{strategy}"  # checkpoints: gitignored runs/, not results/
            cfg = TrainConfig(
                model=model, strategy=name, steps=args.steps, batch=args.batch, seq=args.seq,
                seed=0, out=str(out), threads=args.threads, progress=False,
                eval_every=args.steps // 4, eval_batches=4,
            )  # fmt: skip
            shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resumed one
            t0 = time.perf_counter()
            res = train(cfg)
            runs[f"{model}/{strategy}"] = {
                "final_train_loss": res.final_train_loss,
                "final_val_loss": res.final_val_loss,
                # runs go one after the other (not interleaved): not a speed comparison
                "tokens_per_s": res.tokens_per_s,
                "saved_bytes": res.saved_bytes,
                "wall_s": time.perf_counter() - t0,
                "loss_curve": [h.get("loss") for h in res.history if "loss" in h],
                "eval": [(h["step"], h["eval_loss"]) for h in res.history if "eval_loss" in h],
            }
            print(model, strategy, {k: v for k, v in runs[f"{model}/{strategy}"].items()
                                    if k not in ("loss_curve", "eval")}, flush=True)  # fmt: skip
            if strategy == "int4":
                runs[f"{model}/{strategy}"]["outliers"] = list(log["steps"])
            log["steps"].clear()
        base = runs[f"{model}/none"]
        for strategy in args.strategies:
            r = runs[f"{model}/{strategy}"]
            for k in ("final_train_loss", "final_val_loss"):
                if r[k] is not None and base[k]:
                    r[f"{k}_diff_pct"] = 100.0 * (r[k] - base[k]) / base[k]
        note = "tokens_per_s: separate runs one after the other, not interleaved; not a speed ratio"
        args_rec = vars(args) | {"func": None, "results_dir": str(args.results_dir)}
        _write(f"train_{model}", {"args": args_rec, "tokens_per_s_note": note, "runs": runs})


def bench_kernels(args) -> None:
    from slimact.ops import quant as Q

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "triton" if dev == "cuda" else "ref"
    rows = []
    # one timed call runs a kernel ``inner`` times (on CUDA a single small launch is mostly
    # launch and sync overhead); ``rounds`` interleaved rounds of copy, every encode, every decode
    inner, rounds = (10, 5) if dev == "cuda" else (1, 3)

    def repeat(fn):
        def many():
            for _ in range(inner):
                fn()

        return many

    def scaled(r: RatioStats, c: float) -> dict:  # a per-round ratio times a constant (c > 0)
        return {"median": r.median * c, "min": r.min * c, "max": r.max * c, "q1": r.q1 * c,
                "q3": r.q3 * c, "n": r.n}  # fmt: skip

    for n in args.sizes:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n, device=dev, dtype=dtype)
            points = {"copy": repeat(x.clone)}
            moved = {}
            for bits, sym in ((4, True), (4, False), (8, True)):
                q = Q.quantize(x, bits=bits, group_size=args.group_size, symmetric=sym,
                               backend=backend)  # fmt: skip
                qbytes = sum(t.numel() * t.element_size() for t in q.tensors())
                moved[bits, sym] = x.numel() * x.element_size() + qbytes
                enc = functools.partial(Q.quantize, x, bits=bits, group_size=args.group_size,
                                        symmetric=sym, backend=backend)  # fmt: skip
                points[f"enc{bits}{sym}"] = repeat(enc)
                points[f"dec{bits}{sym}"] = repeat(
                    functools.partial(Q.dequantize, q, dtype=dtype, backend=backend)
                )
            t = interleaved(points, rounds=rounds, warmup=1)
            copied = 2 * x.numel() * x.element_size()
            copy_bw = copied * inner / t.median_s("copy")
            for (bits, sym), mv in moved.items():
                # frac of copy = (mv / t_enc) / (copied / t_copy) = mv / copied * t_copy / t_enc
                enc_frac = t.ratio("copy", f"enc{bits}{sym}")
                dec_frac = t.ratio("copy", f"dec{bits}{sym}")
                rows.append({
                    "device": dev, "backend": backend, "n": n, "dtype": str(dtype), "bits": bits,
                    "symmetric": sym, "group_size": args.group_size,
                    "copy_GBps": copy_bw / 1e9,
                    "encode_GBps": mv * inner / t.median_s(f"enc{bits}{sym}") / 1e9,
                    "decode_GBps": mv * inner / t.median_s(f"dec{bits}{sym}") / 1e9,
                    "encode_frac_of_copy": enc_frac.median * mv / copied,
                    "encode_frac_of_copy_spread": scaled(enc_frac, mv / copied),
                    "decode_frac_of_copy": dec_frac.median * mv / copied,
                    "decode_frac_of_copy_spread": scaled(dec_frac, mv / copied),
                    "rounds": rounds, "calls_per_round": inner,
                    "timing_load_avg": [t.load_before, t.load_after],
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    _write(f"kernels_{dev}", {"rows": rows})


def bench_plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for model in args.models:
        path = args.results_dir / f"quant_train_{model}.json"
        if not path.exists():
            continue
        steps = json.loads(path.read_text())["runs"][f"{model}/int4"].get("outliers", [])
        total = [sum(n for n, _ in s.values()) for s in steps]
        ax.plot(range(1, len(total) + 1), total, label=f"{model}: all act tensors")
        for site in args.sites:
            ys = [s.get(site, (None,))[0] for s in steps]
            ax.plot(range(1, len(ys) + 1), ys, label=f"{model}: {site}")
    ax.set_xlabel("training step")
    ax.set_ylabel("outlier channels (Z-score > 3)")
    ax.set_title("Outlier channels during training (cf. adacc.txt Fig. 4)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = args.results_dir / "quant_outliers.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="part", required=True)
    for name, fn in (("memory", bench_memory), ("train", bench_train), ("kernels", bench_kernels),
                     ("plot", bench_plot)):  # fmt: skip
        s = sub.add_parser(name)
        s.set_defaults(func=fn)
        s.add_argument("--models", nargs="+", default=["llama-20m", "gpt2-124m"])
        s.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--batch", type=int, default=4)
        s.add_argument("--seq", type=int, default=256)
        s.add_argument("--steps", type=int, default=200)
        s.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (memory)")
        s.add_argument("--results-dir", type=Path, default=RESULTS)
        s.add_argument("--group-size", type=int, default=128)
        s.add_argument("--sizes", nargs="+", type=int, default=[1 << 20, 1 << 24])
        s.add_argument("--sites", nargs="+", default=["layers.2.mlp.down_proj:linear#0",
                                                      "layers.2.input_layernorm:pow#0"])  # fmt: skip
    args = p.parse_args(argv)
    RESULTS = args.results_dir
    torch.set_num_threads(args.threads)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
