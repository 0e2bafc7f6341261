"""Building blocks shared by the reference models.

The blocks are written in plain PyTorch, one small module per op, so that every tensor autograd
saves for backward lands in a module whose path names it (a *site*, see ``slimact.sites``).
``RMSNorm`` follows the Hugging Face LLaMA formulation (fp32 statistics, ``x * rsqrt(mean(x²)+eps)
* w``); it saves its input, the per-row ``rstd`` and the normalized ``x̂`` (2nd + n elements).
Its ``rsqrt`` is ``slimact.ops.rms_norm.rsqrt``: the same forward and saves, with a backward that
does not underflow float32 when the residual stream is huge (autograd's ``-½·g·rstd³`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from slimact import sites
from slimact.ops.rms_norm import rsqrt


@dataclass
class CausalLMOutput:
    """What every slimact model returns: logits (B, S, V) and the mean next-token loss.

    ``logits`` is None when the ``chunked-ce`` strategy computed the loss without them (a
    forward with targets and grad enabled); call without targets or under no_grad for logits."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    """Mean cross-entropy of (B, S, V) logits against (B, S) targets; -100 is ignored. Targets
    may be int64 or int32 (``check_input_ids`` admits both; cross-entropy takes int64 only)."""
    if targets is None:
        return None
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten().long(), ignore_index=-100
    )


def check_input_ids(
    input_ids: object,
    max_seq_len: int,
    vocab_size: int,
    targets: object = None,
    values: bool = True,
) -> None:
    """Reject what would otherwise fail deep inside an embedding, a RoPE table or the loss (a raw
    ``IndexError``, a reshape of 0 elements) with one message naming the bad value and what is
    valid. Token ranges cost one host sync per forward; a compiled graph skips them."""
    _check_ids_tensor("input_ids", input_ids)
    assert isinstance(input_ids, torch.Tensor)
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}; "
            "add a batch dimension with input_ids[None]"
        )
    if input_ids.numel() == 0:
        raise ValueError(
            f"input_ids is empty, shape {tuple(input_ids.shape)}: need batch >= 1 and seq >= 1"
        )
    if input_ids.shape[1] > max_seq_len:
        raise ValueError(
            f"sequence length {input_ids.shape[1]} exceeds the model's max_seq_len {max_seq_len}"
        )
    if targets is not None:
        _check_ids_tensor("targets", targets)
        assert isinstance(targets, torch.Tensor)
        if targets.shape != input_ids.shape:
            raise ValueError(
                f"targets must have input_ids' shape {tuple(input_ids.shape)}, "
                f"got {tuple(targets.shape)}"
            )
    if not values or input_ids.device.type == "meta":
        return
    checks = [("input_ids", input_ids, (input_ids < 0) | (input_ids >= vocab_size), "")]
    if targets is not None:
        bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= vocab_size)
        checks.append(("targets", targets, bad, f", or {IGNORE_INDEX} (ignored by the loss)"))
    if torch.compiler.is_compiling():  # in a graph: an assert of its own, no host sync
        ok = torch.stack([bad.any() for _, _, bad, _ in checks]).any().logical_not()
        torch._assert_async(ok, f"token ids outside 0..{vocab_size - 1} (or {IGNORE_INDEX})")
        return
    if not bool(torch.stack([bad.any() for _, _, bad, _ in checks]).any()):  # the one sync
        return
    for name, t, bad, extra in checks:
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} holds token id {int(t[where])} at position {where}: valid token ids "
                f"are 0..{vocab_size - 1} (the model's vocab_size is {vocab_size}){extra}"
            )


IGNORE_INDEX = -100  # a target the loss skips


def _check_ids_tensor(name: str, ids: object) -> None:
    if not isinstance(ids, torch.Tensor):
        kind = f"{type(ids).__module__}.{type(ids).__qualname__}".removeprefix("builtins.")
        hint = " (convert with torch.from_numpy(a))" if type(ids).__module__ == "numpy" else ""
        raise TypeError(f"{name} must be a torch.Tensor of integer token ids, got a {kind}{hint}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{name} must hold integer token ids (torch.int64 or torch.int32), got dtype "
            f"{ids.dtype}; use {name}.long() for ids stored in another dtype"
        )


class CheckedLM(nn.Module):
    """Base of the reference LMs: ``model(input_ids, targets)`` checks its inputs before any hook
    runs. A strategy's forward hooks (``auto``'s planner runtime and budget check) are entered
    before ``forward`` and closed by ``always_call`` hooks when it raises; a bad batch caught
    only inside ``forward`` would reach them half-way, and an error they raise while closing
    (``OrderedDict mutated during iteration``) would replace the real one."""

    config: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ids = args[0] if args else kwargs.get("input_ids")
        tgt = args[1] if len(args) > 1 else kwargs.get("targets")
        # a root compiled whole (``sites.sealed``) checks the token ids inside its graph
        cfg, whole = self.config, sites.sealed(self)
        check_input_ids(ids, cfg.max_seq_len, cfg.vocab_size, tgt, values=not whole)
        return super().__call__(*args, **kwargs)


class RMSNorm(nn.Module):
    """Root-mean-square norm: y = x * rsqrt(mean(x²) + eps) * w (statistics in fp32)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        rstd = rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return self.weight * (x * rstd).to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables (cos, sin) for positions [0, max_seq_len), kept as non-persistent buffers."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, Dh); cos/sin: (S, Dh)."""
    return x * cos + rotate_half(x) * sin


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 / LLaMA style init: N(0, std) for linear and embedding weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
