"""Exact chunked linear + cross-entropy for the loss head: the (N, V) logits are never stored.

The head of a causal LM computes ``z = h Wᵀ + b`` (h: (N, D) tokens, W: (V, D)) and the mean
cross-entropy ``L = (1/|S|) Σ_{i∈S} ℓ_i``, with S the tokens whose target is not ``ignore_index``
and, with label smoothing ε,

    ℓ_i = lse_i − (1−ε)·z_{i,t_i} − (ε/V)·Σ_c z_{i,c},        lse_i = log Σ_c exp z_{i,c}
    ∂ℓ_i/∂z_{i,c} = softmax(z_i)_c − (1−ε)·[c = t_i] − ε/V =: G_{i,c}

and ``dh = s·G W``, ``dW = s·Gᵀh``, ``db = s·Σ_i G_i`` with s = grad_output/|S| (``"mean"``) or
grad_output (``"sum"``). Plain autograd stores z's log-softmax, N·V fp32 values (1 GiB for 2048
tokens at V = 128,256). Here N is cut into chunks of C rows; a chunk's z is computed, reduced and
dropped, so only a C × V buffer is ever live. Two ways to get G in backward without N × V:

* ``"recompute"`` (default): forward keeps only (h, targets, lse) — N·D + 12·N bytes — and backward
  recomputes each chunk's z (one more C×D×V matmul per chunk), turns it into G in place from the
  saved lse, and accumulates dh, dW (fp32), db. Cost: one extra matmul, 4 instead of 3.
* ``"precompute"`` (Liger-Kernel's fused linear cross-entropy): forward computes G per chunk right
  away and keeps dh (N × D) and dW (V × D, fp32) and db for backward, which only multiplies them
  by grad_output. No extra matmul, but dW is a weight-sized buffer held from forward to backward:
  62.5 MiB for a 32,000 × 512 head (a quarter of the 250 MiB of logits it replaces at 8 × 256
  tokens), and it grows with V·D, not with the batch.

Measured on llama-20m at V = 32,000, 8 × 256 tokens, fp32, CPU 1 thread (meter, one step):
baseline 797.5 MB saved, its head (lm_head + loss) 266.4 MB; recompute 535.3 MB (0.671×), head
4.2 MB (1.6%: h + targets + lse); precompute 600.8 MB (0.753×), head 69.7 MB (26%: dh + dW).
``slimact memory --strategy chunked-ce``: peak over a step 0.51× the baseline's, step time
1.08× (median of 5 interleaved rounds, spread 1.01–1.86 at load 5.6–6.2 on 2 cores; the extra
matmul is ~15% of this model's FLOPs). The default is ``"recompute"``: the head's memory is the
point; ``"precompute"`` trades 62.5 MiB (V·D·4) for the matmul.

Numerics: the matmuls run in the inputs' dtype (bf16/fp16 keep their tensor-core speed, as
``F.linear`` would), z is upcast to fp32 for lse, loss and G, as ``causal_lm_loss`` does; G is cast
back to the inputs' dtype for the gradient matmuls, dW and db accumulate in fp32 over chunks.
The loss is fp32. Under autocast, h, W and b are first cast to the autocast dtype (what the
linear would do). Ignored tokens get zero loss and zero gradient; if every token is ignored the
``"mean"`` loss is NaN (0/0) with zero gradients — torch's own behaviour.

Kernels: per chunk, one Triton program per row streams z in blocks (online max/sum for lse, the
smoothing sum, the target logit) and, when asked, overwrites z with G·s in place
(``ce_chunk_triton``; used for CUDA tensors, or with ``backend="triton"`` also under
``TRITON_INTERPRET=1`` on CPU). ``ce_stats_ref``/``ce_grad_ref_`` are the plain-PyTorch
references; they and the chunk loops of forward and backward live in ``ops.chunked_ce_loop``,
this module wraps them as an autograd Function and custom ops. Under ``torch.compile`` the op is two ``torch.library`` custom ops
(``slimact::chunked_ce_fwd`` / ``slimact::chunked_ce_bwd``), opaque to the compiler.
"""

