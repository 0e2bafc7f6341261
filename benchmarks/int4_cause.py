"""Which saved tensors cost ``int4`` its gradients once a model is trained (BENCHMARKS.md §3).

    PYTHONPATH=src python benchmarks/int4_cause.py                        # trains none first
    PYTHONPATH=src python benchmarks/int4_cause.py --checkpoint RUN/ckpt-100

At fixed weights (llama-20m after ``--steps`` AdamW steps of ``none``, ``slimact train``'s
defaults, or a checkpoint's), ``--batches`` batches of 8 x 256 tokens: the exact gradient, then
the gradient with one group of each block's saved tensors stored as ``int4`` stores it (the rest
exact), or every group but one. Groups: the norms' saves (``pow``/``mul`` of both RMSNorms), the
attention's input (q/k/v projections' shared input), SDPA's q, k and v (separately: ``int4``
stores them INT8 per channel), the MLP's input, the MLP's inner saves. Reported per variant: the
minimum over parameters of the per-batch gradient cosine averaged over the batches, the mean over
the q/k projections and over the norm weights, the median. The root stays exact throughout.

Writes ``benchmarks/results/int4_cause.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import slimact
from slimact.bench.document import write_summary
from slimact.data import load_data
from slimact.data.loader import fixed_batches
from slimact.envinfo import machine_info
from slimact.models import build_model
from slimact.planner.plan import LayerPlan, Plan
from slimact.timing import load_average
from slimact.train import TrainConfig, train

RESULTS = Path(__file__).parent / "results"
ACT = "int4-outlier-g16"  # the int4 strategy's act codec
QKV = "int8-channel"  # what int4 stored SDPA's q, k and v as
SDPA = "self_attn:scaled_dot_product_attention"
GROUPS = {
    "norm": (ACT, ("input_layernorm:pow#0", "input_layernorm:mul#2")),
    "norm2": (ACT, ("post_attention_layernorm:pow#0", "post_attention_layernorm:mul#2")),
    "attn_in": (ACT, ("self_attn.q_proj:linear#0",)),
    "sdpa_q": (QKV, (f"{SDPA}#0",)),
    "sdpa_k": (QKV, (f"{SDPA}#1",)),
    "sdpa_v": (QKV, (f"{SDPA}#2",)),
    "mlp_in": (ACT, ("mlp.gate_proj:linear#0",)),
    "mlp": (ACT, ("mlp.act_fn:silu#0", "mlp:mul#0", "mlp:mul#1", "mlp.down_proj:linear#0")),
}


def plan_of(groups: list[str], n_layers: int) -> Plan:
    by_codec: dict[str, list[str]] = {}
    for g in groups:
        codec, sites = GROUPS[g]
        by_codec.setdefault(codec, []).extend(sites)
    codecs = tuple((c, tuple(s)) for c, s in by_codec.items())
    layers = tuple(
        LayerPlan(block=f"layers.{i}", kind="LlamaBlock", codecs=codecs) for i in range(n_layers)
    )
    return Plan("llama-20m", 8, 256, "float32", budget="100%", budget_bytes=2**40, layers=layers)


def trained(args) -> torch.nn.Module:
    model = build_model("llama-20m")
    if args.checkpoint:
        model.load_state_dict(load_file(str(Path(args.checkpoint) / "model.safetensors")))
        return model
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(
            model="llama-20m", strategy="none", steps=args.steps, out=out, progress=False,
            baseline="off", eval_every=0, ckpt_every=args.steps,
        )  # fmt: skip
        train(cfg)
        ckpt = sorted(Path(out).glob("ckpt-*"))[-1]
        model.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    return model


def cosines(model, plan, xs, ref) -> dict[str, float]:
    m = slimact.apply(copy.deepcopy(model), plan) if plan is not None else copy.deepcopy(model)
    cos: dict[str, list[float]] = {}
    for x, r in zip(xs, ref):
        m.zero_grad(set_to_none=True)
        m(x[:, :-1], targets=x[:, 1:]).loss.backward()
        for n, p in m.named_parameters():
            c = F.cosine_similarity(p.grad.flatten(), r[n].flatten(), dim=0)
            cos.setdefault(n, []).append(float(c))
    return {n: sum(v) / len(v) for n, v in cos.items()}


def summary(cos: dict[str, float]) -> dict:
    worst = min(cos, key=cos.get)
    qk = [c for n, c in cos.items() if "q_proj" in n or "k_proj" in n]
    norms = [c for n, c in cos.items() if "layernorm" in n]
    ordered = sorted(cos.values())
    return {
        "min_cos": cos[worst],
        "worst": worst,
        "qk_proj_mean": sum(qk) / len(qk),
        "norms_mean": sum(norms) / len(norms),
        "median": ordered[len(ordered) // 2],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="a run's checkpoint dir (else: train none first)")
    ap.add_argument("--steps", type=int, default=100, help="steps of none to train first")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.manual_seed(0)
    load_before = load_average()
    model = trained(args)
    xs = [
        torch.cat([x, y[:, -1:]], 1)
        for x, y in fixed_batches(load_data(None).train, 8, 256, args.batches)
    ]
    ref = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        model(x[:, :-1], targets=x[:, 1:]).loss.backward()
        ref.append({n: p.grad.clone() for n, p in model.named_parameters()})
    n_layers = len(model.layers)
    every = list(GROUPS)
    variants = {"every group (int4 as it was)": every}
    variants |= {f"every group but {g}": [h for h in every if h != g] for g in every}
    variants |= {f"only {g}": [g] for g in every}
    variants["int4 as it is now (q, k exact)"] = [g for g in every if g not in ("sdpa_q", "sdpa_k")]
    rows = {}
    for name, groups in variants.items():
        rows[name] = summary(cosines(model, plan_of(groups, n_layers), xs, ref))
        print(f"{name:34s} {rows[name]}", flush=True)
    meta = {
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/int4_cause.py " + " ".join(sys.argv[1:]),
        "load_average": [load_before, load_average()],
        "weights": args.checkpoint or f"llama-20m after {args.steps} steps of none",
        "batches": args.batches,
    }
    m = meta["machine"]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "int4_cause.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    head = [
        "# Which saved tensors cost int4 its gradients once trained",
        "",
        f"Weights: {meta['weights']}; {args.batches} batches of 8 x 256 tokens of the stdlib "
        f"corpus; {m['machine']}, {m['cpu_count']} cores, torch {m['torch']}, "
        f"{m['torch_threads']} threads, commit {m['git_commit']}; {meta['date']}; load "
        f"average {load_before} before, "
        f"{meta['load_average'][1]} after. Command: `{meta['command']}`.",
        "",
        "Cosine of each parameter's gradient with the exact one, averaged over the batches. "
        "Groups of each block's saves stored as int4 stored them (act: int4-outlier-g16; SDPA's "
        "q, k, v: int8-channel), the rest exact; the root exact.",
        "",
        "| variant | min cos (parameter) | q/k proj mean | norms mean | median |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        head.append(
            f"| {name} | {r['min_cos']:.4f} ({r['worst']}) | {r['qk_proj_mean']:.4f} "
            f"| {r['norms_mean']:.4f} | {r['median']:.4f} |"
        )
    write_summary(args.results_dir / "int4_cause.md", "\n".join(head))


if __name__ == "__main__":
    main()
