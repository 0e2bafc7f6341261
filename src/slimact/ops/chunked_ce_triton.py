"""Triton kernel for one chunk of the chunked linear + cross-entropy (``slimact.ops.chunked_ce``).

One program per row of a (C, V) fp32 logits chunk z, streaming the row in blocks of ``BLOCK``:

* stats pass (unless the row's lse is given): online max m and sum s of exp(z − m), so
  lse = m + log s; the sum of z (for label smoothing ε); the target's logit z_t. The row's loss is
  lse − (1−ε)·z_t − (ε/V)·Σ_c z_c, 0 for an ignored row.
* gradient pass (when a scale is given): z is overwritten in place with
  (exp(z − lse) − (1−ε)·[c = t] − ε/V)·scale, 0 for an ignored row. The scale is read from a
  0-d tensor (grad_output / |S|), so no host synchronisation is needed.

The kernel is defined on first use, so ``TRITON_INTERPRET=1`` set by a test is read then.
Targets are not range-checked here (an out-of-range target reads outside its row).
"""

from __future__ import annotations

import importlib.util

import torch

_KERNELS: dict = {}
MAX_BLOCK = 4096


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _build() -> None:
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_chunk_kernel(
        z_ptr,
        stride,
        t_ptr,
        lse_ptr,
        loss_ptr,
        scale_ptr,
        V,
        ignore_index,
        eps,
        HAS_LSE: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
        SMOOTH: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        zr = z_ptr + row * stride
        t = tl.load(t_ptr + row).to(tl.int64)
        valid = t != ignore_index
        if HAS_LSE:
            lse = tl.load(lse_ptr + row)
        else:
            m = float("-inf")
            s = 0.0
            zsum = 0.0
            for off in range(0, V, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = tl.load(zr + cols, mask=cols < V, other=float("-inf"))
                m_new = tl.maximum(m, tl.max(x, 0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
                m = m_new
                if SMOOTH:
                    zsum += tl.sum(tl.where(cols < V, x, 0.0), 0)
            lse = m + tl.log(s)
            tl.store(lse_ptr + row, lse)
            zt = tl.load(zr + tl.where(valid, t, 0))
            loss = lse - (1.0 - eps) * zt
            if SMOOTH:
                loss = loss - eps * zsum / V
            tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        if WRITE_GRAD:
            scale = tl.where(valid, tl.load(scale_ptr), 0.0)
            for off in range(0, V, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = tl.load(zr + cols, mask=cols < V, other=0.0)
                g = tl.exp(x - lse)
                if SMOOTH:
                    g = g - eps / V
                g = tl.where(cols == t, g - (1.0 - eps), g)
                g = tl.where(valid, g * scale, 0.0)
                tl.store(zr + cols, g, mask=cols < V)

    _KERNELS["chunk"] = _ce_chunk_kernel


def ce_chunk_triton(
    z: torch.Tensor,
    t: torch.Tensor,
    ignore_index: int,
    smoothing: float,
    lse: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z: (C, V) fp32 (row-contiguous), t: (C,) -> (lse (C,), per-row loss (C,) or None).

    ``lse`` given: the stats pass is skipped (loss None). ``scale`` (0-d) given: z becomes G·scale.
    """
    if not _KERNELS:
        _build()
    c, v = z.shape
    if z.stride(1) != 1:
        raise ValueError("ce_chunk_triton needs rows with unit stride")
    has_lse = lse is not None
    lse_out = lse if has_lse else torch.empty(c, dtype=torch.float32, device=z.device)
    loss = None if has_lse else torch.empty(c, dtype=torch.float32, device=z.device)
    block = min(triton.next_power_of_2(v), MAX_BLOCK)
    if c:
        _KERNELS["chunk"][(c,)](
            z,
            z.stride(0),
            t.contiguous(),
            lse_out,
            lse_out if loss is None else loss,
            lse_out if scale is None else scale.float().reshape(()),
            v,
            ignore_index,
            float(smoothing),
            HAS_LSE=has_lse,
            WRITE_GRAD=scale is not None,
            SMOOTH=smoothing != 0.0,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return lse_out, loss
