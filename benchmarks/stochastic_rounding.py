"""What stochastic rounding (SR) costs and what it buys, in one process on the CPU.

    PYTHONPATH=src python benchmarks/stochastic_rounding.py            # ~2 min, one thread
    PYTHONPATH=src python benchmarks/stochastic_rounding.py --rounds 3 --k 4 --pretrain 5 \
        --step-rounds 0 \
        --results-dir /tmp/sr                                           # smoke

Cost: the encode time of one 2048 x 1376 fp32 tensor (llama-20m's MLP input at 8 x 256 tokens),
round-to-nearest against stochastic, on the CPU path (``backend="auto"``: the refs compiled by
inductor, ``slimact.ops.compiled_ref``), one thread, each pair timed in interleaved rounds
(``slimact.timing.interleaved``, alternating order; medians and the median per-round ratio):
the quantize op alone (INT4 in groups of 16, INT8 in groups of 128) and the ``int4`` strategy's
whole ``act`` codec (``int4-outlier-g16``: range statistics, outlier scores, quantize, pack);
then a training step's forward+backward, ``int4`` against ``int4@sr``, on llama-20m at 8 x 256
(``--step-rounds`` interleaved rounds; 0 skips it).

Benefit: bias, not one step's error. One llama-tiny, one batch of 8 x 128 tokens of the stdlib
corpus, fixed weights (at init, and after ``--pretrain`` AdamW steps of ``none`` on other
batches, 10 and 200 by default, as training moves the weights): the exact gradient, then ``k`` training
forwards+backwards under each strategy (each one draws afresh under SR), and for k = 1, 4, 16
the cosine between the mean of the first k gradients and the exact one, per parameter
(minimum, median; parameters whose exact gradient is below 1e-6 x the largest skipped) and
over all parameters at once. Round-to-nearest gives the same gradient every time, so its
cosine stays where it starts (its error is bias); an unbiased codec's 1 - cos shrinks about as
1/k (as PRAC's, BENCHMARKS.md §4). No training run: the loss over steps is the lead's study.

Writes ``benchmarks/results/stochastic_rounding.{json,md}`` (machine, versions, load, command;
the md keeps its hand-written reading), which BENCHMARKS.md §3 includes.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import slimact
from slimact.bench.document import write_summary
from slimact.codecs.base import get_codec
from slimact.data import load_data
from slimact.data.loader import fixed_batches
from slimact.envinfo import machine_info
from slimact.models import build_model
from slimact.ops import quant
from slimact.timing import interleaved, load_average

RESULTS = Path(__file__).parent / "results"
KS = (1, 4, 16, 64)


def cost(args) -> dict:
    """Encode times, nearest vs stochastic, interleaved (module docstring)."""
    x = torch.randn(2048, 1376, generator=torch.Generator().manual_seed(0))
    count = [0]

    def seed() -> int:
        count[0] += 1
        return count[0]

    def op(bits: int, group: int, rounding: str):
        return lambda: quant.quantize(
            x, bits=bits, group_size=group, rounding=rounding, seed=seed()
        )

    near, sr = get_codec("int4-outlier-g16"), get_codec("int4-outlier-g16/sr")
    pairs = {
        "quantize INT4 g16": (op(4, 16, "nearest"), op(4, 16, "stochastic")),
        "quantize INT8 g128": (op(8, 128, "nearest"), op(8, 128, "stochastic")),
        "codec int4-outlier-g16 encode": (lambda: near.encode(x), lambda: sr.encode(x)),
    }
    out = {}
    for name, (a, b) in pairs.items():
        t = interleaved({"nearest": a, "stochastic": b}, args.rounds, warmup=3, alternate=True)
        r = t.ratio("stochastic", "nearest")
        out[name] = {
            "nearest_ms": 1e3 * t.median_s("nearest"),
            "stochastic_ms": 1e3 * t.median_s("stochastic"),
            "ratio": r.to_dict(),
            "timing": t.to_dict(),
        }
        print(
            f"{name}: nearest {out[name]['nearest_ms']:.2f} ms, stochastic "
            f"{out[name]['stochastic_ms']:.2f} ms, ratio {r.median:.3f} "
            f"[{r.min:.3f}-{r.max:.3f}]",
            flush=True,
        )
    return out


def step_cost(args) -> dict:
    """Forward+backward of one training step, ``int4`` against ``int4@sr`` on the same model
    and batch, interleaved (module docstring)."""
    torch.manual_seed(0)
    base = build_model(args.step_model)
    x, y = fixed_batches(load_data().val, args.step_batch, args.step_seq, 1)[0]
    models = {s: slimact.apply(copy.deepcopy(base), s) for s in ("int4", "int4@sr")}

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(x, targets=y).loss.backward()

        return run

    t = interleaved({s: step(m) for s, m in models.items()}, args.step_rounds, warmup=2,
                    alternate=True)  # fmt: skip
    r = t.ratio("int4@sr", "int4")
    out = {
        "model": args.step_model,
        "tokens": f"{args.step_batch} x {args.step_seq}",
        "int4_s": t.median_s("int4"),
        "int4_sr_s": t.median_s("int4@sr"),
        "ratio": r.to_dict(),
        "timing": t.to_dict(),
    }
    print(
        f"step {args.step_model} {out['tokens']}: int4 {out['int4_s']:.3f} s, int4@sr "
        f"{out['int4_sr_s']:.3f} s, ratio {r.median:.3f} [{r.min:.3f}-{r.max:.3f}]",
        flush=True,
    )
    return out


def _grads(model, x, y) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x, targets=y).loss.backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


def _cosines(acc: dict, k: int, exact: dict, keys: list[str]) -> dict:
    cos = {
        n: float(F.cosine_similarity((acc[n] / k).flatten(), exact[n].flatten(), dim=0))
        for n in keys
    }
    worst = min(cos, key=cos.__getitem__)
    norms = [c for n, c in cos.items() if "norm" in n]
    flat_mean = torch.cat([(acc[n] / k).flatten() for n in keys])
    flat_exact = torch.cat([exact[n].flatten() for n in keys])
    return {
        "min_cos": cos[worst],
        "min_param": worst,
        "median_cos": sorted(cos.values())[len(cos) // 2],
        "all_params_cos": float(F.cosine_similarity(flat_mean, flat_exact, dim=0)),
        "norm_weights_min_cos": min(norms) if norms else None,
        "per_param": cos,
    }


def benefit(args) -> dict:
    """Cosine of the mean gradient over k draws against the exact one (module docstring)."""
    torch.manual_seed(0)
    base = build_model(args.model)
    splits = load_data()
    x, y = fixed_batches(splits.val, args.batch, args.seq, 1)[0]
    stops = sorted({0, *args.pretrain})
    train = fixed_batches(splits.train, args.batch, args.seq, max(1, stops[-1]))
    opt = torch.optim.AdamW(base.parameters(), lr=args.lr)
    out: dict = {}
    done = 0
    for steps in stops:  # the same run of none, measured at each stop
        for bx, by in train[done:steps]:
            base(bx, targets=by).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        done = steps
        state = f"after {steps} steps" if steps else "init"
        exact = _grads(base, x, y)
        base.zero_grad(set_to_none=True)  # the training above continues from clean gradients
        big = max(float(v.norm()) for v in exact.values())
        keys = [n for n, v in exact.items() if float(v.norm()) >= 1e-6 * big]
        out[state] = {"pretrain_steps": steps}
        for spec in args.strategies:
            model = slimact.apply(copy.deepcopy(base), spec)
            acc = {n: torch.zeros_like(exact[n]) for n in keys}
            rows = {}
            for k in range(1, args.k + 1):
                for n, g in _grads(model, x, y).items():
                    if n in acc:
                        acc[n] += g
                if k in KS:
                    rows[k] = _cosines(acc, k, exact, keys)
            out[state][spec] = rows
            last = rows[max(rows)]
            print(
                f"{state} {spec}: " + ", ".join(
                    f"k={k} min {r['min_cos']:.5f} all {r['all_params_cos']:.6f}"
                    for k, r in rows.items()
                ) + f" (worst at k={max(rows)}: {last['min_param']})",
                flush=True,
            )  # fmt: skip
    return out


def _load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def markdown(data: dict) -> str:
    e = data["env"]
    lines = [
        "# Stochastic rounding: what it costs, what it buys",
        "",
        f"Machine: {e['processor']}, {e['cpu_count']} cores, torch {e['torch']}, "
        f"{e['threads']} thread(s), commit {e['git_commit']}, {e['date']}; load average "
        f"{_load(e['load_before'])} before, {_load(e['load_after'])} after (a shared machine).",
        "",
        f"Command: `{e['command']}`.",
        "",
        "## Stochastic rounding, the cost: encode of one 2048 x 1376 fp32 tensor (CPU path, compiled refs)",
        "",
        f"Interleaved rounds ({data['args']['rounds']}, alternating order; the training step "
        f"{data['args']['step_rounds']}), medians; the ratio is the median of per-round "
        "stochastic / nearest, with its min-max spread.",
        "",
        "| encode | nearest (ms) | stochastic (ms) | ratio | spread |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, r in data["cost"].items():
        ratio = r["ratio"]
        lines.append(
            f"| {name} | {r['nearest_ms']:.2f} | {r['stochastic_ms']:.2f} | "
            f"{ratio['median']:.3f} | {ratio['min']:.3f}-{ratio['max']:.3f} |"
        )
    st = data.get("step")
    if st:
        ratio = st["ratio"]
        lines.append(
            f"| training step (forward+backward), {st['model']} {st['tokens']}, `int4` vs "
            f"`int4@sr` | {1e3 * st['int4_s']:.0f} | {1e3 * st['int4_sr_s']:.0f} | "
            f"{ratio['median']:.3f} | {ratio['min']:.3f}-{ratio['max']:.3f} |"
        )
    a = data["args"]
    lines += [
        "",
        f"## Stochastic rounding, the benefit: the mean gradient over k draws against the exact "
        f"one ({a['model']}, "
        f"{a['batch']} x {a['seq']} tokens)",
        "",
        "Cosine of the mean of the first k gradients with the exact gradient: the minimum over "
        "parameters (which one), the minimum over the norm weights, the median, and all "
        "parameters as one vector (per parameter in the json). Round-to-nearest "
        "repeats one gradient (its error is bias: k does not move it); stochastic rounding "
        "draws afresh each time.",
        "",
    ]
    for state, res in data["benefit"].items():
        lines += [
            f"### {state} ({res['pretrain_steps']} AdamW steps of none before)",
            "",
            "| strategy | k | min cos | worst parameter | min cos, norm weights | median cos | "
            "all params cos | 1 - min cos |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        for spec, rows in res.items():
            if spec == "pretrain_steps":
                continue
            for k, r in rows.items():
                nw = r["norm_weights_min_cos"]
                lines.append(
                    f"| {spec} | {k} | {r['min_cos']:.5f} | {r['min_param']} | "
                    f"{'n/a' if nw is None else f'{nw:.5f}'} | {r['median_cos']:.6f} | "
                    f"{r['all_params_cos']:.6f} | {1 - r['min_cos']:.2e} |"
                )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--k", type=int, default=16, help="gradient draws per strategy")
    ap.add_argument(
        "--pretrain", type=int, nargs="*", default=[10, 200],
        help="measure again after these many AdamW steps of none (init is always measured)",
    )  # fmt: skip
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--strategies", nargs="+", default=["int4", "int4@sr", "int8", "int8@sr"])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--step-model", default="llama-20m")
    ap.add_argument("--step-batch", type=int, default=8)
    ap.add_argument("--step-seq", type=int, default=256)
    ap.add_argument("--step-rounds", type=int, default=7, help="0: no training-step timing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = load_average()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    data = {"args": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()}}
    data["cost"] = {} if args.skip_cost else cost(args)
    data["step"] = step_cost(args) if args.step_rounds else None
    data["benefit"] = benefit(args)
    data["env"] = machine_info() | {
        "threads": args.threads,
        "date": started,
        "load_before": load_before,
        "load_after": load_average(),
        "command": " ".join(["python", *sys.argv]),
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "stochastic_rounding.json").write_text(json.dumps(data, indent=2))
    write_summary(args.results_dir / "stochastic_rounding.md", markdown(data))
    print(f"wrote {args.results_dir / 'stochastic_rounding.md'}")


if __name__ == "__main__":
    main()
