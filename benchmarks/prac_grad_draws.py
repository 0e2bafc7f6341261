"""Bias or variance: the cosine of the mean gradient over k draws, against the exact gradient.

    PYTHONPATH=src python benchmarks/prac_grad_draws.py                    # prac, k up to 64
    PYTHONPATH=src python benchmarks/prac_grad_draws.py --strategy pac --k 16

One model, one batch, fixed weights: the exact gradient once (strategy ``none``), then k
training forwards+backwards under the strategy (PRAC draws a new Q2 each one), and for
k = 1, 4, 16, 64 the cosine per parameter between the mean of the first k gradients and the
exact one (minimum and median over parameters; parameters whose exact gradient norm is below
1e-6 x the largest are skipped, as ``slimact memory``'s ``grad_cosine`` does). For an unbiased
codec 1 - cos shrinks about as 1/k; for a biased one it stops at the bias. BENCHMARKS.md §4
("Why a per-step gradient cosine is the wrong yardstick") quotes this script's output.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import slimact
from slimact.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--strategy", default="prac")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--k", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = build_model(args.model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), generator=gen)

    def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        m(ids, targets=ids).loss.backward()
        return {n: p.grad.detach().double() for n, p in m.named_parameters() if p.grad is not None}

    exact = grads(base)
    big = max(float(v.norm()) for v in exact.values())
    keys = [n for n, v in exact.items() if float(v.norm()) >= 1e-6 * big]
    model = slimact.apply(copy.deepcopy(base), args.strategy)
    acc = {n: torch.zeros_like(exact[n]) for n in keys}
    print(f"{args.model} {args.batch}x{args.seq}, strategy {args.strategy}")
    print("| k | min cos (parameter) | median cos | 1 - min cos |")
    print("| ---: | --- | ---: | ---: |")
    for k in range(1, args.k + 1):
        for n, g in grads(model).items():
            if n in acc:
                acc[n] += g
        if k in (1, 4, 16, 64, 256):
            cos = {
                n: float(F.cosine_similarity((acc[n] / k).flatten(), exact[n].flatten(), dim=0))
                for n in keys
            }
            worst = min(cos, key=cos.__getitem__)
            med = sorted(cos.values())[len(cos) // 2]
            print(f"| {k} | {cos[worst]:.4f} ({worst}) | {med:.4f} | {1 - cos[worst]:.2e} |")


if __name__ == "__main__":
    main()
