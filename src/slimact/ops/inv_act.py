"""Inverted activations (invact.txt): GELU / tanh-GELU / SiLU that save their *output* + 1 bit.

A pointwise ``y = f(x)`` normally saves ``x`` for ``dx = dy·f'(x)``, while the layer after it
(a Linear, or the ``*`` of SwiGLU) saves ``y`` anyway: two tensors of the same size live until
backward. Here the autograd Function saves ``y`` itself (the same storage the next op saves, so
the meter counts it once) plus ``s = [x < T]`` bit-packed 8 per uint8 (§2: bit ``i % 8`` of byte
``i // 8``), and backward computes ``dx = dy·f'(f⁻¹(y; s))`` (``slimact.ops.inv_act_approx``).
Net cost of the activation: n/8 bytes instead of n·sizeof(dtype), i.e. −97% (fp32) / −94% (bf16).

Variants (``variant=``), i.e. what is saved beside y:

* ``"bitmask"`` (default): y exact, s in a separate uint8 tensor (n/8 bytes).
* ``"lsb"`` (§2.1 precision bit): s is written into y's least significant mantissa bit; nothing
  extra is saved, but the forward output is off by up to 1 ulp (2⁻²³ in fp32, 2⁻⁷ in bf16).
* ``"near-branch"`` (bf16 / fp16 only): one byte per element (n bytes, −50% in bf16). Code 0/1
  is s for an x away from T; codes 2..255 hold x itself, as its 16-bit pattern minus T's + 128,
  for the ±126 representable values nearest T ([−2.53, −0.65] for SiLU in bf16).

**The 16-bit floor.** Near T, ``f(x) ≈ f(T) + C(x−T)²/2`` and ``f'(x) ≈ C(x−T)``, so an error δ
in y (half an ulp of |f(T)| ≈ 0.17–0.28: 1e-3 in bf16, 6e-5 in fp16) moves the recovered f' by
``≈ δ/|x−T|``, capped at ``√(2Cδ)`` at T: 1.2–1.5e-2 (bf16), 5–7e-3 (fp16). No 1-bit scheme does
better: y no longer tells those x apart. torch's own autograd reads x and only rounds dx (half an
ulp of |f'| ≤ 1.1: 3.9e-3 in bf16, 4.9e-4 in fp16). The 1-bit form's worst error is a few times
torch's, all of it near the branch point; ``near-branch`` reads the exact x there and comes
within a few percent of torch's own error in bf16 (measured against the float64 truth:
BENCHMARKS.md §2). In fp16 its window (±0.06) is narrower than the
region that needs it. Trade-off: 8× the mask's bytes. The ``invact`` strategy offers it as ``invact@bf16=exact-near-branch`` and keeps 1 bit by
default: the excess is small in norm and confined to where |f'| < 0.1.

Paths: CUDA tensors with triton installed run the Triton kernels (``ops.inv_act_triton``; also on
CPU under ``TRITON_INTERPRET=1`` with ``backend="triton"``; none for ``near-branch``). CPU tensors of
≥ ``MIN_NUMEL`` elements run the refs compiled by inductor (``ops.compiled_ref``: one fused
loop instead of ~150 small eager ops; the backward evaluates g from ``inv_act_poly``'s
piecewise polynomials);
``backend="torch"`` runs the ``*_ref`` functions eagerly (``ops.inv_act_ref``: the reference the
tests hold all to, and the side channel's encodings).

``torch.compile``: under dynamo, CPU tensors the eager path would run through the table
(``MIN_NUMEL`` elements or more, bitmask, newton, not fp64) go through ``ops.inv_act_traced``: an
opaque forward custom op (y + bits) and a traced backward that inductor fuses into the block's
backward graph. Everything else goes through two ``torch.library`` custom ops,
``slimact::inv_act_fwd`` (x -> y, side) and ``slimact::inv_act_bwd`` (dy, y, side -> dx), tied
by ``register_autograd``. Either way the forward is opaque to the compiler, so AOTAutograd saves
exactly y + side.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
import torch.nn.functional as F

from slimact import sites
from slimact.ops import compiled_ref, device_path, inv_act_traced
from slimact.ops.inv_act_approx import KINDS, MODES, act_ref
from slimact.ops.inv_act_poly import poly_floats
from slimact.ops.inv_act_ref import (
    HALF,
    fwd_side_ref,
    inv_act_bwd_dense,
    inv_act_bwd_ref,
    inv_act_fwd_ref,
)

VARIANTS = ("bitmask", "lsb", "near-branch")
BACKENDS = ("auto", "torch", "inductor", "triton")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


BF16_MODES = ("floor", "exact-near-branch")


def pick_variant(dtype: torch.dtype, variant: str, bf16: str) -> str:
    """The variant for an input of ``dtype``: ``bf16="exact-near-branch"`` turns bfloat16 and
    float16 inputs (autocast's included) to 'near-branch'; others keep ``variant``."""
    if bf16 not in BF16_MODES:
        raise ValueError(f"bf16 must be one of {BF16_MODES}, got {bf16!r}")
    return "near-branch" if bf16 == "exact-near-branch" and dtype in HALF else variant


def _check(x: torch.Tensor, kind: str, mode: str, variant: str, backend: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"inverted {kind} needs a floating-point tensor (float32, bfloat16, float16, float64), "
            f"got dtype {x.dtype}"
        )
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if variant == "lsb" and x.dtype == torch.float64:
        raise TypeError("variant='lsb' supports float32, bfloat16 and float16, got float64")
    if variant == "near-branch" and x.dtype not in HALF:
        raise TypeError(f"variant='near-branch' supports bfloat16 and float16, got {x.dtype}")


# ----------------------------------------------------------------------------- dispatch
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton():
    """The Triton module, imported on first use (optional dependency; TRITON_INTERPRET is
    read then)."""
    from slimact.ops import inv_act_triton

    return inv_act_triton


def inv_act_fwd_triton(x: torch.Tensor, kind: str, variant: str = "bitmask"):
    return _triton().inv_act_fwd_triton(x, kind, variant)


def inv_act_bwd_triton(dy, y, packed, kind: str, mode: str = "newton", variant: str = "bitmask"):
    return _triton().inv_act_bwd_triton(dy, y, packed, kind, mode, variant)


def _path(x: torch.Tensor, backend: str, variant: str) -> str:
    """'triton', 'inductor' or 'torch' for this tensor."""
    if backend == "triton" and variant != "near-branch" and x.dtype != torch.float64:
        if not triton_available():
            raise RuntimeError("backend='triton' but triton is not installed (pip install triton)")
        return "triton"
    cuda = device_path.takes_cuda_path(x)
    if backend == "auto" and cuda and variant != "near-branch" and triton_available():
        return "triton" if x.dtype != torch.float64 else "torch"
    if x.dtype != torch.float64 and (
        backend == "inductor"
        or (backend == "auto" and not cuda and x.numel() >= compiled_ref.MIN_NUMEL)
    ):
        return "inductor"
    return "torch"


def _fwd(x: torch.Tensor, kind: str, variant: str, backend: str):
    """x contiguous (*shape) -> (y (*shape), side or None)."""
    path = _path(x, backend, variant)
    if path == "triton":
        return inv_act_fwd_triton(x, kind, variant)
    if path == "torch":
        return inv_act_fwd_ref(x, kind, variant)
    y = act_ref(x, kind)  # torch's kernel: bit-identical forward; the side is one fused loop
    side = compiled_ref.call(fwd_side_ref, x.view(-1), y.view(-1), kind=kind, variant=variant)
    return (side.view(y.shape), None) if variant == "lsb" else (y, side)


def _bwd(dy, y, side, kind: str, mode: str, variant: str, backend: str):
    """dy contiguous, y (*shape), side -> dx (*shape)."""
    path = _path(y, backend, variant)
    if path == "triton":
        return inv_act_bwd_triton(dy, y, side, kind, mode, variant)
    if path == "torch":
        return inv_act_bwd_ref(dy, y, side, kind, mode, variant)
    n = y.numel()
    coeffs = poly_floats(kind) if mode == "newton" else None
    if variant == "bitmask" and n % 32 == 0 and _word_aligned(side):
        # 32 elements per row, their bits one int32 word: full 16-lane vectors (rows of 8 left
        # half of every AVX-512 vector idle)
        dx = compiled_ref.call(
            inv_act_bwd_dense,
            dy.view(-1, 32),
            y.view(-1, 32),
            side.view(torch.int32),
            kind=kind,
            mode=mode,
            variant=variant,
            coeffs=coeffs,
        )
        return dx.view(y.shape)
    pad = (-n) % 8  # transformer shapes have none; else one padded copy
    dy8, y8 = (F.pad(t.reshape(-1), (0, pad)).view(-1, 8) for t in (dy, y))
    if variant == "near-branch":
        side = F.pad(side, (0, pad)).view(-1, 8)
    dx = compiled_ref.call(
        inv_act_bwd_dense, dy8, y8, side, kind=kind, mode=mode, variant=variant, coeffs=coeffs
    )
    return (dx.view(-1)[:n] if pad else dx).view(y.shape)


def _word_aligned(side: torch.Tensor) -> bool:
    """Whether the packed bytes can be read as little-endian int32 words in place."""
    return (
        sys.byteorder == "little"
        and side.is_contiguous()
        and side.storage_offset() % 4 == 0
        and side.numel() % 4 == 0
    )


# ----------------------------------------------------------------------------- autograd
class InvActFunction(torch.autograd.Function):
    """Saves y (the output itself) + the side tensor; backward: dy·f'(f⁻¹(y; s))."""

    @staticmethod
    def forward(ctx, x, kind, mode, variant, backend):
        y, side = _fwd(x.contiguous(), kind, variant, backend)
        ctx.cfg = (kind, mode, variant, backend)
        ctx.save_for_backward(*((y,) if side is None else (y, side)))
        return y

    @staticmethod
    def backward(ctx, dy):
        # dy, y: (*shape) -> dx: (*shape); side: (ceil(numel/8),) or (numel,) uint8
        kind, mode, variant, backend = ctx.cfg
        y, *side = ctx.saved_tensors
        dx = _bwd(dy.contiguous(), y, side[0] if side else None, kind, mode, variant, backend)
        return dx, None, None, None, None


# ----------------------------------------------------------------------------- torch.library
@torch.library.custom_op("slimact::inv_act_fwd", mutates_args=())
def _inv_act_fwd_op(
    x: torch.Tensor, kind: str, mode: str, variant: str, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    # x: (*shape) -> y: (*shape), side: (ceil(numel/8),) / (numel,) uint8 ((0,) for 'lsb'); mode
    # is only read by the backward (setup_context keeps it)
    xc = x.contiguous()
    y, side = _fwd(xc, kind, variant, backend)
    return y, (xc.new_empty(0, dtype=torch.uint8) if side is None else side)


def _side_numel(x: torch.Tensor, variant: str) -> int:
    return {"lsb": 0, "near-branch": x.numel()}.get(variant, (x.numel() + 7) // 8)


@_inv_act_fwd_op.register_fake
def _(x, kind, mode, variant, backend):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, x.new_empty(_side_numel(x, variant), dtype=torch.uint8)


@torch.library.custom_op("slimact::inv_act_bwd", mutates_args=())
def _inv_act_bwd_op(
    dy: torch.Tensor,
    y: torch.Tensor,
    packed: torch.Tensor,
    kind: str,
    mode: str,
    variant: str,
    backend: str,
) -> torch.Tensor:
    # dy, y: (*shape) -> dx: (*shape)
    side = None if variant == "lsb" else packed
    return _bwd(dy.contiguous(), y, side, kind, mode, variant, backend)


@_inv_act_bwd_op.register_fake
def _(dy, y, packed, kind, mode, variant, backend):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _op_setup_context(ctx, inputs, output):
    _, kind, mode, variant, backend = inputs
    ctx.cfg = (kind, mode, variant, backend)
    ctx.save_for_backward(*output)


def _op_backward(ctx, dy, dpacked):
    kind, mode, variant, backend = ctx.cfg
    y, packed = ctx.saved_tensors
    return _inv_act_bwd_op(dy, y, packed, kind, mode, variant, backend), None, None, None, None


_inv_act_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def inv_act_op(
    x: torch.Tensor,
    kind: str,
    mode: str = "newton",
    variant: str = "bitmask",
    backend: str = "auto",
) -> torch.Tensor:
    """The custom-op path (what ``inv_act`` runs under ``torch.compile``); eager-callable too."""
    return _inv_act_fwd_op(x, kind, mode, variant, backend)[0]


def inv_act(
    x: torch.Tensor,
    kind: str,
    *,
    mode: str = "newton",
    variant: str = "bitmask",
    backend: str = "auto",
) -> torch.Tensor:
    """Inverted ``kind`` in {'gelu', 'gelu_tanh', 'silu'}: same forward, saves output + 1 bit."""
    _check(x, kind, mode, variant, backend)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return act_ref(x, kind)
    if torch.compiler.is_compiling():
        if inv_act_traced.eligible(x, mode, variant, backend):
            return inv_act_traced.inv_act_graph(x, kind)
        return inv_act_op(x, kind, mode, variant, backend)
    with sites.role(f"inv_{kind}"):
        return InvActFunction.apply(x, kind, mode, variant, backend)


def inv_gelu(
    x: torch.Tensor,
    approximate: str = "none",
    *,
    mode: str = "newton",
    variant: str = "bitmask",
    backend: str = "auto",
) -> torch.Tensor:
    """Drop-in for ``F.gelu(x, approximate=...)`` that saves y + 1 bit/element for backward."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    kind = "gelu_tanh" if approximate == "tanh" else "gelu"
    return inv_act(x, kind, mode=mode, variant=variant, backend=backend)


def inv_silu(
    x: torch.Tensor, *, mode: str = "newton", variant: str = "bitmask", backend: str = "auto"
) -> torch.Tensor:
    """Drop-in for ``F.silu(x)`` that saves y + 1 bit/element for backward."""
    return inv_act(x, "silu", mode=mode, variant=variant, backend=backend)
