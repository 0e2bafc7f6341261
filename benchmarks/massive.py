"""Massive activations: gradient fidelity and saved bytes of the INT strategies (issue 43.1).

llama-tiny (fp32, CPU) with massive activations made three ways, one batch of 2 x 64 whose first
token is token 0:

* ``token``: token 0's embedding carries two channels at ``ratio`` x the median weight (a BOS
  token's massive activations, as trained LLMs have);
* ``channel``: two embedding channels scaled by ``ratio`` for every token (outlier features);
* ``up_proj``: one row of ``layers.0.mlp.up_proj`` scaled by ``ratio`` (issue 43's repro: a
  massive component in every token of the residual stream).

For each strategy: the worst per-parameter gradient cosine against float64 autograd (the
anchor: plain fp32 autograd, also printed), and the saved bytes against the same model's
baseline (``slimact.measure_step``). Run: ``python benchmarks/massive.py [--compile]``.
"""

from __future__ import annotations

import argparse
import platform
import warnings

import torch
import torch.nn.functional as F

import slimact
from slimact.models.common import RMSNorm

CASES = [("token", 1e3), ("channel", 1e3), ("up_proj", 3e4), ("up_proj", 3e5)]


def build(kind: str, ratio: float, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = slimact.build_model("llama-tiny")
    with torch.no_grad():
        w = m.embed_tokens.weight
        med = w.abs().median()
        if kind == "token":
            w[0, 5], w[0, 17] = ratio * med, -ratio * med / 2
        elif kind == "channel":
            w[:, 5] *= ratio
            w[:, 40] *= -ratio / 3
        else:
            m.layers[0].mlp.up_proj.weight[3] *= ratio
    m = m.to(dtype)
    if dtype == torch.float64:  # RMSNorm's statistics in float64 too
        for mod in m.modules():
            if isinstance(mod, RMSNorm):
                mod.forward = lambda x, mod=mod: (
                    mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps))
                )
    return m


def batch() -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 0
    return ids


def grads(model) -> dict[str, torch.Tensor]:
    ids = batch()
    model(ids, targets=ids).loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def worst_cosine(got: dict, truth: dict) -> float:
    return min(
        float(F.cosine_similarity(g.flatten(), truth[n].flatten(), 0, eps=0))
        for n, g in got.items()
        if float(truth[n].norm()) > 0
    )


def saved_bytes(model) -> int:
    return slimact.measure_step(model, batch()).total_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", default="int8,int4")
    ap.add_argument("--compile", action="store_true", help="also compile=True (no bytes)")
    args = ap.parse_args()
    strategies = args.strategies.split(",")
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads")
    head = "| case | fp32 autograd |" + "".join(f" {s} cos | {s} bytes |" for s in strategies)
    if args.compile:
        head += "".join(f" {s} compile=True cos |" for s in strategies)
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    warnings.simplefilter("ignore")
    for kind, ratio in CASES:
        truth = grads(build(kind, ratio, torch.float64))
        base = saved_bytes(build(kind, ratio))
        row = f"| {kind} x{ratio:g} | {worst_cosine(grads(build(kind, ratio)), truth):.4f} |"
        for s in strategies:
            cos = worst_cosine(grads(slimact.apply(build(kind, ratio), s)), truth)
            row += f" {cos:.4f} | {saved_bytes(slimact.apply(build(kind, ratio), s)) / base:.3f}x |"
        if args.compile:
            for s in strategies:
                m = slimact.apply(build(kind, ratio), s, compile=True)
                row += f" {worst_cosine(grads(m), truth):.4f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
