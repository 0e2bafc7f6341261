"""The CoLA model family: our LLaMA (and GPT-2) decoders with every projection a ``CoLALinear``.

cola.txt §3.2 / Fig. 4: q/k/v/o of attention and gate/up/down of the MLP (c_attn/c_proj/c_fc/
c_proj for GPT-2) become ``B σ(A x)``; embeddings, norms, RoPE, SDPA, the residual stream, the
SwiGLU product and the LM head stay as they are. Module paths are unchanged
(``layers.0.self_attn.q_proj`` is now a ``CoLALinear`` with children ``cola_a``/``act``/``cola_b``).

"Both σ" (App. E.1, Table 10): keeping the original MLP nonlinearity (SwiGLU's SiLU on the gate,
GPT-2's GELU) on top of the low-rank σ helps at 60M/130M and not from 350M on; the paper's
default is both σ for <= 130M and only the low-rank σ above. ``default_both_sigma(d_model)``
encodes that by width: d <= 768 (60M: 512, 130M: 768) keeps both, d >= 1024 (350M+) drops it.

``convert(model_or_config, rank=...)`` builds the CoLA version of one of our LLaMA/GPT-2 configs, a
Hugging Face ``LlamaConfig`` (offline, from the config alone), or a model instance. For an
instance, the projections whose shapes match a LLaMA/GPT-2 block are replaced by freshly
initialised CoLA layers (a low-rank auto-encoder cannot represent W, so weights are not carried
over); everything else keeps its weights and is listed in ``model.cola_left_alone`` (path,
reason), with a warning for any linear inside a block that was not converted.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from slimact.cola.layers import ACTIVATIONS, CoLALinear, check_rank
from slimact.models.gpt2 import GPT2Config, GPT2Model
from slimact.models.llama import LlamaConfig, LlamaModel
from slimact.registry import applied


def default_both_sigma(d_model: int) -> bool:
    """cola.txt App. E.1: both σ for the 60M/130M widths (d <= 768), low-rank σ only above."""
    return d_model <= 768


def _check_cola_fields(cfg: Any, attn_out: int) -> None:
    d, ff = cfg.d_model, cfg.d_ff
    check_rank(cfg.rank, d, d, "CoLA config")
    check_rank(cfg.attn_rank_, d, min(d, attn_out), "CoLA config (attn_rank)")
    check_rank(cfg.mlp_rank_, d, ff, "CoLA config (mlp_rank)")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(
            f"unknown CoLA activation {cfg.activation!r}; valid: {', '.join(ACTIVATIONS)}"
        )


@dataclass(frozen=True)
class CoLAConfig(LlamaConfig):
    """A ``LlamaConfig`` plus the CoLA knobs: rank r (attention and MLP may differ), σ, both σ."""

    rank: int = 128
    attn_rank: int | None = None
    mlp_rank: int | None = None
    activation: str = "silu"
    both_sigma: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_cola_fields(self, self.d_model)

    @property
    def attn_rank_(self) -> int:
        return self.attn_rank if self.attn_rank is not None else self.rank

    @property
    def mlp_rank_(self) -> int:
        return self.mlp_rank if self.mlp_rank is not None else self.rank


@dataclass(frozen=True)
class CoLAGPT2Config(GPT2Config):
    """A ``GPT2Config`` plus the CoLA knobs (tanh-GELU inside the bottleneck by default)."""

    rank: int = 192
    attn_rank: int | None = None
    mlp_rank: int | None = None
    activation: str = "gelu_tanh"
    both_sigma: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_cola_fields(self, 3 * self.d_model)

    attn_rank_ = CoLAConfig.attn_rank_
    mlp_rank_ = CoLAConfig.mlp_rank_


# (block child path, in-dim, out-dim, rank kind, residual output?) per family
def _llama_targets(cfg: Any) -> list[tuple[str, int, int, str, bool]]:
    d, ff = cfg.d_model, cfg.d_ff
    return [
        ("self_attn.q_proj", d, d, "attn", False),
        ("self_attn.k_proj", d, d, "attn", False),
        ("self_attn.v_proj", d, d, "attn", False),
        ("self_attn.o_proj", d, d, "attn", True),
        ("mlp.gate_proj", d, ff, "mlp", False),
        ("mlp.up_proj", d, ff, "mlp", False),
        ("mlp.down_proj", ff, d, "mlp", True),
    ]


def _gpt2_targets(cfg: Any) -> list[tuple[str, int, int, str, bool]]:
    d, ff = cfg.d_model, cfg.d_ff
    return [
        ("attn.c_attn", d, 3 * d, "attn", False),
        ("attn.c_proj", d, d, "attn", True),
        ("mlp.c_fc", d, ff, "mlp", False),
        ("mlp.c_proj", ff, d, "mlp", True),
    ]


def _set_child(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def colafy(model: nn.Module, cfg: CoLAConfig | CoLAGPT2Config) -> list[tuple[str, str]]:
    """Replace, in place, every matching projection of every block with a fresh ``CoLALinear``.

    Returns the ``(path, reason)`` of every ``nn.Linear`` left alone.
    """
    gpt2 = isinstance(cfg, CoLAGPT2Config)
    blocks_attr = "h" if gpt2 else "layers"
    targets = _gpt2_targets(cfg) if gpt2 else _llama_targets(cfg)
    std = 0.02
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    blocks = getattr(model, blocks_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            f"convert: expected the model's blocks in a ModuleList named {blocks_attr!r} "
            f"(a {'GPT-2' if gpt2 else 'LLaMA'} decoder), found {type(blocks).__name__}"
        )
    converted: set[str] = set()
    for i, block in enumerate(blocks):
        for child, d_in, d_out, kind, resid in targets:
            path = f"{blocks_attr}.{i}.{child}"
            try:
                old = block.get_submodule(child)
            except AttributeError:
                continue
            if (
                not isinstance(old, nn.Linear)
                or old.in_features != d_in
                or old.out_features != d_out
            ):
                continue  # reported below with its actual shape
            rank = cfg.attn_rank_ if kind == "attn" else cfg.mlp_rank_
            new = CoLALinear(
                d_in,
                d_out,
                rank,
                cfg.activation,
                bias=old.bias is not None,
                target_std=resid_std if resid else std,
                device=old.weight.device,
                dtype=old.weight.dtype,
            )
            _set_child(block, child, new)
            converted.add(path)
        if not cfg.both_sigma:
            mlp = block.get_submodule("mlp")
            act_name = "act" if gpt2 else "act_fn"
            setattr(mlp, act_name, nn.Identity())
    left: list[tuple[str, str]] = []
    block_prefixes = tuple(f"{blocks_attr}.{i}." for i in range(len(blocks)))
    for path, m in model.named_modules():
        if type(m) is not nn.Linear or path in converted or ".cola_" in path:
            continue
        if path.startswith(block_prefixes):
            left.append(
                (
                    path,
                    f"Linear({m.in_features}->{m.out_features}) matches no projection of a "
                    f"{'GPT-2' if gpt2 else 'LLaMA'} block with d_model={cfg.d_model}, "
                    f"d_ff={cfg.d_ff}",
                )
            )
        else:
            left.append((path, "outside the decoder blocks (CoLA keeps it full-rank)"))
    return left


class CoLALlamaModel(LlamaModel):
    """``LlamaModel`` with every q/k/v/o/gate/up/down a ``CoLALinear`` (cola.txt Fig. 4)."""

    def __init__(self, cfg: CoLAConfig) -> None:
        if not isinstance(cfg, CoLAConfig):
            raise TypeError(f"CoLALlamaModel needs a CoLAConfig, got {type(cfg).__name__}")
        super().__init__(cfg)
        self.cola_left_alone = colafy(self, cfg)


class CoLAGPT2Model(GPT2Model):
    """``GPT2Model`` with c_attn/c_proj/c_fc/c_proj as ``CoLALinear`` (GELU bottleneck)."""

    def __init__(self, cfg: CoLAGPT2Config) -> None:
        if not isinstance(cfg, CoLAGPT2Config):
            raise TypeError(f"CoLAGPT2Model needs a CoLAGPT2Config, got {type(cfg).__name__}")
        super().__init__(cfg)
        self.cola_left_alone = colafy(self, cfg)


def _from_hf_llama(hf: Any) -> LlamaConfig:
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    if kv != heads:
        raise ValueError(
            f"convert: Hugging Face config has num_key_value_heads={kv} != num_attention_heads="
            f"{heads} (grouped-query attention); slimact's LLaMA block supports only kv == heads"
        )
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError("convert: attention_bias/mlp_bias=True is not supported by our LLaMA")
    rope = getattr(hf, "rope_theta", None)
    if rope is None:
        rope = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return LlamaConfig(
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=heads,
        d_ff=hf.intermediate_size,
        max_seq_len=hf.max_position_embeddings,
        norm_eps=hf.rms_norm_eps,
        rope_base=float(rope),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def cola_config(
    base: Any,
    rank: int | None = None,
    *,
    attn_rank: int | None = None,
    mlp_rank: int | None = None,
    activation: str | None = None,
    both_sigma: bool | None = None,
) -> CoLAConfig | CoLAGPT2Config:
    """The CoLA config of a LLaMA/GPT-2 config (ours or HF ``LlamaConfig``); r defaults to d/4."""
    if type(base).__name__ == "LlamaConfig" and hasattr(base, "hidden_size"):
        base = _from_hf_llama(base)
    if isinstance(base, (CoLAConfig, CoLAGPT2Config)):
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        cls = type(base)
    elif isinstance(base, LlamaConfig):
        fields, cls = dataclasses.asdict(base), CoLAConfig
    elif isinstance(base, GPT2Config):
        fields, cls = dataclasses.asdict(base), CoLAGPT2Config
    else:
        raise TypeError(
            "convert: expected a slimact LlamaConfig/GPT2Config, a Hugging Face LlamaConfig or a "
            f"model built from one, got {type(base).__name__}"
        )
    gpt2 = cls is CoLAGPT2Config
    if rank is not None:
        fields["rank"] = rank
    elif not isinstance(base, (CoLAConfig, CoLAGPT2Config)):
        fields["rank"] = max(1, base.d_model // 4)  # cola.txt App. D: r = d/4
    if attn_rank is not None:
        fields["attn_rank"] = attn_rank
    if mlp_rank is not None:
        fields["mlp_rank"] = mlp_rank
    if activation is not None:
        fields["activation"] = activation
    elif not isinstance(base, (CoLAConfig, CoLAGPT2Config)):
        fields["activation"] = "gelu_tanh" if gpt2 else "silu"
    if both_sigma is not None:
        fields["both_sigma"] = both_sigma
    elif not isinstance(base, (CoLAConfig, CoLAGPT2Config)):
        fields["both_sigma"] = default_both_sigma(base.d_model)
    return cls(**fields)


def convert(
    model_or_config: Any,
    rank: int | None = None,
    *,
    attn_rank: int | None = None,
    mlp_rank: int | None = None,
    activation: str | None = None,
    both_sigma: bool | None = None,
) -> nn.Module:
    """The CoLA version of a LLaMA/GPT-2 model or config (see the module docstring)."""
    kw = dict(attn_rank=attn_rank, mlp_rank=mlp_rank, activation=activation, both_sigma=both_sigma)
    if isinstance(model_or_config, nn.Module):
        src = model_or_config
        base = getattr(src, "config", None)
        if base is None:
            raise TypeError(
                f"convert: {type(src).__name__} has no .config; pass a slimact LLaMA/GPT-2 model "
                "or a config"
            )
        if applied(src):
            raise ValueError(
                "convert: the model has slimact strategies applied; slimact.revert(model) first"
            )
        cfg = cola_config(base, rank, **kw)
        new = copy.deepcopy(src)
        new.config = cfg
        left = colafy(new, cfg)
        new.cola_left_alone = left
        odd = [f"{p} ({why})" for p, why in left if "matches no projection" in why]
        if odd:
            warnings.warn("convert left these modules full-rank: " + "; ".join(odd), stacklevel=2)
        return new
    cfg = cola_config(model_or_config, rank, **kw)
    return CoLAGPT2Model(cfg) if isinstance(cfg, CoLAGPT2Config) else CoLALlamaModel(cfg)


def is_cola_model(model: nn.Module) -> bool:
    return any(isinstance(m, CoLALinear) for m in model.modules())
