"""Inverted GELU / tanh-GELU / SiLU: forward exact, gradients vs torch autograd, kernels, memory."""

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

if not torch.cuda.is_available():  # the Triton kernels run on CPU through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import slimact
from slimact.modules import InvGELU, InvSiLU
from slimact.ops import inv_act_approx as ap
from slimact.ops.inv_act import (
    act_ref,
    inv_act,
    inv_act_bwd_ref,
    inv_act_bwd_triton,
    inv_act_fwd_ref,
    inv_act_fwd_triton,
    inv_gelu,
    inv_silu,
    triton_available,
)
from slimact.ops.inv_act_ref import pack_bits_ref, unpack_bits_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device (real or interpreted)
KINDS = ap.KINDS
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# L∞ of dx/dy against exact autograd on N(0, 3²) inputs. newton: the y-rounding floor near T
# (see inv_act_approx docstring); paper: the fit's own error (Eqs. 5-8).
NEWTON_TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2, torch.float64: 1e-6}
PAPER_TOL = {torch.float32: 3e-2, torch.bfloat16: 5e-2, torch.float16: 4e-2, torch.float64: 3e-2}

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _torch_grad(x, kind, dy):
    x = x.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(act_ref(x, kind), x, dy)
    return g


def _inv_grad(x, kind, dy, **kw):
    x = x.detach().requires_grad_(True)
    y = inv_act(x, kind, **kw)
    (g,) = torch.autograd.grad(y, x, dy)
    return y, g


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1001])
def test_pack_unpack_roundtrip(n):
    s = torch.rand(n) < 0.5
    p = pack_bits_ref(s)
    assert p.dtype == torch.uint8 and p.numel() == (n + 7) // 8
    assert torch.equal(unpack_bits_ref(p, n), s)
    if n >= 8:  # paper §2 layout: element i is bit i % 8 of byte i // 8
        assert int(p[0]) == sum(int(s[i]) << i for i in range(8))


@pytest.mark.parametrize("kind", KINDS)
def test_branch_constants(kind):
    # T solves f'(T) = 0 on [-3, -0.1]; re-derive it in float64 by bisection
    lo, hi = torch.tensor(-3.0, dtype=torch.float64), torch.tensor(-0.1, dtype=torch.float64)
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ap.exact_df(mid, kind) < 0 else (lo, mid)
    b = ap.BRANCH[kind]
    assert abs(float(lo) - b.T) < 1e-9
    assert abs(float(act_ref(lo, kind)) - b.fT) < 1e-12
    h = 1e-5
    c = (ap.exact_df(lo + h, kind) - ap.exact_df(lo - h, kind)) / (2 * h)
    assert abs(float(c) - b.C) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("mode", ap.MODES)
@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 8), (1,), ()])
def test_forward_exact_and_grad_vs_torch(kind, dtype, mode, shape):
    x = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype)
    dy = torch.randn(shape, dtype=torch.float64).to(dtype)
    y, g = _inv_grad(x, kind, dy, mode=mode)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, act_ref(x, kind))  # bit-identical forward
    want = _torch_grad(x, kind, dy)
    tol = (NEWTON_TOL if mode == "newton" else PAPER_TOL)[dtype]
    err = (g.double() - want.double()).abs()
    # the approximation error scales with |dy|; rounding dx to its dtype adds ~1 ulp of |dx|
    bound = tol * dy.double().abs() + 2 * torch.finfo(dtype).eps * want.double().abs()
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


@pytest.mark.parametrize("kind", KINDS)
def test_default_mode_meets_fp32_bar_and_paper_does_not(kind):
    """Done-when: default mode's derivative L∞ <= 1e-3 on [-10, 10] in fp32."""
    x = torch.linspace(-10, 10, 20001)
    y, s = act_ref(x, kind), x < ap.BRANCH[kind].T
    true = ap.exact_df(x.double(), kind)
    newton = (ap.dinv_ref(y, s, kind, "newton").double() - true).abs()
    paper = (ap.dinv_ref(y, s, kind, "paper").double() - true).abs()
    assert float(newton.max()) <= 1e-3
    assert float(newton.pow(2).mean().sqrt()) < 1e-5
    assert float(paper.max()) < 3e-2  # the paper's fits, as measured (Fig. 2)
    if kind != "silu":  # GELU fits peak at T at ~2e-2: the reason paper is not the default
        assert float(paper.max()) > 1e-3


def test_silu_paper_tables_are_relabelled():
    """App. A.2 prints SiLU's 5-coefficient set as q_left; taken literally the fit is useless."""
    x = torch.linspace(-10, 10, 4001, dtype=torch.float64)
    y, true = F.silu(x), ap.exact_df(x, "silu")
    t = (y - ap.BRANCH["silu"].fT).clamp_min(0)
    c = ap.PAPER_SILU_RIGHT[:4]  # 5-coefficient set forced into Eq. 7 (x < T)
    literal_left = (c[0] + c[1] * t.sqrt() + c[2] * t + c[3] * t * t) * (1 - y) + y
    left = x < ap.BRANCH["silu"].T
    assert float((literal_left - true)[left].abs().max()) > 0.5
    ours = ap.dinv_paper_ref(y, left, "silu")
    assert float((ours - true).abs().max()) < 3e-3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_match_torch(kind, dtype):
    T = ap.BRANCH[kind].T
    vals = [-math.inf, -1e30, -30.0, -12.0, -5.0, -0.0, 0.0, T, 1e-30, 20.0, 1e30, math.inf]
    x = torch.tensor(vals + [math.nan], dtype=dtype)
    dy = torch.ones_like(x)
    y, g = _inv_grad(x, kind, dy)
    want = _torch_grad(x, kind, dy)
    assert torch.equal(y.isnan(), act_ref(x, kind).isnan())
    fin = torch.isfinite(want)
    assert torch.allclose(g[fin].double(), want[fin].double(), atol=NEWTON_TOL[dtype], rtol=0)
    assert torch.isnan(g[-1])  # NaN in -> NaN out


