"""Inverted activations (invact.txt): accuracy, op timing, memory, training — one script.

    PYTHONPATH=src python benchmarks/bench_inv_act.py accuracy   # Fig. 2 / Fig. 5 tables + plots
    PYTHONPATH=src python benchmarks/bench_inv_act.py timing     # Table 1 blocks, CPU, 1 thread
    PYTHONPATH=src python benchmarks/bench_inv_act.py memory     # llama-20m, gpt2-124m, HF BERT
    PYTHONPATH=src python benchmarks/bench_inv_act.py training --runs DIR...  # metrics.jsonl diff
    PYTHONPATH=src python benchmarks/bench_inv_act.py step       # llama-20m step: issue 16.4
    PYTHONPATH=src python benchmarks/bench_inv_act.py bf16       # bf16 floor, modes: issue 18.7

Each part writes ``benchmarks/results/inv_act_<part>.json`` (machine, versions, command line,
load average; ``--results-dir`` elsewhere); ``accuracy`` also writes ``inv_act_error.png``.

Step-time ratios (``timing``, ``memory``) come from interleaved rounds in one process (every
compared point once per round, ``slimact.timing``): the median of per-round ratios, with its
spread in ``*_ratio_spread``. Smoke (``--results-dir`` goes before the part)::

    python benchmarks/bench_inv_act.py --results-dir /tmp/inv_act timing --smoke --reps 2
    python benchmarks/bench_inv_act.py --results-dir /tmp/inv_act memory --models llama-tiny \
        bert-base --batch 1 --seq 8 --steps 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn as nn

from slimact.envinfo import machine_info
from slimact.ops import inv_act_approx as ap
from slimact.ops.inv_act import act_ref, inv_act
from slimact.timing import interleaved, load_average

RESULTS = Path(__file__).resolve().parent / "results"


def _meta() -> dict:
    """Machine, versions, git commit, command and load average (shared by every benchmark)."""
    return machine_info() | {"load_avg": load_average()}


def _write(part: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"inv_act_{part}.json"
    path.write_text(json.dumps({"meta": _meta(), **data}, indent=2))
    print(f"wrote {path}")
    return path


# ----------------------------------------------------------------------------- accuracy
def _floor(y: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
    """f'(f⁻¹(y)) of the *rounded* y, solved in float64 to convergence: the conditioning floor."""
    return ap.dinv_newton_ref(y.double(), s, kind, iters=12)


def accuracy(args) -> dict:
    x64 = torch.linspace(-10, 10, 200001, dtype=torch.float64)
    rows, curves = [], {}
    for kind in ap.KINDS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = x64.to(dtype)
            true = ap.exact_df(x.double(), kind)  # f'(x) at the dtype's x, exactly
            y, s = act_ref(x, kind), x.double() < ap.BRANCH[kind].T
            floor = (_floor(y, s, kind) - true).abs()
            for mode, iters in [("paper", None), ("newton", 1), ("newton", 2), ("newton", 3)]:
                if mode == "paper":
                    g = ap.dinv_ref(y, s, kind, "paper").double()
                else:
                    g = ap.dinv_newton_ref(y, s, kind, iters=iters).double()
                e = (g - true).abs()
                name = mode if mode == "paper" else f"newton{iters}"
                rows.append(
                    {
                        "kind": kind,
                        "dtype": str(dtype).replace("torch.", ""),
                        "mode": name,
                        "linf": float(e.max()),
                        "linf_at_x": float(x64[e.argmax()]),
                        "l2_rms": float(e.pow(2).mean().sqrt()),
                        "floor_linf": float(floor.max()),
                        "floor_l2_rms": float(floor.pow(2).mean().sqrt()),
                    }
                )
                if dtype == torch.float32 and name in ("paper", "newton3"):
                    curves[(kind, name)] = e
    # §2.1 precision-bit variant: forward error
    lsb = []
    for kind in ap.KINDS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
            ref = act_ref(x, kind).double()
            got = inv_act(x.requires_grad_(True), kind, variant="lsb").detach().double()
            nz = ref.abs() > 0
            rel = ((got - ref).abs()[nz] / ref.abs()[nz]).max()
            lsb.append(
                {
                    "kind": kind,
                    "dtype": str(dtype).replace("torch.", ""),
                    "max_rel_fwd_err": float(rel),
                    "changed_frac": float((got != ref).double().mean()),
                }
            )
    _plot(x64, curves)
    for r in rows:
        print(
            f"{r['kind']:<10} {r['dtype']:<9} {r['mode']:<8} Linf {r['linf']:.3g} "
            f"(x={r['linf_at_x']:.3f})  L2 {r['l2_rms']:.3g}  floor Linf {r['floor_linf']:.3g}"
        )
    return _write("accuracy", {"grid": "x in [-10, 10], 200001 points", "rows": rows, "lsb": lsb})


