"""FLOPs and activation-memory calculators of cola.txt (Tables 2-4, App. B-C).

Notation (cola.txt §3.3): one decoder layer, one sequence of n tokens, width d, MLP width d_ff,
rank r, h heads; a GEMM (M×N)(N×K) costs 2MNK; backward costs 2× forward (∇x and ∇W, Eq. 4);
O(nd) element-wise work (norms, σ, residual adds, bias) is omitted.

Training FLOPs per layer (Table 3; forward + backward + optimiser-side extras):

    full-rank  24nd² + 12n²d + 18n·d·d_ff                                  (Eq. 5)
    CoLA       48ndr + 12n²d + 18nr(d + d_ff)                              (Eq. 6)
    (Re)LoRA   C_CoLA + 16nd² + 12n²d + 12n·d·d_ff                         (Eq. 9)
    SLTrain    C_full + 24d²r + 18d·d_ff·r   (per step: rebuild BA ⊕ S)    (Eq. 11)
    GaLore     C_full + 16d²r + 12d·d_ff·r   (per step: project gradients) (Eq. 13)

Recompute per layer: vanilla per-block checkpointing re-runs the forward, 8nd² + 4n²d +
6n·d·d_ff (= 23nd² + 4n²d at d_ff = 2.5d, Eq. 16); CoLA-M re-runs the up-projections of q/k/v and
gate/up plus SDPA, 2nr(3d + 2d_ff) + 4n²d, which the paper rounds to half a CoLA forward,
18.5ndr + 4n²d (Eq. 18). Activation memory per layer in *elements* (Table 4, App. C; LLaMA with
d_ff = 2.5d): full-rank 20nd + 2n²h, vanilla GCP nd, CoLA 17.5nd + 2n²h + 14nr (both σ: 20nd +
2n²h + 14nr, Eq. 17 before removing the original σ), CoLA-M 2nd + 7nr (Eq. 19).

SwiGLU has 3 MLP matrices (the paper's 18 = 3 × 6); GPT-2's MLP has 2 (``mlp_matrices=2``).
:func:`count_flops` measures the same quantities with ``torch.utils.flop_counter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from slimact.models.registry import get_spec

METHODS = ("full-rank", "cola", "lora", "sltrain", "galore")
MEMORY_METHODS = ("full-rank", "vanilla-gcp", "cola", "cola-m")
RECOMPUTE_METHODS = ("vanilla-gcp", "cola-m")
_ALIASES = {"relora": "lora", "full": "full-rank", "none": "full-rank", "recompute": "vanilla-gcp"}


def _method(name: str, valid: tuple[str, ...]) -> str:
    m = _ALIASES.get(name, name)
    if m not in valid:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(valid)}")
    return m


def _need_rank(r: float | None, method: str) -> float:
    if r is None or r <= 0:
        raise ValueError(f"method {method!r} needs a rank r > 0, got {r!r}")
    return r


def layer_flops(
    method: str,
    n: float,
    d: float,
    d_ff: float,
    r: float | None = None,
    *,
    r_mlp: float | None = None,
    mlp_matrices: int = 3,
    per_step_extras: bool = True,
) -> float:
    """Training FLOPs of one decoder layer for one sequence of n tokens (Table 3).

    ``r_mlp`` lets CoLA's MLP rank differ from attention's; ``per_step_extras=False`` drops the
    n-independent optimiser-side terms of SLTrain/GaLore (see :func:`training_flops`).
    """
    m = _method(method, METHODS)
    k = 6 * mlp_matrices  # 18 for SwiGLU
    full = 24 * n * d * d + 12 * n * n * d + k * n * d * d_ff
    if m == "full-rank":
        return full
    r = _need_rank(r, m)
    rm = r if r_mlp is None else r_mlp
    cola = 48 * n * d * r + 12 * n * n * d + k * n * rm * (d + d_ff)
    if m == "cola":
        return cola
    if m == "lora":
        return cola + 16 * n * d * d + 12 * n * n * d + (k - 6) * n * d * d_ff
    extra = {
        "sltrain": 24 * d * d * r + k * d * d_ff * r,
        "galore": 16 * d * d * r + (k - 6) * d * d_ff * r,
    }[m]
    return full + (extra if per_step_extras else 0.0)


def forward_flops(n: float, d: float, d_ff: float, mlp_matrices: int = 3) -> dict[str, float]:
    """Table 2: the forward FLOPs of one full-rank LLaMA layer, by operation."""
    rows = {
        "attention_qkv": 6 * n * d * d,
        "attention_sdp": 4 * n * n * d,
        "attention_proj": 2 * n * d * d,
        "feed_forward": 2 * mlp_matrices * n * d * d_ff,
    }
    rows["total_forward"] = sum(rows.values())
    rows["total_backward"] = 2 * rows["total_forward"]
    return rows


def cola_forward_flops(n: float, d: float, d_ff: float, r: float, mlp_matrices: int = 3) -> float:
    """Forward FLOPs of one CoLA layer: 16ndr + 2·m·nr(d + d_ff) + 4n²d."""
    return 16 * n * d * r + 2 * mlp_matrices * n * r * (d + d_ff) + 4 * n * n * d


def recompute_flops(
    method: str, n: float, d: float, d_ff: float | None = None, r: float | None = None,
    *, exact: bool = False,
) -> float:  # fmt: skip
    """Extra (recomputed) FLOPs per layer: the paper's Eq. 16/18, or ``exact`` for our blocks."""
    m = _method(method, RECOMPUTE_METHODS)
    if m == "vanilla-gcp":
        if exact:
            if d_ff is None:
                raise ValueError("exact vanilla-gcp recompute needs d_ff")
            return forward_flops(n, d, d_ff)["total_forward"]
        return 23 * n * d * d + 4 * n * n * d
    r = _need_rank(r, m)
    if exact:
        if d_ff is None:
            raise ValueError("exact cola-m recompute needs d_ff")
        return 2 * n * r * (3 * d + 2 * d_ff) + 4 * n * n * d
    return 18.5 * n * d * r + 4 * n * n * d