def test_noncontiguous_and_empty():
    x = torch.randn(6, 10).t()  # non-contiguous
    dy = torch.randn(10, 6)
    y, g = _inv_grad(x, "silu", dy)
    assert torch.equal(y, F.silu(x.contiguous()))  # computed on the contiguous copy
    assert torch.allclose(y, F.silu(x), rtol=1e-6, atol=0)  # torch's strided path: ±1 ulp
    assert torch.allclose(g, _torch_grad(x, "silu", dy), atol=2e-4)
    e = torch.empty(0, 4, requires_grad=True)
    inv_silu(e).sum().backward()
    assert e.grad.shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_integer_input_raises(dtype):
    with pytest.raises(TypeError, match="floating-point"):
        inv_gelu(torch.zeros(4, dtype=dtype))


def test_bad_arguments_raise():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="approximate"):
        inv_gelu(x, "erf")
    with pytest.raises(ValueError, match="mode"):
        inv_silu(x, mode="halley")
    with pytest.raises(ValueError, match="variant"):
        inv_silu(x, variant="sign")
    with pytest.raises(ValueError, match="approximate"):
        InvGELU("fast")


def test_saves_output_storage_and_packed_bits_only():
    x = torch.randn(4, 33, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = inv_gelu(x)
    assert len(saved) == 2
    assert saved[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert saved[1].dtype == torch.uint8 and saved[1].numel() == (4 * 33 + 7) // 8
    assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for t in saved)


@pytest.mark.parametrize("act,inv", [(nn.GELU(), InvGELU()), (nn.SiLU(), InvSiLU())])
def test_meter_act_then_linear_saves_x_minus_one_bit(act, inv):
    lin = nn.Linear(64, 16)
    x = torch.randn(8, 64, requires_grad=True)

    def bytes_of(a):
        model = nn.Sequential(a, lin)
        with slimact.measure(model) as m:
            model(x).sum().backward()
        return m.report.total_bytes

    base, ours = bytes_of(act), bytes_of(inv)
    n = x.numel()
    assert base == 2 * n * 4  # GELU saves x, Linear saves y
    assert ours == n * 4 + (n + 7) // 8  # y once (shared) + 1 bit per element


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lsb_variant(kind, dtype):
    x = (torch.randn(4, 129) * 3).to(dtype).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = inv_act(x, kind, variant="lsb")
    assert len(saved) == 1 and saved[0].untyped_storage().data_ptr() == y.data_ptr()
    ref = act_ref(x.detach(), kind)
    iv = {torch.float32: torch.int32}.get(dtype, torch.int16)
    ulps = (y.detach().view(iv).long() - ref.view(iv).long()).abs()
    assert int(ulps.max()) <= 1  # the forward pays at most 1 ulp
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, dy)
    want = _torch_grad(x, kind, dy)
    assert float((g.double() - want.double()).abs().max()) <= 3 * NEWTON_TOL[dtype] * float(
        dy.abs().max()
    ) + 1e-3 * (dtype != torch.float32)


def test_no_grad_path_is_plain_torch():
    x = torch.randn(5, 7)
    assert torch.equal(inv_gelu(x, "tanh"), F.gelu(x, approximate="tanh"))


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ap.MODES)
@pytest.mark.parametrize("variant", ["bitmask", "lsb"])
def test_triton_kernels_match_ref(kind, dtype, mode, variant):
    n = 2051  # not a multiple of the block or of 8
    x = (torch.randn(n) * 4).to(dtype)
    x[:6] = torch.tensor([math.nan, math.inf, -30.0, 0.0, ap.BRANCH[kind].T, -3.0]).to(dtype)
    x = x.to(DEV)
    y_ref, p_ref = inv_act_fwd_ref(x, kind, variant)
    y_tri, p_tri = inv_act_fwd_triton(x, kind, variant)
    ulp = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    fin = torch.isfinite(y_ref)
    assert torch.allclose(y_tri[fin].float(), y_ref[fin].float(), rtol=2 * ulp, atol=1e-6)
    if variant == "bitmask":  # T compared in fp32 by both
        assert torch.equal(p_tri, p_ref)
    dy = torch.randn(n).to(dtype).to(DEV)
    d_ref = inv_act_bwd_ref(dy, y_ref, p_ref, kind, mode, variant)
    d_tri = inv_act_bwd_triton(dy, y_ref, p_ref, kind, mode, variant)
    assert torch.equal(d_ref.isnan(), d_tri.isnan())
    ok = ~d_ref.isnan()
    assert torch.allclose(d_tri[ok].float(), d_ref[ok].float(), rtol=2 * ulp, atol=5e-5)


@needs_triton
def test_triton_backend_autograd_end_to_end():
    x = torch.randn(3, 50, device=DEV, requires_grad=True)
    y = inv_gelu(x, "tanh", backend="triton")
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, dy)
    assert torch.allclose(y, F.gelu(x, approximate="tanh"), atol=1e-6)
    assert torch.allclose(g, _torch_grad(x, "gelu_tanh", dy), atol=3e-4)
