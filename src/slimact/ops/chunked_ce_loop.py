"""The chunk loops of the chunked linear + cross-entropy (``slimact.ops.chunked_ce``, whose
docstring has the math): per chunk of rows, the logits, their statistics (lse, loss) and, in
place, the gradient G·s, then the gradient matmuls.

:func:`chunked_ce_forward` runs the forward of either mode (``recompute``: lse per row;
``precompute``: dh, dW, db right away), :func:`chunked_ce_backward` recompute's backward. Per
chunk they call the Triton kernel (``ops.chunked_ce_triton``: CUDA tensors, or
``backend="triton"``) or the plain-PyTorch references :func:`ce_stats_ref` / :func:`ce_grad_ref_`.
"""

from __future__ import annotations

import torch

from slimact.ops import device_path
from slimact.ops.chunked_ce_triton import ce_chunk_triton, triton_available


def ce_stats_ref(
    z: torch.Tensor, t: torch.Tensor, ignore_index: int, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """z: (C, V) fp32 logits, t: (C,) -> lse (C,), per-row loss (C,) (0 where ignored)."""
    lse = torch.logsumexp(z, -1)
    valid = t != ignore_index
    zt = z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
    loss = lse - (1.0 - smoothing) * zt
    if smoothing:
        loss = loss - smoothing * z.mean(-1)
    return lse, torch.where(valid, loss, 0.0)


def ce_grad_ref_(
    z: torch.Tensor,
    t: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    smoothing: float,
) -> torch.Tensor:
    """Overwrite z (C, V) fp32 with G·scale (softmax − (1−ε)·onehot − ε/V); ignored rows 0."""
    valid = t != ignore_index
    z.sub_(lse[:, None]).exp_()
    if smoothing:
        z.sub_(smoothing / z.shape[1])
    z.scatter_add_(1, torch.where(valid, t, 0)[:, None], z.new_full((z.shape[0], 1), smoothing - 1))
    return z.mul_(torch.where(valid, scale.float(), 0.0)[:, None])


def _use_triton(z: torch.Tensor, backend: str) -> bool:
    if backend == "torch" or z.dtype == torch.float64:
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' but triton is not installed (pip install triton)")
        return True
    return device_path.takes_cuda_path(z) and triton_available()


def _stats(z, t, ignore_index, smoothing, backend):
    if _use_triton(z, backend):
        return ce_chunk_triton(z, t, ignore_index, smoothing)[:2]
    return ce_stats_ref(z, t, ignore_index, smoothing)


def _grad_(z, t, lse, scale, ignore_index, smoothing, backend):
    """z -> G·scale in place; lse None: computed here (returns lse, loss) else None, None."""
    if _use_triton(z, backend):
        return ce_chunk_triton(z, t, ignore_index, smoothing, lse=lse, scale=scale)[:2]
    loss = None
    if lse is None:
        lse, loss = ce_stats_ref(z, t, ignore_index, smoothing)
    ce_grad_ref_(z, t, lse, scale, ignore_index, smoothing)
    return lse, loss


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # h: (C, D), w: (V, D) -> (C, V) fp32 (a copy only for low-precision inputs)
    z = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    return z.float()


def _acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    # acc (V, D) fp32 += a (V, C) @ b (C, D): in place (no V x D temporary) when a, b are fp32
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32)


# ----------------------------------------------------------------------------- implementation
def chunked_ce_forward(h, w, b, t, ignore_index, smoothing, reduction, chunk, mode, backend):
    """h (N, D), w (V, D), b (V,) | None, t (N,) -> (loss (), lse (N,), dh, dW, db).

    recompute: lse filled, the grads empty. precompute: dh (N, D) in h's dtype, dW (V, D) and
    db (V,) in fp32, already scaled by 1/|S| ("mean"), lse empty."""
    n = h.shape[0]
    count = (t != ignore_index).sum()
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    pre = mode == "precompute"
    lse = _empty(h) if pre else torch.empty(n, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if pre else _empty(h)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if pre else _empty(h)
    db = (
        torch.zeros(w.shape[0], dtype=torch.float32, device=h.device)
        if pre and b is not None
        else _empty(h)
    )
    scale = (1.0 / count if reduction == "mean" else torch.ones((), device=h.device)).float()
    for s in range(0, n, chunk):
        hc, tc = h[s : s + chunk], t[s : s + chunk]
        z = _logits(hc, w, b)  # (C, V) fp32
        if pre:
            _, loss = _grad_(z, tc, None, scale, ignore_index, smoothing, backend)
            g = z.to(h.dtype)
            torch.mm(g, w, out=dh[s : s + chunk])
            _acc_(dw, g.t(), hc)
            if b is not None:
                db.add_(z.sum(0))
        else:
            lse_c, loss = _stats(z, tc, ignore_index, smoothing, backend)
            lse[s : s + chunk] = lse_c
        total += loss.sum()
    loss = total / count if reduction == "mean" else total
    return loss, lse, dh, dw, db


def chunked_ce_backward(
    g, h, w, b, t, lse, ignore_index, smoothing, reduction, chunk, backend, needs
):
    """recompute's backward: g () -> dh (N, D), dW (V, D), db (V,) (None where not ``needs``)."""
    n = h.shape[0]
    count = (t != ignore_index).sum()
    scale = g.float() / count if reduction == "mean" else g.float()
    need_h, need_w, need_b = needs
    dh = torch.empty_like(h) if need_h else None
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
    db = torch.zeros(w.shape[0], dtype=torch.float32, device=h.device) if need_b else None
    for s in range(0, n, chunk):
        hc = h[s : s + chunk]
        z = _logits(hc, w, b)
        _grad_(z, t[s : s + chunk], lse[s : s + chunk], scale, ignore_index, smoothing, backend)
        gz = z.to(h.dtype)  # (C, V)
        if dh is not None:
            torch.mm(gz, w, out=dh[s : s + chunk])
        if dw is not None:
            _acc_(dw, gz.t(), hc)
        if db is not None:
            db.add_(z.sum(0))
    return (
        dh,
        None if dw is None else dw.to(w.dtype),
        None if db is None else db.to(b.dtype),
    )


__all__ = ["ce_grad_ref_", "ce_stats_ref", "chunked_ce_backward", "chunked_ce_forward"]
