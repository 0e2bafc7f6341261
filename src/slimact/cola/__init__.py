"""CoLA and CoLA-M (cola.txt): low-rank auto-encoder layers ``B σ(A x)`` in place of every
attention/MLP projection, the memory-efficient CoLA-M forward/backward, FLOPs and activation-memory
calculators (Tables 2-4, App. B-C) and the effective-rank analysis of Eq. 1 / Fig. 2.

    from slimact.cola import CoLALinear, convert
    model = slimact.build_model("cola-20m")          # or convert(build_model("llama-20m"))
    slimact.apply(model, "cola-m")                    # save only rank-r activations

Importing this package registers the CoLA model family (``family.py``) in ``slimact.models``'
registry (``import slimact`` does). CoLA-M lives in ``slimact.cola.colam`` (layer 5, with the
strategies; importing this package stays in layer 2); the effective-rank analysis, which reads
trained checkpoints, in ``slimact.train.rank``; see ARCHITECTURE.md.
"""

from __future__ import annotations

from slimact.cola.family import COLA_SIZES
from slimact.cola.flops import (
    activation_memory,
    count_flops,
    layer_flops,
    recompute_flops,
    training_flops,
)
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

__all__ = [
    "ACTIVATIONS",
    "COLA_SIZES",
    "CoLAConfig",
    "CoLAGPT2Config",
    "CoLAGPT2Model",
    "CoLALinear",
    "CoLALlamaModel",
    "activation_memory",
    "cola_config",
    "cola_linear",
    "cola_linears",
    "convert",
    "count_flops",
    "default_both_sigma",
    "is_cola_model",
    "layer_flops",
    "recompute_flops",
    "training_flops",
]
