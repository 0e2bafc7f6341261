"""Foundation table: llama-20m with `none` and `recompute` on this machine.

Saved bytes per token per layer (meter), step-time ratio vs the baseline (``slimact.compare``:
baseline and strategy timed in interleaved rounds in one process, the median of per-round ratios
with its min-max spread), and a short training run per strategy (tokens/s, losses). The training
runs go one after the other, so their tokens/s are not a speed comparison: the step-time ratio is.
Writes benchmarks/results/foundation.{json,md} (``--out-dir`` elsewhere).

    python benchmarks/bench_foundation.py --steps 60 --threads 2
    python benchmarks/bench_foundation.py --model llama-tiny --steps 2 --batch 1 --seq 16 \
        --rounds 2 --out-dir /tmp/foundation   # smoke
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from slimact.compare import CompareConfig, compare
from slimact.envinfo import machine_info
from slimact.timing import load_average
from slimact.train import TrainConfig, train

OUT = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-20m")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--rounds", type=int, default=5, help="interleaved timing rounds of baseline vs strategy"
    )
    ap.add_argument("--out-dir", type=Path, default=OUT, help="where foundation.{json,md} go")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for strategy in ("none", "recompute"):
        mem = compare(
            CompareConfig(
                model=args.model,
                strategy=strategy,
                batch=args.batch,
                seq=args.seq,
                steps=args.rounds,
            )
        )
        with tempfile.TemporaryDirectory() as tmp:
            res = train(
                TrainConfig(
                    model=args.model,
                    strategy=strategy,
                    steps=args.steps,
                    batch=args.batch,
                    seq=args.seq,
                    eval_every=0,
                    ckpt_every=0,
                    out=tmp,
                    progress=False,
                    threads=args.threads,
                )
            )
        rows.append(
            {
                "strategy": strategy,
                "saved_bytes": mem["saved_bytes"],
                "ratio": mem["ratio"],
                "bytes_per_token_per_layer": mem["bytes_per_token_per_block"],
                "step_time_ratio": mem["step_time_ratio"],
                "step_time_ratio_spread": mem["step_time_ratio_spread"],
                "timing_load_avg": [mem["timing"]["load_before"], mem["timing"]["load_after"]],
                "grad_cosine": mem["grad_cosine"],
                # a separate run per strategy, one after the other: not interleaved
                "train_tokens_per_s": res.tokens_per_s,
                "final_train_loss": res.final_train_loss,
                "final_val_loss": res.final_val_loss,
            }
        )
    result = {
        "env": machine_info() | {"load_avg": load_average()},
        "config": vars(args) | {"out_dir": str(args.out_dir)},
        "rows": rows,
    }
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "foundation.json").write_text(json.dumps(result, indent=2))
    d = 512
    lines = [
        f"Model `{args.model}`, batch {args.batch} x seq {args.seq}, fp32, "
        f"{args.threads} threads, {args.steps} training steps per strategy. Step-time ratio: "
        f"strategy / baseline, median of {args.rounds} interleaved rounds (min-max). Train "
        "tokens/s: separate runs one after the other (not interleaved), not a speed comparison.",
        "",
        "| strategy | saved bytes | ratio | bytes/token/layer | (elements / d) | step-time ratio "
        "| grad_cosine | train tokens/s | train loss | val loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        bpt = r["bytes_per_token_per_layer"]
        sp = r["step_time_ratio_spread"]
        st = f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f})"
        lines.append(
            f"| `{r['strategy']}` | {r['saved_bytes']:,} | {r['ratio']:.3f} | {bpt:,.0f} | "
            f"{bpt / 4 / d:.2f} | {st} | {r['grad_cosine']:.6f} | "
            f"{r['train_tokens_per_s']:,.0f} | {r['final_train_loss']:.3f} | "
            f"{r['final_val_loss']:.3f} |"
        )
    (out / "foundation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