from __future__ import annotations

import torch

from slimact import sites
from slimact.ops.chunked_ce_loop import chunked_ce_backward, chunked_ce_forward

MODES = ("recompute", "precompute")
REDUCTIONS = ("mean", "sum")
BACKENDS = ("auto", "torch", "triton")
CHUNK_BYTES = 32 * 2**20  # default: a chunk's fp32 logits take at most this many bytes
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def default_chunk_size(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: the largest power of two whose fp32 logits fit in ``chunk_bytes``."""
    rows = max(1, chunk_bytes // (4 * vocab_size))
    return 1 << (rows.bit_length() - 1)


# ----------------------------------------------------------------------------- autograd
def _scaled(ctx, g: torch.Tensor, saved) -> tuple:
    """precompute's backward: the saved grads times g, in place (no second weight-sized buffer);
    so a second backward through the same graph (retain_graph) is refused."""
    if getattr(ctx, "consumed", False):
        raise RuntimeError("chunked CE (mode='precompute') cannot backward twice; use 'recompute'")
    ctx.consumed = True
    return tuple(
        None if x is None or x.numel() == 0 else x.mul_(g.to(x.dtype)).to(d)
        for x, d in zip(saved, ctx.dtypes, strict=True)
    )


class ChunkedCEFunction(torch.autograd.Function):
    """Eager path; saves (h, targets, lse) or (dh, dW, db) by mode, never the (N, V) logits."""

    @staticmethod
    def forward(ctx, h, w, b, t, ignore_index, smoothing, reduction, chunk, mode, backend):
        loss, lse, dh, dw, db = chunked_ce_forward(
            h, w, b, t, ignore_index, smoothing, reduction, chunk, mode, backend
        )
        ctx.cfg = (ignore_index, smoothing, reduction, chunk, mode, backend)
        ctx.dtypes = (h.dtype, w.dtype, None if b is None else b.dtype)
        if mode == "recompute":
            ctx.save_for_backward(h, w, b, t, lse)
        else:
            ctx.save_for_backward(dh, dw, db if b is not None else None)
        return loss

    @staticmethod
    def backward(ctx, g):
        ignore_index, smoothing, reduction, chunk, mode, backend = ctx.cfg
        if mode == "recompute":
            h, w, b, t, lse = ctx.saved_tensors
            needs = (
                ctx.needs_input_grad[0],
                ctx.needs_input_grad[1],
                b is not None and ctx.needs_input_grad[2],
            )
            grads = chunked_ce_backward(
                g, h, w, b, t, lse, ignore_index, smoothing, reduction, chunk, backend, needs
            )
        else:
            grads = _scaled(ctx, g, ctx.saved_tensors)
        return (*grads, None, None, None, None, None, None, None)


# ----------------------------------------------------------------------------- torch.library
@torch.library.custom_op("slimact::chunked_ce_fwd", mutates_args=())
def _fwd_op(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    t: torch.Tensor,
    ignore_index: int,
    smoothing: float,
    reduction: str,
    chunk: int,
    mode: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return chunked_ce_forward(h, w, b, t, ignore_index, smoothing, reduction, chunk, mode, backend)


@_fwd_op.register_fake
def _(h, w, b, t, ignore_index, smoothing, reduction, chunk, mode, backend):
    f32 = torch.float32
    loss = h.new_empty((), dtype=f32)
    if mode == "recompute":
        return loss, h.new_empty(h.shape[0], dtype=f32), *(h.new_empty(0, dtype=f32),) * 3
    db = h.new_empty(w.shape[0] if b is not None else 0, dtype=f32)
    return loss, h.new_empty(0, dtype=f32), torch.empty_like(h), w.new_empty(w.shape, dtype=f32), db


@torch.library.custom_op("slimact::chunked_ce_bwd", mutates_args=())
def _bwd_op(
    g: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    t: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    smoothing: float,
    reduction: str,
    chunk: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    needs = (True, True, b is not None)
    dh, dw, db = chunked_ce_backward(
        g, h, w, b, t, lse, ignore_index, smoothing, reduction, chunk, backend, needs
    )
    return dh, dw, (db if db is not None else h.new_empty(0))


@_bwd_op.register_fake
def _(g, h, w, b, t, lse, ignore_index, smoothing, reduction, chunk, backend):
    db = torch.empty_like(b) if b is not None else h.new_empty(0)
    return torch.empty_like(h), torch.empty_like(w), db


def _op_setup_context(ctx, inputs, output):
    h, w, b, t, ignore_index, smoothing, reduction, chunk, mode, backend = inputs
    ctx.cfg = (ignore_index, smoothing, reduction, chunk, mode, backend)
    ctx.dtypes = (h.dtype, w.dtype, None if b is None else b.dtype)
    ctx.has_bias = b is not None
    if mode == "recompute":
        ctx.save_for_backward(h, w, b, t, output[1])
    else:
        ctx.save_for_backward(*output[2:])


def _op_backward(ctx, g, *_):
    ignore_index, smoothing, reduction, chunk, mode, backend = ctx.cfg
    if mode == "recompute":
        h, w, b, t, lse = ctx.saved_tensors
        dh, dw, db = _bwd_op(g, h, w, b, t, lse, ignore_index, smoothing, reduction, chunk, backend)
    else:
        dh, dw, db = _scaled(ctx, g, ctx.saved_tensors)
    return dh, dw, (db if ctx.has_bias else None), None, None, None, None, None, None, None


_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ----------------------------------------------------------------------------- public
def _check(h, w, t, b, reduction, smoothing, chunk_size, mode, backend) -> None:
    for name, x in (("hidden", h), ("weight", w)):
        if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() != 2:
            raise TypeError(f"{name} must be a 2-D floating-point tensor, got {_desc(x)}")
    if h.shape[1] != w.shape[1]:
        raise ValueError(
            f"hidden (N, D) {tuple(h.shape)} and weight (V, D) {tuple(w.shape)} differ in D"
        )
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype not in (torch.int64, torch.int32)
        or t.shape != h.shape[:1]
    ):
        raise ValueError(
            f"targets must be an integer tensor of shape ({h.shape[0]},), got {_desc(t)}"
        )
    if b is not None and (not isinstance(b, torch.Tensor) or b.shape != w.shape[:1]):
        raise ValueError(f"bias must have shape ({w.shape[0]},), got {_desc(b)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {smoothing}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    *,
    mode: str = "recompute",
    backend: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ...)`` without ever
    storing the (N, V) logits; hidden (N, D), weight (V, D), targets (N,) -> fp32 loss ()."""
    _check(hidden, weight, targets, bias, reduction, label_smoothing, chunk_size, mode, backend)
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):  # what F.linear does under autocast
        dt = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(
            f"hidden, weight and bias must share a dtype, got {hidden.dtype}, {weight.dtype}"
        )
    if not torch.compiler.is_compiling() and targets.device.type == "cpu":
        # the bounds check of an index op (no host read of the targets; on CUDA, gather's
        # device-side assert is the check)
        idx = torch.where(targets == ignore_index, 0, targets).reshape(-1)
        try:
            torch.index_select(weight.detach()[:, 0], 0, idx)
        except IndexError as e:
            raise IndexError(
                f"targets out of range [0, {weight.shape[0]}) (and not ignore_index)"
            ) from e
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    args = (int(ignore_index), float(label_smoothing), reduction, chunk, mode, backend)
    with torch.autocast(dev, enabled=False):
        if torch.compiler.is_compiling():
            return _fwd_op(hidden, weight, bias, targets, *args)[0]
        with sites.role("chunked_ce"):
            return ChunkedCEFunction.apply(hidden, weight, bias, targets, *args)
