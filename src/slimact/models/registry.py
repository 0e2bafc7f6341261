"""Model registry: a name maps to a config; ``build_model`` turns it into a module.

LLaMA sizes follow cola.txt Table 5 / prac.txt Table 7 (GaLore's configs: the 1B model has 24
layers of 32 heads; prac.txt's table swaps the two). Paper sizes use the papers' vocabulary of
32000 and untied embeddings so parameter counts match Table 5; ``llama-tiny``/``llama-20m`` and
``gpt2-tiny`` use slimact's byte tokenizer (257 ids). ``build_model(..., vocab_size=...)``
overrides the vocabulary for training on our corpus.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from slimact.models.gpt2 import GPT2Config, GPT2Model
from slimact.models.llama import LlamaConfig, LlamaModel

BYTE_VOCAB = 257


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: Any
    builder: Callable[[Any], nn.Module]
    description: str = ""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(
    name: str, config: Any, builder: Callable[[Any], nn.Module], description: str = ""
) -> None:
    """Add a named model. Later modules (e.g. CoLA) register their families here."""
    old = _REGISTRY.get(name)
    if old is not None and _qualname(old.builder) != _qualname(builder):
        raise ValueError(f"model {name!r} is already registered")  # same builder: a re-import
    _REGISTRY[name] = ModelSpec(name, config, builder, description)


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def model_names() -> list[str]:
    return list(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def build_model(
    name: str,
    *,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build a registered model. ``device="meta"`` builds without allocating (for counting)."""
    spec = get_spec(name)
    changes = dict(overrides)
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    if max_seq_len is not None:
        changes["max_seq_len"] = max_seq_len
    cfg = dataclasses.replace(spec.config, **changes) if changes else spec.config
    with torch.device(device or "cpu"):
        model = spec.builder(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model


def count_params(model_or_name: nn.Module | str) -> int:
    """Unique parameters (tied weights once). Names are built on the meta device."""
    model = (
        build_model(model_or_name, device="meta")
        if isinstance(model_or_name, str)
        else model_or_name
    )
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _llama(
    name: str, d: int, layers: int, heads: int, ff: int, vocab: int, seq: int, note: str
) -> None:
    cfg = LlamaConfig(
        vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, d_ff=ff, max_seq_len=seq
    )
    register_model(name, cfg, LlamaModel, note)


def _gpt2(name: str, d: int, layers: int, heads: int, vocab: int, seq: int, note: str) -> None:
    cfg = GPT2Config(
        vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, d_ff=4 * d, max_seq_len=seq
    )
    register_model(name, cfg, GPT2Model, note)


_llama("llama-tiny", 64, 2, 4, 172, BYTE_VOCAB, 256, "tests; builds in well under 1 s")
_llama("llama-20m", 512, 6, 8, 1376, BYTE_VOCAB, 1024, "CPU default; llama-60m's width, 6 layers")
_llama("llama-60m", 512, 8, 8, 1376, 32000, 1024, "cola.txt Table 5 (58M)")
_llama("llama-130m", 768, 12, 12, 2048, 32000, 1024, "cola.txt Table 5 (134M)")
_llama("llama-350m", 1024, 24, 16, 2736, 32000, 1024, "cola.txt Table 5 (368M)")
_llama("llama-1b", 2048, 24, 32, 5461, 32000, 1024, "cola.txt Table 5 (1339M)")
_llama("llama-7b", 4096, 32, 32, 11008, 32000, 2048, "cola.txt Table 6 / App. D")
_gpt2("gpt2-tiny", 64, 2, 4, BYTE_VOCAB, 256, "tests")
_gpt2("gpt2-124m", 768, 12, 12, 50257, 1024, "GPT-2 small, prac.txt Table 7")
_gpt2("gpt2-355m", 1024, 24, 16, 50257, 1024, "GPT-2 medium, prac.txt Table 7")
