"""LLaMA-style decoder: RMSNorm, RoPE, SwiGLU MLP, causal attention through SDPA.

Module names follow Hugging Face's ``LlamaForCausalLM`` (``layers.i.self_attn.q_proj``,
``layers.i.mlp.gate_proj`` ...) so plans and site names read the same on both.
Sizes come from cola.txt Table 5 / prac.txt Table 7 (see ``slimact.models.registry``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from slimact.models.common import (
    CausalLMOutput,
    CheckedLM,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    causal_lm_loss,
    check_input_ids,
    init_weights,
)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    d_ff: int = 1376
    max_seq_len: int = 1024
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim {self.d_model // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # (B, S, D) -> (B, H, S, Dh)
        q = self.q_proj(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, d))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(CheckedLM):
    """Decoder-only LM. ``forward(input_ids, targets=None) -> CausalLMOutput``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(init_weights)
        for block in self.layers:  # scale residual-branch outputs by 1/sqrt(2L)
            for lin in (block.self_attn.o_proj, block.mlp.down_proj):
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        c = self.config  # token id ranges: by CheckedLM.__call__ (in a graph: here)
        check_input_ids(
            input_ids, c.max_seq_len, c.vocab_size, targets, values=torch.compiler.is_compiling()
        )
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(input_ids.shape[1], x.dtype)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return CausalLMOutput(logits=logits, loss=causal_lm_loss(logits, targets))