def _plot(x, curves) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for ax, kind in zip(axes, ap.KINDS):
        for name, style in (("paper", "r-"), ("newton3", "b-")):
            ax.semilogy(
                x.numpy(), curves[(kind, name)].clamp_min(1e-12).numpy(), style, lw=0.6, label=name
            )
        ax.set_title(f"|f'(f⁻¹(y)) − f'(x)|, {kind}, fp32 y")
        ax.set_xlabel("x")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "inv_act_error.png", dpi=110)


# ----------------------------------------------------------------------------- timing
class _MLP(nn.Module):
    def __init__(self, d, h, act, glu=False):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d, h), nn.Linear(h, d), act
        self.gate = nn.Linear(d, h) if glu else None

    def forward(self, x):
        a = self.act(self.fc1(x))
        return self.fc2(a * self.gate(x) if self.gate is not None else a)


def timing(args) -> dict:
    torch.set_num_threads(args.threads)
    d, n = 256, 2048  # paper A.3: n = 2^15, d = 2^10 on an A100; scaled down for 1 CPU thread
    plain = 1 << 20
    if args.smoke:  # shapes only: proves the script runs, measures nothing
        d, n, plain = 32, 64, 1 << 12
    acts = {
        "torch": nn.GELU(),
        "invact-newton": lambda t: inv_act(t, "gelu", mode="newton"),
        "invact-paper": lambda t: inv_act(t, "gelu", mode="paper"),
        "invact-lsb": lambda t: inv_act(t, "gelu", variant="lsb"),
    }
    blocks = {
        "plain GELU (2^20)": lambda a: lambda t: a(t),
        "Linear + GELU": lambda a: nn.Sequential(nn.Linear(d, 4 * d), _Lam(a)),
        "MLP block": lambda a: _MLP(d, 4 * d, _Lam(a)),
        "GeGLU": lambda a: _MLP(d, 4 * d, _Lam(a), glu=True),
    }
    out = []
    for bname, make in blocks.items():
        x = torch.randn(plain if bname.startswith("plain") else (n, d), requires_grad=True)
        steps = {}
        for aname, a in acts.items():
            torch.manual_seed(0)
            mod = make(a)

            def step(mod=mod, x=x):
                mod(x).sum().backward()

            steps[aname] = step
        # one call of every activation per round (torch, newton, paper, lsb, torch, ...)
        t = interleaved(steps, rounds=args.reps, warmup=1)
        row = {"block": bname, **{k: t.median_s(k) * 1e3 for k in steps}}
        for k in steps:
            if k != "torch":
                r = t.ratio(k, "torch")
                row[f"{k}_ratio"] = r.median
                row[f"{k}_ratio_spread"] = r.to_dict()
        row["load_avg"] = [t.load_before, t.load_after]
        out.append(row)
        print(row)
    return _write(
        "timing",
        {
            "unit": "ms per forward+backward (median of interleaved rounds)",
            "ratio": "median of per-round t(act) / t(torch) over --reps interleaved rounds",
            "rounds": args.reps,
            "d": d,
            "n": n,
            "rows": out,
        },
    )


