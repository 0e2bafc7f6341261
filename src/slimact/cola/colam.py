"""CoLA-M (cola.txt §4.2, Fig. 4, App. C): keep only the rank-r activations and the residual stream.

In a CoLA block every projection is ``B σ(A x)``, so the block is cut into short paths that
start and end at r-dimensional points. CoLA-M stores, per block and per token,

    x (block input, d)  +  h = x + attn(x) (the residual stream after attention, d)
    + z = A·(input) of each of the 7 CoLA layers (q, k, v, o, gate, up, down; r each)
    = 2d + 7r values                                              (Eq. 19: 2nd + 7nr)

and recomputes in backward what the saved z's do not give: the norms (from x and h), σ and the
up-projections B of q/k/v and gate/up, RoPE and the attention (SDPA) forward, the SwiGLU product.
The A projections are never recomputed and neither are the output up-projections B_o/B_down (their
outputs only feed a residual add, which saves nothing).

How: each block runs as two non-reentrant ``torch.utils.checkpoint`` regions, the attention branch
(x -> z_o) and the MLP branch (h -> z_down). Inside a region a selective-checkpoint policy marks
the matmul of every ``cola_a`` as MUST_SAVE (so its output z is cached and replayed, never
recomputed) and everything else as recompute. The region stops at z_o / z_down (the output layer's
``CoLALinear`` emits z); outside it, :func:`lowrank_up` computes ``B σ(z) + b`` saving only z and
recomputing σ(z) in its own backward. The checkpoint keeps x and h alive: they are reported with
``sites.hold`` (role ``colam_input``) and every z with role ``colam_z``, so ``slimact.measure``
counts exactly what is stored.

Extra FLOPs per block (n tokens of one sequence): ``2nr(3d + 2 d_ff) + 4n²d`` (B of q/k/v/gate/up
and the SDPA forward); the paper rounds the GEMM part to half a CoLA forward, 18.5ndr at
d_ff = 2.5d (Eq. 18); vanilla per-block checkpointing re-runs the whole block, 23nd² + 4n²d
(Eq. 16). Trade-off: memory 2d + 7r per token instead of CoLA's ~17.5d + 14r (+ attention), for
about a quarter of vanilla checkpointing's recompute.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from slimact import sites
from slimact.cola.layers import CoLALinear, activation_fn
from slimact.patching import override_forward, run_all

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}


# ---------------------------------------------------------------- fused σ + up-projection


class _LowRankUp(torch.autograd.Function):
    """y = B σ(z) + b, saving z only (σ(z) and σ'(z) are recomputed in backward)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, z, weight, bias, activation):
        ctx.activation = activation
        ctx.has_bias = bias is not None
        ctx.save_for_backward(z, weight)
        return torch.nn.functional.linear(activation_fn(activation)(z), weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy):
        z, weight = ctx.saved_tensors  # z: (..., r), weight: (d_out, r), dy: (..., d_out)
        with torch.enable_grad():
            zz = z.detach().requires_grad_(True)
            s = activation_fn(ctx.activation)(zz)  # (..., r)
        d_out, r = weight.shape
        dz = dw = db = None
        if ctx.needs_input_grad[0]:
            ds = torch.matmul(dy, weight.to(dy.dtype))  # (..., r)
            (dz,) = torch.autograd.grad(s, zz, ds) if s is not zz else (ds,)
        dy2 = dy.reshape(-1, d_out)  # (n, d_out)
        if ctx.needs_input_grad[1]:
            dw = (dy2.t() @ s.detach().reshape(-1, r).to(dy2.dtype)).to(weight.dtype)  # (d_out, r)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(weight.dtype)  # (d_out,)
        return dz, dw, db, None


def lowrank_up(
    z: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """``B σ(z) + b`` that stores only ``z`` for backward (``weight`` is B, shape (d_out, r))."""
    activation_fn(activation)  # validates the name
    if z.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"lowrank_up: z has rank {z.shape[-1]} but B has shape {tuple(weight.shape)}"
        )
    with sites.role("colam_z"):
        return _LowRankUp.apply(z, weight, bias, activation)


def lowrank_up_ref(
    z: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Plain-autograd reference of :func:`lowrank_up` (saves z and σ(z))."""
    return torch.nn.functional.linear(activation_fn(activation)(z), weight, bias)


# ---------------------------------------------------------------- selective checkpoint policy

_tls = threading.local()


def _in_down() -> bool:
    return getattr(_tls, "down", 0) > 0


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func in _MATMULS and _in_down():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_CONTEXT_FN = functools.partial(create_selective_checkpoint_contexts, _policy)


def _down_pre_hook(module, args):
    _tls.down = getattr(_tls, "down", 0) + 1


def _down_post_hook(module, args, output):
    _tls.down -= 1
    if torch.is_grad_enabled():
        sites.hold(output, "colam_z")


@contextmanager
def _emit_z(lin: CoLALinear) -> Iterator[None]:
    lin._emit_z = True
    try:
        yield
    finally:
        lin._emit_z = False


def _region(out_lin: CoLALinear, fn: Callable, *args) -> torch.Tensor:
    with _emit_z(out_lin):
        return fn(*args)


def _up(lin: CoLALinear, z: torch.Tensor) -> torch.Tensor:
    return lowrank_up(z, lin.cola_b.weight, lin.cola_b.bias, lin.activation)


# ---------------------------------------------------------------- block forwards


def _llama_attn(block, x, cos, sin):
    return block.self_attn(block.input_layernorm(x), cos, sin)  # -> z_o (B, S, r)


def _llama_mlp(block, h):
    return block.mlp(block.post_attention_layernorm(h))  # -> z_down (B, S, r)


def _llama_forward(block, preserve_rng, x, cos, sin):
    if not torch.is_grad_enabled():
        return type(block).forward(block, x, cos, sin)
    o_proj, down = block.self_attn.o_proj, block.mlp.down_proj
    kw = dict(use_reentrant=False, context_fn=_CONTEXT_FN, preserve_rng_state=preserve_rng)
    sites.hold(x, "colam_input")
    z_o = checkpoint(_region, o_proj, _llama_attn, block, x, cos, sin, **kw)
    h = x + _up(o_proj, z_o)
    sites.hold(h, "colam_input")
    z_d = checkpoint(_region, down, _llama_mlp, block, h, **kw)
    return h + _up(down, z_d)


def _gpt2_attn(block, x):
    return block.attn(block.ln_1(x))  # resid_dropout has p = 0 (checked), so -> z_o


def _gpt2_mlp(block, h):
    return block.mlp(block.ln_2(h))


def _gpt2_forward(block, preserve_rng, x):
    if not torch.is_grad_enabled():
        return type(block).forward(block, x)
    c_proj, mlp_proj = block.attn.c_proj, block.mlp.c_proj
    kw = dict(use_reentrant=False, context_fn=_CONTEXT_FN, preserve_rng_state=preserve_rng)
    sites.hold(x, "colam_input")
    z_o = checkpoint(_region, c_proj, _gpt2_attn, block, x, **kw)
    h = x + _up(c_proj, z_o)
    sites.hold(h, "colam_input")
    z_d = checkpoint(_region, mlp_proj, _gpt2_mlp, block, h, **kw)
    return h + _up(mlp_proj, z_d)


_LLAMA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
_GPT2 = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _colam_forward(inner, fwd, block, preserve_rng, *args, **kwargs):
    return fwd(block, preserve_rng, *args, **kwargs)


def _family(block: nn.Module) -> tuple[str | None, str]:
    """('llama' | 'gpt2' | None, reason when None)."""
    if hasattr(block, "self_attn") and hasattr(block, "input_layernorm"):
        names, fam = _LLAMA, "llama"
    elif hasattr(block, "attn") and hasattr(block, "ln_1"):
        names, fam = _GPT2, "gpt2"
        drops = [block.attn.resid_dropout.p, block.mlp.dropout.p]
        if any(p > 0 for p in drops):
            return None, "GPT-2 block with residual dropout > 0 (CoLA-M needs dropout=0)"
    else:
        return None, f"{type(block).__name__} is not a LLaMA or GPT-2 block"
    missing = [n for n in names if not isinstance(block.get_submodule(n), CoLALinear)]
    if missing:
        return None, "not a CoLA block: full-rank " + ", ".join(missing)
    return fam, ""


def colam_block(block: nn.Module, preserve_rng_state: bool = True) -> Callable[[], None]:
    """Switch one CoLA block to CoLA-M in place; returns the function that undoes it.

    Raises ``ValueError`` (with the reason) for a block CoLA-M cannot handle.
    """
    fam, why = _family(block)
    if fam is None:
        raise ValueError(why)
    if "forward" in block.__dict__:
        raise ValueError("block forward is already patched (another strategy is applied)")
    fwd = _llama_forward if fam == "llama" else _gpt2_forward
    _, undo = override_forward(block, _colam_forward, fwd, block, preserve_rng_state)
    removes = []
    for m in block.modules():
        if isinstance(m, CoLALinear):
            removes.append(m.cola_a.register_forward_pre_hook(_down_pre_hook).remove)
            removes.append(m.cola_a.register_forward_hook(_down_post_hook, always_call=True).remove)
    return functools.partial(run_all, undo, *removes)  # picklable; copies undo the copy


def unsupported_reason(block: nn.Module) -> str:
    """Why CoLA-M cannot handle ``block`` ('' when it can)."""
    return _family(block)[1]
