"""The CPU path without torch.compile (issue 16, build item 4): eager refs against compiled refs.

    PYTHONPATH=src python benchmarks/bench_cpu_path.py                   # llama-20m, 8 x 256
    PYTHONPATH=src python benchmarks/bench_cpu_path.py --model llama-tiny --batch 1 --seq 16 \
        --rounds 2 --results-dir /tmp/cpu_path                            # smoke

Where Triton cannot run, slimact's ops run their plain-PyTorch ``*_ref`` functions compiled by
inductor (``slimact.ops.compiled_ref``): the inverted activations, INT4/INT8 quantize and
dequantize, and the codecs' range and outlier statistics. This measures what that buys, in one
process, fp32, one thread: for each strategy the same model is stepped with the compiled refs
and inside ``compiled_ref.eager_refs()`` (the same refs, eagerly), every point once per round
(``slimact.timing.interleaved``, alternating order), against eager ``none``; then INT4
quantize/dequantize of one tensor per group size, the same two ways. Gradients are the
same either way (the tests check the paths bit for bit or to an ulp). Writes
``benchmarks/results/cpu_path.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from pathlib import Path

import torch

import slimact
from slimact.bench.document import write_summary
from slimact.envinfo import machine_info
from slimact.models import build_model
from slimact.ops import compiled_ref, quant
from slimact.timing import interleaved, load_average
from slimact.utils import seed_everything

RESULTS = Path(__file__).parent / "results"


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    seed_everything(0)
    base = build_model(args.model)
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(0, base.config.vocab_size, (args.batch, args.seq + 1), generator=gen)
    x, y = t[:, :-1], t[:, 1:]

    def step(model, eager: bool):
        def go():
            model.zero_grad(set_to_none=True)
            if eager:
                with compiled_ref.eager_refs():
                    model(x, targets=y).loss.backward()
            else:
                model(x, targets=y).loss.backward()

        return go

    points = {"none": step(base, False)}
    for name in args.strategies:
        model = slimact.apply(copy.deepcopy(base), name)
        points[f"{name} (eager refs)"] = step(model, True)
        points[f"{name} (compiled refs)"] = step(model, False)
    for fn in points.values():  # compile, then a step that is not timed either
        fn()
    timing = interleaved(points, args.rounds, alternate=True)
    rows = {
        k: {"step_s": timing.median_s(k)}
        | ({} if k == "none" else timing.ratio(k, "none").to_dict())
        for k in points
    }
    cross = {
        name: timing.ratio(f"{name} (compiled refs)", f"{name} (eager refs)").to_dict()
        for name in args.strategies
    }
    return {
        "kernels": kernels(args.kernel_shape, args.group_sizes, rounds=15),
        "env": machine_info() | {"torch": torch.__version__, "threads": args.threads},
        "command": "benchmarks/bench_cpu_path.py " + " ".join(args.argv),
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "load": [timing.load_before, timing.load_after, load_average()],
        "rows": rows,
        "compiled_vs_eager": cross,
    }


def kernels(shape: tuple[int, int], group_sizes: list[int], rounds: int) -> dict:
    """Milliseconds of INT4 ``quantize`` / ``dequantize`` (``slimact.ops.quant``, packing
    included) of one fp32 tensor per group size, refs compiled and eager, interleaved."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    points = {}
    for gs in group_sizes:
        q = quant.quantize(x, bits=4, group_size=gs)
        for path, ctx in (("compiled", contextlib.nullcontext), ("eager", compiled_ref.eager_refs)):

            def enc(gs=gs, ctx=ctx):
                with ctx():
                    quant.quantize(x, bits=4, group_size=gs)

            def dec(q=q, ctx=ctx):
                with ctx():
                    quant.dequantize(q)

            points[f"quantize g{gs} {path}"], points[f"dequantize g{gs} {path}"] = enc, dec
    for fn in points.values():
        fn()
    timing = interleaved(points, rounds, alternate=True)
    return {"shape": list(shape), "ms": {k: timing.median_s(k) * 1e3 for k in points}}


def report(d: dict) -> str:
    e = d["env"]
    lines = [
        "# The CPU path: slimact's refs compiled by inductor vs run eagerly (issue 16)",
        "",
        f"Model {d['model']}, batch {d['batch']} x seq {d['seq']}, float32, "
        f"{e['threads']} thread(s), {d['rounds']} interleaved rounds (alternating order); "
        f"torch {e['torch']}, {e['machine']} ({e['cpu_count']} cores). Load average "
        f"{d['load'][0]} before, {d['load'][1]} after.",
        f"Command: `{d['command']}`.",
        "",
        "| point | step ratio vs eager none (median [min-max]) | IQR |",
        "| --- | --- | --- |",
    ]
    for k, r in d["rows"].items():
        if k == "none":
            lines.append(f"| none | 1 (baseline, {r['step_s']:.2f} s) | |")
        else:
            lines.append(
                f"| {k} | {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] "
                f"| {r['q1']:.3f}-{r['q3']:.3f} |"
            )
    lines += ["", "| strategy | compiled refs / eager refs (median, IQR) |", "| --- | --- |"]
    for k, r in d["compiled_vs_eager"].items():
        lines.append(f"| {k} | {r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) |")
    kern = d["kernels"]
    lines += [
        "",
        f"INT4 `quantize` / `dequantize` of one {' x '.join(map(str, kern['shape']))} fp32 "
        "tensor, packing included (ms, median of 15 interleaved rounds):",
        "",
        "| group size | quantize compiled | quantize eager | dequantize compiled | "
        "dequantize eager |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for gs in sorted({int(k.split()[1][1:]) for k in kern["ms"]}):
        ms = [kern["ms"][f"{op} g{gs} {path}"] for op in ("quantize", "dequantize")
              for path in ("compiled", "eager")]  # fmt: skip
        lines.append(f"| {gs} | " + " | ".join(f"{v:.1f}" for v in ms) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--strategies", type=lambda s: s.split(","), default=["int4", "invact"])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument(
        "--kernel-shape", type=lambda s: tuple(map(int, s.split("x"))), default=(2048, 1376)
    )
    p.add_argument(
        "--group-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32, 128]
    )
    args = p.parse_args()
    args.argv = sys.argv[1:]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    data = run(args)
    (args.results_dir / "cpu_path.json").write_text(json.dumps(data, indent=2))
    md = args.results_dir / "cpu_path.md"
    write_summary(md, report(data))
    print(report(data))


if __name__ == "__main__":
    main()