def activation_memory(
    method: str, n: float, d: float, h: float, r: float | None = None, *, both_sigma: bool = False
) -> float:
    """Activation memory of one LLaMA layer in elements (Table 4 / App. C, d_ff = 2.5d)."""
    m = _method(method, MEMORY_METHODS)
    full = 20 * n * d + 2 * n * n * h
    if m == "full-rank":
        return full
    if m == "vanilla-gcp":
        return n * d
    r = _need_rank(r, m)
    if m == "cola":
        return full + 14 * n * r - (0 if both_sigma else 2.5 * n * d)
    return 2 * n * d + 7 * n * r


@dataclass(frozen=True)
class Dims:
    """What the calculators need to know about a model."""

    d: int
    d_ff: int
    n_layers: int
    n_heads: int
    vocab: int
    rank: int | None = None
    mlp_rank: int | None = None
    mlp_matrices: int = 3
    both_sigma: bool = False


def model_dims(model: str | nn.Module | Any) -> Dims:
    """Dims of a registered model name, a model, or a config."""
    if isinstance(model, str):
        cfg = get_spec(model).config
    elif isinstance(model, nn.Module):
        cfg = model.config
    else:
        cfg = model
    gpt2 = type(cfg).__name__.endswith("GPT2Config")
    rank = getattr(cfg, "rank", None)
    attn_r = getattr(cfg, "attn_rank_", rank)
    return Dims(
        d=cfg.d_model,
        d_ff=cfg.d_ff,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        vocab=cfg.vocab_size,
        rank=attn_r,
        mlp_rank=getattr(cfg, "mlp_rank_", rank),
        mlp_matrices=2 if gpt2 else 3,
        both_sigma=bool(getattr(cfg, "both_sigma", False)),
    )