class _Lam(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# ----------------------------------------------------------------------------- memory
def _bert_compare(strategy: str, batch: int, seq: int, steps: int) -> dict:
    import transformers

    import slimact
    from slimact.compare import grad_cosine

    cfg = transformers.BertConfig()  # bert-base: 12 x 768, 3072 GELU, random init

    def step_fn(model, ids):
        def step():
            torch.manual_seed(1)  # identical dropout masks
            model.zero_grad(set_to_none=True)
            model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()

        return step

    def measured(model, ids):
        """Saved bytes of one metered step; its gradients, kept for grad_cosine."""
        model.train()
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        with slimact.measure(model, n_tokens=ids.numel()) as m:
            out = model(input_ids=ids)
        out.last_hidden_state.float().pow(2).mean().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return m.report.total_bytes, grads

    def restore(model, grads):
        for k, p in model.named_parameters():
            p.grad = grads.get(k)

    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    base = transformers.BertModel(cfg)
    b_bytes, b_grads = measured(base, ids)
    torch.manual_seed(0)
    model = slimact.apply(transformers.BertModel(cfg), strategy)
    s_bytes, s_grads = measured(model, ids)
    # baseline, strategy, baseline, ... in one process: the ratio is the median of per-round ratios
    t = interleaved(
        {"baseline": step_fn(base, ids), "strategy": step_fn(model, ids)}, rounds=steps, warmup=1
    )
    restore(base, b_grads)
    restore(model, s_grads)
    ratio = t.ratio("strategy", "baseline")
    skipped = [(c.path, c.detail) for c in slimact.applied(model) if c.skipped]
    return {
        "model": "hf-bert-base (random init)",
        "strategy": strategy,
        "batch": batch,
        "seq": seq,
        "saved_bytes": s_bytes,
        "baseline_saved_bytes": b_bytes,
        "ratio": s_bytes / b_bytes,
        "grad_cosine": grad_cosine(base, model),
        "step_time_s": t.median_s("strategy"),
        "baseline_step_time_s": t.median_s("baseline"),
        "step_time_ratio": ratio.median,
        "step_time_ratio_spread": ratio.to_dict(),
        "timing": t.to_dict(),
        "skipped": skipped,
    }


def memory(args) -> dict:
    from slimact.compare import CompareConfig, compare

    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models:
        for strategy in ("invact", "invact-act"):
            if model == "bert-base":
                r = _bert_compare(strategy, args.batch, args.seq, args.steps)
            else:
                r = compare(
                    CompareConfig(
                        model=model,
                        strategy=strategy,
                        batch=args.batch,
                        seq=args.seq,
                        steps=args.steps,
                    )
                )
            print(
                json.dumps(
                    {
                        k: r[k]
                        for k in ("model", "strategy", "ratio", "grad_cosine", "step_time_ratio")
                    }
                    | {"spread": r["step_time_ratio_spread"]}
                )
            )
            rows.append(r)
    return _write("memory", {"rows": rows})


# ----------------------------------------------------------------------------- training
def training(args) -> dict:
    def load(d):
        rows = [json.loads(line) for line in Path(d, "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "loss" in r}

    runs = {Path(d).name: load(d) for d in args.runs}
    names = list(runs)
    ref = runs[names[0]]
    out = {"runs": names, "pairs": []}
    for other in names[1:]:
        common = sorted(set(ref) & set(runs[other]))
        diffs = [abs(ref[s]["loss"] - runs[other][s]["loss"]) for s in common]
        ev = [
            abs(ref[s]["eval_loss"] - runs[other][s]["eval_loss"])
            for s in common
            if ref[s].get("eval_loss") is not None and runs[other][s].get("eval_loss") is not None
        ]
        out["pairs"].append(
            {
                "a": names[0],
                "b": other,
                "steps": len(common),
                "max_abs_dloss": max(diffs),
                "final_dloss": diffs[-1],
                "max_abs_deval": max(ev) if ev else None,
            }
        )
        print(out["pairs"][-1])
    out["final_loss"] = {n: r[max(r)]["loss"] for n, r in runs.items()}
    return _write("training", out)


# ----------------------------------------------------------------------------- step (issue 16.4)
def _llama_step(strategy: str, batch: int, seq: int, dtype=torch.float32):
    import slimact

    torch.manual_seed(0)
    model = slimact.build_model("llama-20m").to(dtype)
    if strategy != "none":
        slimact.apply(model, strategy)
    ids = torch.randint(0, 257, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, targets=ids).loss.backward()

    return model, ids, step


def step(args) -> dict:
    """Whole-step time of llama-20m: none vs invact (compiled CPU path) vs invact@backend=torch
    (the eager refs: the path before issue 16.4), interleaved; plus a profile of each."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    names = ("none", "invact", "invact@backend=torch")
    steps = {n: _llama_step(n, args.batch, args.seq)[2] for n in names}
    t = interleaved(steps, rounds=args.rounds, warmup=1)  # warmup: the inductor compiles
    profiles = {}
    for name, fn in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ev)
        profiles[name] = {
            "total_ms": total / 1e3,
            "top_self_ms": {e.key: e.self_cpu_time_total / 1e3 for e in ev[:12]},
            "autograd_nodes_ms": {
                e.key: e.cpu_time_total / 1e3 for e in ev if e.key.endswith("Backward")
            },
        }
    out = {"model": "llama-20m", "batch": args.batch, "seq": args.seq, "dtype": "float32"}
    out |= {"threads": args.threads, "timing": t.to_dict("none"), "profiles": profiles}
    for n in names[1:]:
        print(
            n, "step-time ratio vs none:", t.ratio(n, "none"), "load", t.load_before, t.load_after
        )
    return _write("step", out)


# ----------------------------------------------------------------------------- bf16 (issue 18.7)
def _gate_inputs(batch: int, seq: int) -> torch.Tensor:
    """llama-20m's SiLU inputs (all layers, init weights, one batch of byte tokens)."""
    model, ids, _ = _llama_step("none", batch, seq)
    got = []
    for layer in model.layers:
        layer.mlp.act_fn.register_forward_hook(lambda m, a, o: got.append(a[0].detach().flatten()))
    with torch.no_grad():
        model(ids)
    return torch.cat(got)


def bf16(args) -> dict:
    """Derivative error vs the float64 truth by region, torch / 1-bit floor / near-branch, and
    the saved bytes of llama-20m in bf16 under none / invact / invact@bf16=exact-near-branch."""
    import slimact

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    dists = {
        "llama-20m SiLU inputs (init)": _gate_inputs(2, 128),
        "N(0, 1.5^2)": torch.randn(1 << 18, generator=gen) * 1.5,
    }
    rows = []
    for dist, x64 in dists.items():
        for dtype in (torch.bfloat16, torch.float16):
            for kind in ap.KINDS:
                x = x64.to(dtype)
                near = (x.double() - ap.BRANCH[kind].T).abs() < 0.3
                true = ap.exact_df(x.double(), kind)
                for name, kw in (("torch", None), ("floor", "bitmask"), ("near-branch", None)):
                    xr = x.detach().requires_grad_(True)
                    v = kw or name
                    y = act_ref(xr, kind) if name == "torch" else inv_act(xr, kind, variant=v)
                    (g,) = torch.autograd.grad(y, xr, torch.ones_like(y))
                    e = (g.double() - true).abs()
                    rows.append(
                        {
                            "dist": dist,
                            "dtype": str(dtype).replace("torch.", ""),
                            "kind": kind,
                            "mode": name,
                            "near_frac": float(near.double().mean()),
                            "linf": float(e.max()),
                            "linf_near": float(e[near].max()) if near.any() else 0.0,
                            "linf_away": float(e[~near].max()),
                            "rms": float(e.pow(2).mean().sqrt()),
                        }
                    )
                    print(rows[-1])
    mem = {}
    for strategy in ("none", "invact", "invact@bf16=exact-near-branch"):
        model, ids, _ = _llama_step(strategy, args.batch, args.seq, torch.bfloat16)
        with slimact.measure(model, n_tokens=ids.numel()) as m:
            loss = model(ids, targets=ids).loss
        loss.backward()
        mem[strategy] = m.report.total_bytes
        print(strategy, mem[strategy])
    out = {"near": "|x - T| < 0.3", "rows": rows, "memory_model": "llama-20m bf16"}
    return _write("bf16", out | {"batch": args.batch, "seq": args.seq, "saved_bytes": mem})


def main() -> None:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    sub.add_parser("accuracy")
    t = sub.add_parser("timing")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--reps", type=int, default=7, help="interleaved timing rounds")
    t.add_argument("--smoke", action="store_true", help="tiny shapes: check the script runs")
    m = sub.add_parser("memory")
    m.add_argument("--models", nargs="+", default=["llama-20m", "gpt2-124m", "bert-base"])
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--seq", type=int, default=128)
    m.add_argument("--steps", type=int, default=2, help="interleaved timing rounds")
    m.add_argument("--threads", type=int, default=1)
    st = sub.add_parser("step")
    st.add_argument("--batch", type=int, default=8)
    st.add_argument("--seq", type=int, default=256)
    st.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    st.add_argument("--threads", type=int, default=1)
    bf = sub.add_parser("bf16")
    bf.add_argument("--batch", type=int, default=4)
    bf.add_argument("--seq", type=int, default=128)
    bf.add_argument("--threads", type=int, default=1)
    tr = sub.add_parser("training")
    tr.add_argument("--runs", nargs="+", required=True, help="run dirs; the first is the reference")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="where the JSON files go")
    args = p.parse_args()
    RESULTS = args.results_dir
    parts = {"accuracy": accuracy, "timing": timing, "memory": memory, "training": training}
    parts[args.part](args) if args.part in parts else {"step": step, "bf16": bf16}[args.part](args)


if __name__ == "__main__":
    main()
