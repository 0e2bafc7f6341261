"""CoLA and CoLA-M (cola.txt): low-rank auto-encoder layers ``B σ(A x)`` in place of every
attention/MLP projection, the memory-efficient CoLA-M forward/backward, FLOPs and activation-memory
calculators (Tables 2-4, App. B-C) and the effective-rank analysis of Eq. 1 / Fig. 2.

    from slimact.cola import CoLALinear, convert
    model = slimact.build_model("cola-20m")          # or convert(build_model("llama-20m"))
    slimact.apply(model, "cola-m")                    # save only rank-r activations

``colam``, ``flops`` and ``rank`` are imported on first use (they are not needed to build models).
"""

from __future__ import annotations

import importlib

from slimact.cola.layers import ACTIVATIONS, CoLALinear, cola_linear, cola_linears
from slimact.cola.model import (
    CoLAConfig,
    CoLAGPT2Config,
    CoLAGPT2Model,
    CoLALlamaModel,
    cola_config,
    convert,
    default_both_sigma,
    is_cola_model,
)

_LAZY = {
    "lowrank_up": "colam",
    "lowrank_up_ref": "colam",
    "colam_block": "colam",
    "training_flops": "flops",
    "layer_flops": "flops",
    "activation_memory": "flops",
    "recompute_flops": "flops",
    "count_flops": "flops",
    "effective_rank": "rank",
    "activation_ranks": "rank",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACTIVATIONS",
    "CoLAConfig",
    "CoLAGPT2Config",
    "CoLAGPT2Model",
    "CoLALinear",
    "CoLALlamaModel",
    "cola_config",
    "cola_linear",
    "cola_linears",
    "convert",
    "default_both_sigma",
    "is_cola_model",
    *_LAZY,
]
