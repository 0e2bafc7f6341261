"""PRAC's scaling factor k (prac.txt App. D.3, Fig. 7): k0 = (n − r1)/r2 against 0.2, 0.5, 1.2·k0.

    PYTHONPATH=src python benchmarks/bench_prac_kscale.py                     # llama-20m, 8 x 256
    PYTHONPATH=src python benchmarks/bench_prac_kscale.py --model llama-tiny --batch 2 --seq 32 \
        --draws 8 --results-dir /tmp/kscale                                    # smoke

The paper trains LLaMA-130M with k ∈ {k0, 0.5k0, 0.2k0, 1.2k0} on linear and norm layers and finds
k0 converges best. A CPU cannot repeat those runs; this measures what the claim rests on, on real
activations: the saved input X of a linear layer (``mlp.down_proj``, PRAC's linear ranks
r1 = r2 = ⌊0.3n⌋) and of a norm (``post_attention_layernorm``, nonlinear ranks ⌊0.2n⌋) of a model
fed corpus text. For each k, ``--draws`` independent random subspaces Q2 (fresh seeds; Q1 the same
exact top-r1 SVD basis) give reconstructions X̃ = ZPᵀ (the codec ``PracCodec`` itself, with
``PracCodecConfig.k_scale``), and for the linear layer the weight gradient G̃ = dYᵀX̃ with a
fixed random dY:

* bias = ‖mean(X̃) − X‖ / ‖X‖ (→ 0 with more draws only if the estimator is unbiased);
* rel. MSE = mean ‖X̃ − X‖² / ‖X‖² (one draw's error; smaller k shrinks the random part's variance
  at the price of bias);
* grad bias = ‖mean(G̃) − G‖ / ‖G‖ and mean cosine(G̃, G).

Writes benchmarks/results/prac_kscale.{json,md} with machine, versions, load and command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import slimact
from slimact.codecs.prac import PracCodecConfig
from slimact.codecs.prac_ref import resolve_rank
from slimact.data import load_data
from slimact.data.loader import fixed_batches
from slimact.envinfo import machine_info
from slimact.timing import load_average

RESULTS = Path(__file__).parent / "results"
SCALES = (1.0, 0.5, 0.2, 1.2)
SITES = {  # site (block 1) -> (role, PRAC's default rank fraction)
    "layers.1.mlp.down_proj": ("linear", 0.3),
    "layers.1.post_attention_layernorm": ("norm", 0.2),
}


def capture(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inputs of the SITES modules on one forward (T × n, fp32)."""
    got: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    handles = [
        mods[p].register_forward_pre_hook(
            lambda m, a, p=p: got.__setitem__(p, a[0].detach().reshape(-1, a[0].shape[-1]))
        )
        for p in SITES
    ]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return got


def study(x: torch.Tensor, frac: float, scale: float, draws: int, dy: torch.Tensor | None):
    n = x.shape[1]
    r = resolve_rank(frac, n)
    recon, grads = [], []
    for d in range(draws):
        cfg = PracCodecConfig(r1=r, r2=r, svd="exact", seed=d, k_scale=scale)
        codec = cfg.build()
        xt = codec.decode(codec.encode(x)).float()  # (T × n)
        recon.append(xt)
        if dy is not None:
            grads.append(dy.T @ xt)  # (out × n)
    xs = torch.stack(recon)
    row = {
        "n": n,
        "r1": r,
        "r2": r,
        "k": scale * (n - r) / r,
        "bias": float((xs.mean(0) - x).norm() / x.norm()),
        "rel_mse": float(((xs - x) ** 2).sum((1, 2)).mean() / (x**2).sum()),
    }
    if dy is not None:
        g = dy.T @ x
        gs = torch.stack(grads)
        row["grad_bias"] = float((gs.mean(0) - g).norm() / g.norm())
        row["grad_cos"] = float(
            torch.stack([F.cosine_similarity(gi.flatten(), g.flatten(), dim=0) for gi in gs]).mean()
        )
    return row


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = slimact.build_model(args.model).eval()
    tokens = load_data().val
    ids = torch.as_tensor(fixed_batches(tokens, args.batch, args.seq, 1)[0][0]).long()
    acts = capture(model, ids)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for site, (role, frac) in SITES.items():
        x = acts[site]
        out = dict(model.named_modules())[site]
        dy = None
        if role == "linear":
            dy = torch.randn(x.shape[0], out.out_features, generator=gen)
        for scale in SCALES:
            r = study(x, frac, scale, args.draws, dy)
            rows.append({"site": site, "role": role, "k_scale": scale, **r})
            print(json.dumps(rows[-1]), flush=True)
    info = machine_info() | {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    return {
        "env": info | {"load_avg": load_average(), "command": " ".join(sys.argv)},
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "draws": args.draws,
        "rows": rows,
    }


def report(d: dict) -> str:
    e = d["env"]
    lines = [
        "## The scaling factor k (prac.txt App. D.3)",
        "",
        f"Model {d['model']} (initial weights), corpus batch {d['batch']} x {d['seq']}, "
        f"{d['draws']} draws of Q2 per k (Q1: exact SVD); torch {e['torch']}, "
        f"{e['processor']}, commit {e['git_commit']}, {e['date']}, load {e['load_avg']}.",
        f"Command: `{e['command']}`.",
        "",
        "| site | role | n | r1 = r2 | k / k0 | k | bias ‖E X̃ − X‖/‖X‖ | rel. MSE | "
        "grad bias | mean grad cos |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in d["rows"]:
        gb = f"{r['grad_bias']:.4f}" if "grad_bias" in r else ""
        gc = f"{r['grad_cos']:.4f}" if "grad_cos" in r else ""
        lines.append(
            f"| {r['site']} | {r['role']} | {r['n']} | {r['r1']} | {r['k_scale']} | "
            f"{r['k']:.3f} | {r['bias']:.4f} | {r['rel_mse']:.4f} | {gb} | {gc} |"
        )
    lines += [
        "",
        "Paper (Fig. 7, LLaMA-130M pre-training loss): k = k0 converges best on linear and norm "
        "layers; 0.2k0, 0.5k0 and 1.2k0 are worse.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--draws", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    data = run(args)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "prac_kscale.json").write_text(json.dumps(data, indent=2))
    (args.results_dir / "prac_kscale.md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
