"""Step peak of compile=True's one graph against the per-block path (and eager), on CPU.

Each point: llama-tiny, batch 4 x seq 128, fp32, inductor; two warm steps, then one
forward+backward measured by ``slimact.peak.step_peak`` (the profiler's memory events: live bytes
above what was live at the step's start). Specs are ``<spec>`` (eager), ``<spec>:c``
(``compile=True``) or a per-block ``compiled-*`` spec. Run:
``python benchmarks/graph_peak.py eager none:c compiled-none recompute+graph compiled-recompute``.
"""

from __future__ import annotations

import sys
import warnings

import torch

import slimact
from slimact.peak import step_peak


def peak(spec: str | None, compile: bool) -> int:
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    model = slimact.build_model("llama-tiny")
    if spec is not None:
        model = slimact.apply(model, spec, compile=compile)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, targets=ids).loss.backward()

    step()
    step()
    return step_peak(step)


def main() -> None:
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}; llama-tiny 4 x 128 fp32; peak bytes above the step's start")
    for arg in sys.argv[1:]:
        spec, compile = arg.removesuffix(":c"), arg.endswith(":c")
        print(f"| {arg} | {peak(None if spec == 'eager' else spec, compile):,} |", flush=True)


if __name__ == "__main__":
    main()
