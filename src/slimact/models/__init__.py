"""Reference models (LLaMA- and GPT-2-style decoders) and their registry.

Other model families register themselves from their own module in this package (imported below),
or from their own package above this one (the CoLA family: ``slimact.cola.family``).
"""

import importlib
import pkgutil

from slimact.models.common import CausalLMOutput, RMSNorm
from slimact.models.gpt2 import GPT2Config, GPT2Model
from slimact.models.llama import LlamaConfig, LlamaModel
from slimact.models.registry import (
    BYTE_VOCAB,
    ModelSpec,
    build_model,
    count_params,
    get_spec,
    model_names,
    register_model,
)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in ("common", "gpt2", "llama", "registry"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = [
    "BYTE_VOCAB",
    "CausalLMOutput",
    "GPT2Config",
    "GPT2Model",
    "LlamaConfig",
    "LlamaModel",
    "ModelSpec",
    "RMSNorm",
    "build_model",
    "count_params",
    "get_spec",
    "model_names",
    "register_model",
]


def __getattr__(name: str):
    if name == "MODEL_NAMES":
        return model_names()
    raise AttributeError(name)