def training_flops(
    model: str | nn.Module | Any,
    seq: int,
    batch: int = 1,
    rank: int | None = None,
    include_head: bool = True,
) -> dict[str, Any]:
    """Training FLOPs per step and per token of every method, for a model's dimensions.

    Sequence-level terms scale with ``batch``; SLTrain/GaLore's per-step terms do not, so they are
    amortised over ``batch·seq`` tokens. ``rank`` defaults to the model's CoLA rank, else d/4.
    The LM head (6·n·d·V per sequence) is added when ``include_head``; the paper's Table 3 is
    per decoder layer and leaves it out.
    """
    if seq < 1 or batch < 1:
        raise ValueError(f"seq and batch must be >= 1, got seq={seq}, batch={batch}")
    dm = model_dims(model)
    r = rank or dm.rank or max(1, dm.d // 4)
    r_mlp = rank or dm.mlp_rank or r
    head = 6.0 * seq * dm.d * dm.vocab if include_head else 0.0
    tokens = batch * seq
    out: dict[str, Any] = {"seq": seq, "batch": batch, "rank": r, "mlp_rank": r_mlp, "methods": {}}
    for m in METHODS:
        kw = dict(r_mlp=r_mlp, mlp_matrices=dm.mlp_matrices)
        per_seq = layer_flops(m, seq, dm.d, dm.d_ff, r, per_step_extras=False, **kw)
        per_step = layer_flops(m, seq, dm.d, dm.d_ff, r, **kw) - per_seq
        step = dm.n_layers * (batch * per_seq + per_step) + batch * head
        out["methods"][m] = {
            "layer_flops_per_seq": per_seq + per_step,
            "step_flops": step,
            "flops_per_token": step / tokens,
        }
    base = out["methods"]["full-rank"]["step_flops"]
    for v in out["methods"].values():
        v["vs_full_rank"] = v["step_flops"] / base
    out["recompute_per_layer"] = {
        "vanilla-gcp": recompute_flops("vanilla-gcp", seq, dm.d),
        "vanilla-gcp_exact": recompute_flops("vanilla-gcp", seq, dm.d, dm.d_ff, exact=True),
        "cola-m": recompute_flops("cola-m", seq, dm.d, r=r),
        "cola-m_exact": recompute_flops("cola-m", seq, dm.d, dm.d_ff, r, exact=True),
    }
    out["activation_elements_per_layer"] = {
        m: activation_memory(m, seq, dm.d, dm.n_heads, r, both_sigma=dm.both_sigma)
        for m in MEMORY_METHODS
    }
    return out


# ---------------------------------------------------------------- measured FLOPs


def _sdpa_cpu_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, dh = query_shape
    s_k, dv = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * dh + 2 * b * h * s_q * s_k * dv  # QKᵀ and PV


def _sdpa_cpu_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                  **kwargs) -> int:  # fmt: skip
    b, h, s_q, dh = query_shape
    s_k, dv = key_shape[-2], value_shape[-1]
    # recompute QKᵀ, then dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q
    return 2 * b * h * s_q * s_k * (dh + dv + dv + dh + dh)


def _sdpa_mapping() -> dict:
    aten = torch.ops.aten  # FlopCounterMode passes shapes to custom formulas itself
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
    }


def count_flops(
    model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor | None = None
) -> dict[str, int]:
    """FLOPs of one forward and one backward, counted by ``FlopCounterMode``.

    CPU flash attention is counted too (torch registers formulas only for the CUDA kernels);
    its backward counts 5 GEMMs like torch's CUDA formula (recompute QKᵀ + dV, dP, dQ, dK), so
    it is 10n²d where the paper's Table 2 writes 8n²d.
    """
    targets = input_ids if targets is None else targets
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False, custom_mapping=_sdpa_mapping()) as fwd:
        loss = model(input_ids, targets=targets).loss
    with FlopCounterMode(display=False, custom_mapping=_sdpa_mapping()) as bwd:
        loss.backward()
    f, b = fwd.get_total_flops(), bwd.get_total_flops()
    return {"forward": f, "backward": b, "total": f + b}
