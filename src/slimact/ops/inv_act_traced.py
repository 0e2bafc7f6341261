"""The inverted activations inside ``torch.compile`` (CPU): an opaque forward, a traced backward.

Under dynamo, ``slimact.ops.inv_act.inv_act`` sends CPU tensors of at least ``MIN_NUMEL``
elements (``variant="bitmask"``, ``mode="newton"``, fp32 / bf16 / fp16, backend 'auto' or
'inductor', i.e. those the eager path computes with the table) here instead of through the
two opaque custom ops ``slimact::inv_act_fwd`` / ``slimact::inv_act_bwd``:

* the forward stays one opaque custom op, ``slimact::inv_act_fwd_graph`` (x, table) -> (y, side):
  AOTAutograd's partitioner never recomputes an op outside its allowlist, so what the compiled
  graph keeps for backward is still exactly y + 1 bit per element (had the forward been traced,
  the min-cut partitioner would keep x and recompute y and the bits: measured). Its body is one
  fused inductor loop (``compiled_ref``) computing y and packing the bits;
* the backward is plain torch ops (``register_autograd`` with a traceable formula,
  :func:`inv_act_bwd_graph`), which AOTAutograd inlines into the block's backward graph, so
  inductor fuses f'(f⁻¹(y; s)) (``inv_act_approx.dinv_table``) with its neighbours (SwiGLU's
  ``dy·up``, ``dh·y``) instead of running a separate kernel per call.

The side tensor here is *planar*: with ``m = ceil(n/8)``, element ``i`` is bit ``i // m`` of byte
``i % m`` (the same n/8 bytes as the §2 layout of ``inv_act``, bit ``i % 8`` of byte ``i // 8``),
so both packing (8 contiguous slices OR-ed) and unpacking (a broadcast over 8 rows of ``m``) are
contiguous, vectorized loops; the §2 layout made inductor's inner loop 8 lanes wide. It never
leaves this module: the forward's side is only read by this backward.

This path is faster per call than the custom-op pair it replaces (BENCHMARKS.md, the compiled
inverted activations). What remains of the backward is mostly the table's
two gathers, which inductor's CPU code runs lane by lane. (A gather-free piecewise-polynomial g
was tried: its pieces' coefficient selects made inductor materialize a mask per select, far
slower.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimact.ops import compiled_ref
from slimact.ops.inv_act_approx import BRANCH, act_ref, dinv_table, newton_table

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def eligible(x: torch.Tensor, mode: str, variant: str, backend: str) -> bool:
    """Whether this path serves ``x`` (other tensors take the custom-op pair of ``inv_act``). As
    eagerly, a tensor under ``MIN_NUMEL`` elements keeps the Newton reference (no table)."""
    return (
        x.device.type == "cpu"
        and x.numel() >= compiled_ref.MIN_NUMEL
        and x.dtype in DTYPES
        and variant == "bitmask"
        and mode == "newton"
        and backend in ("auto", "inductor")
    )


# ----------------------------------------------------------------------------- references
def pack_bits_planar_ref(s: torch.Tensor) -> torch.Tensor:
    """Bool (*shape) -> uint8 (ceil(n/8),): element i is bit i // m of byte i % m, m = ceil(n/8)."""
    flat = s.reshape(-1).to(torch.int32)
    rows = F.pad(flat, (0, (-flat.numel()) % 8)).view(8, -1)  # (8, m)
    out = rows[0]
    for k in range(1, 8):
        out = out | (rows[k] << k)
    return out.to(torch.uint8)


def unpack_bits_planar(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (m,) -> bool (8, m): row k holds bit k of every byte (elements k·m .. k·m + m − 1)."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32).view(8, 1)
    return ((packed.view(1, -1).to(torch.int32) >> shifts) & 1).bool()


def unpack_bits_planar_ref(packed: torch.Tensor, n: int) -> torch.Tensor:
    return unpack_bits_planar(packed).reshape(-1)[:n]


def fwd_graph_ref(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (*shape) -> (y = f(x) (*shape), planar bits of s = [x < T] (ceil(n/8),) uint8)."""
    s = (x if x.dtype == torch.float64 else x.float()) < BRANCH[kind].T
    return act_ref(x, kind), pack_bits_planar_ref(s)


def _planar(t: torch.Tensor, m: int) -> torch.Tensor:
    """(*shape) -> (8, m), zero-padded at the end."""
    flat = t.reshape(-1)
    pad = 8 * m - flat.numel()
    return (F.pad(flat, (0, pad)) if pad else flat).view(8, m)


def inv_act_bwd_graph(dy, y, side, table, kind: str) -> torch.Tensor:
    """dy, y (*shape), side (ceil(n/8),) planar, table (``newton_table(kind)``) -> dx (*shape):
    dy·f'(f⁻¹(y; s)), plain torch ops (what the compiled backward graph inlines)."""
    n, m = y.numel(), side.numel()
    if 8 * m == n:  # the bits, unpacked (8, m), are a view of y's shape: g fuses with its users
        g = dinv_table(y, unpack_bits_planar(side).view(y.shape), kind, table)
        return (dy.to(g.dtype) * g).to(dy.dtype)
    g = dinv_table(_planar(y, m), unpack_bits_planar(side), kind, table)  # (8, m) fp32
    dx = (_planar(dy, m).to(g.dtype) * g).to(dy.dtype).reshape(-1)
    return dx[:n].view(y.shape)


# ----------------------------------------------------------------------------- the op
@torch.library.custom_op("slimact::inv_act_fwd_graph", mutates_args=())
def _fwd_op(x: torch.Tensor, table: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    # x: (*shape) -> y: (*shape) contiguous, side: (ceil(numel/8),) uint8 planar; table is only
    # an input so that the traced backward receives it (setup_context saves it; 48 KiB)
    y, side = compiled_ref.call(fwd_graph_ref, x.contiguous().view(-1), kind=kind)
    return y.view(x.shape), side


@_fwd_op.register_fake
def _(x, table, kind):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, x.new_empty((x.numel() + 7) // 8, dtype=torch.uint8)


def _setup_context(ctx, inputs, output):
    _, table, kind = inputs
    ctx.kind = kind
    ctx.save_for_backward(*output, table)


def _backward(ctx, dy, dside):
    y, side, table = ctx.saved_tensors
    return inv_act_bwd_graph(dy, y, side, table, ctx.kind), None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@torch._dynamo.assume_constant_result
def _table(kind: str) -> torch.Tensor:
    """``newton_table(kind)``, built eagerly when dynamo meets it (a constant of the graph)."""
    return newton_table(kind)


def inv_act_graph(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverted ``kind`` for use inside ``torch.compile`` (eager-callable too): saves y + 1 bit."""
    return _fwd_op(x, _table(kind), kind)[0]
