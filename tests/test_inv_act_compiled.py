"""The inverted activations' CPU path: the refs compiled by inductor, against the refs."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from slimact.ops import compiled_ref as ic
from slimact.ops import inv_act_approx as ap
from slimact.ops import inv_act_poly as ip
from slimact.ops.inv_act import (
    _bwd,
    _fwd,
    _path,
    act_ref,
    inv_act,
    inv_act_bwd_ref,
    inv_act_fwd_ref,
)
from slimact.ops.inv_act_ref import pack_bits_ref, unpack_bits_ref

pytestmark = pytest.mark.compiled_refs  # the compiled CPU path itself

# L∞ of g = f'(f⁻¹(y)) against the float64 truth at the dtype's x (the conditioning floor)
TOL = {torch.float32: 3e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}


def _x(n, dtype, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    x[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -1e30, 0.0, -0.0, 1e30, -90])
    return x.to(dtype)


def _dinv_grid(kind, dtype):
    """y, branch bits, the float64 truth of f'(f⁻¹(y)), the Newton ref's and the table's, on a
    dense grid plus the far left tail."""
    x = torch.cat(
        [torch.linspace(-12, 25, 100001, dtype=torch.float64), -torch.logspace(1, 2, 500)]
    )
    x = x.to(dtype)
    y, s = act_ref(x, kind), x.double() < ap.BRANCH[kind].T
    true = ap.exact_df(x.double(), kind)
    ref = ap.dinv_ref(y, s, kind).double()
    return y, s, true, ref, ap.dinv_table(y, s, kind, ap.newton_table(kind)).double()


@pytest.mark.parametrize("kind", ap.KINDS)
@pytest.mark.parametrize("dtype", list(TOL))
def test_table_matches_newton_ref_and_truth(kind, dtype):
    """The interpolated table (eager here) is as accurate as the Newton solve it tabulates."""
    _, _, true, ref, tab = _dinv_grid(kind, dtype)
    assert float((tab - true).abs().max()) <= TOL[dtype]
    assert float((tab - ref).abs().max()) <= max(2e-5, 0.3 * TOL[dtype])
    assert float((tab - true).pow(2).mean().sqrt()) < 2e-6 if dtype == torch.float32 else True


@pytest.mark.parametrize("kind", ap.KINDS)
@pytest.mark.parametrize("dtype", list(TOL))
def test_poly_matches_newton_ref_and_truth(kind, dtype):
    """The piecewise polynomials (eager here; what the compiled backward evaluates) are as
    accurate as the Newton solve they fit, and no worse than the table they replaced."""
    y, s, true, ref, tab = _dinv_grid(kind, dtype)
    pol = ip.dinv_poly(y, s, kind, ip.poly_floats(kind)).double()
    assert float((pol - true).abs().max()) <= TOL[dtype]
    assert float((pol - ref).abs().max()) <= max(2e-5, 0.3 * TOL[dtype])
    assert float((pol - true).pow(2).mean().sqrt()) < 2e-6 if dtype == torch.float32 else True
    rms = (pol - true).pow(2).mean().sqrt(), (tab - true).pow(2).mean().sqrt()
    assert float(rms[0]) <= 1.01 * float(rms[1])


@pytest.mark.parametrize("kind", ap.KINDS)
def test_poly_fit_error_in_float64(kind):
    """The fit itself (y exact, no fp32 conditioning): ≤ 1e-6 from the 12-step Newton solve on
    both branches, the tail included, and the special values of the table. y is taken at fp32
    values: dinv_poly computes in fp32, and rounding y near f(T) is the conditioning floor."""
    b = ap.BRANCH[kind]
    y = torch.cat([b.fT + torch.linspace(0, 4.7, 20001, dtype=torch.float64) ** 2])
    for left in (False, True):
        yy = y[y < 0] if left else y
        yy = torch.cat([yy, -torch.logspace(-30, -1, 2000, dtype=torch.float64)]) if left else yy
        yy = yy.float().double()
        s = torch.full_like(yy, left, dtype=torch.bool)
        pol = ip.dinv_poly(yy, s, kind, ip.poly_floats(kind)).double()
        want = ap.dinv_newton_ref(yy, s, kind, 12)
        assert float((pol - want).abs().max()) <= 1e-6
    special = torch.tensor([float("nan"), float("inf"), 0.0, 1e-30])
    s = torch.tensor([False, False, True, True])
    g = ip.dinv_poly(special, s, kind, ip.poly_floats(kind))
    assert bool(g[0].isnan()) and g[1:].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 1001])
def test_pack_bits_ref_layout(n):
    s = torch.rand(n) < 0.5
    p = pack_bits_ref(s)
    assert p.dtype == torch.uint8 and p.numel() == (n + 7) // 8
    assert torch.equal(unpack_bits_ref(p, n), s)
    want = [sum(int(s[8 * j + k]) << k for k in range(min(8, n - 8 * j))) for j in range(p.numel())]
    assert p.tolist() == want


def test_paths():
    big = torch.empty(ic.MIN_NUMEL)
    assert _path(big, "auto", "bitmask") == "inductor"
    assert _path(big[:10], "auto", "bitmask") == "torch"  # small: eager ref
    assert _path(big.double(), "auto", "bitmask") == "torch"  # fp64: the Newton ref
    assert _path(big, "torch", "bitmask") == "torch"
    assert _path(big[:10], "inductor", "lsb") == "inductor"


@pytest.mark.parametrize(
    "kind,mode,variant,dtype,n",
    [
        ("silu", "newton", "bitmask", torch.float32, 3 * 5 * 7 * 11 * 13),  # n % 8 != 0
        ("silu", "newton", "bitmask", torch.bfloat16, 1 << 14),
        ("gelu", "paper", "lsb", torch.float32, 1 << 14),
        ("gelu_tanh", "newton", "near-branch", torch.bfloat16, 20001),
    ],
)
def test_compiled_matches_ref(kind, mode, variant, dtype, n):
    x = _x(n, dtype)
    y0, side0 = inv_act_fwd_ref(x, kind, variant)
    y1, side1 = _fwd(x, kind, variant, "inductor")
    fin = ~y0.isnan()
    assert torch.equal(y1[fin], y0[fin])  # bit-identical forward (lsb included)
    if side0 is not None:
        assert torch.equal(side1, side0)
    dy = torch.randn(n, dtype=torch.float64).to(dtype)
    d0 = inv_act_bwd_ref(dy, y0, side0, kind, mode, variant)
    d1 = _bwd(dy, y1, side1, kind, mode, variant, "inductor")
    assert ic.available(), ic._BROKEN  # compiled, not the eager fallback (which is also exact)
    assert d1.dtype == dtype and d1.shape == x.shape
    # NaN where the ref is NaN, except tanh-GELU past |x| ~ 1e13 (x³ overflows in the ref and in
    # torch's own backward; the table returns the true limit 1)
    assert not bool((d1.isnan() & ~d0.isnan()).any())
    assert bool((d0.isnan() == d1.isnan())[x.abs() < 1e13].all())
    ok = ~d0.isnan()
    tol = TOL[dtype] * dy[ok].double().abs() + 2 * torch.finfo(dtype).eps * d0[ok].double().abs()
    assert bool(((d1[ok].double() - d0[ok].double()).abs() <= tol + 1e-30).all())


def test_autograd_uses_compiled_path_and_matches_torch():
    x = (torch.randn(4, 64, 80) * 2).requires_grad_(True)
    assert x.numel() >= ic.MIN_NUMEL
    y = inv_act(x, "silu")
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(F.silu(x2), x2, dy)
    assert torch.equal(y, F.silu(x.detach()))
    assert float((g - want).abs().max()) <= 3e-4 * float(dy.abs().max())
    assert any(fn is not None for fn in ic._COMPILED.values())
    assert ic.available(), ic._BROKEN  # the compiled calls ran (no silent eager fallback)


def test_compile_failure_falls_back_with_one_warning(monkeypatch):
    def broken(fn, **kw):
        def run(*args):
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(ic, "_COMPILED", {})
    monkeypatch.setattr(ic, "_BROKEN", [])
    monkeypatch.setattr(ic, "_WORKED", [])  # no compiled call has succeeded: the compiler is out
    monkeypatch.setattr(ic, "_EAGER_KEYS", {})
    monkeypatch.setattr(torch, "compile", broken)
    x = _x(1 << 14, torch.float32)
    with pytest.warns(RuntimeWarning, match="eager PyTorch reference"):
        y, side = _fwd(x, "silu", "bitmask", "inductor")
    assert not ic.available()
    y0, side0 = inv_act_fwd_ref(x, "silu", "bitmask")
    assert torch.equal(side, side0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        dx = _bwd(torch.ones_like(y), y, side, "silu", "newton", "bitmask", "inductor")
    assert torch.allclose(
        dx, inv_act_bwd_ref(torch.ones_like(y), y0, side0, "silu"), atol=1e-5, equal_nan=True
    )


def test_nothing_compiles_at_import():
    code = (
        "import slimact, slimact.strategies\n"
        "from slimact.ops import compiled_ref as ic, inv_act_approx as ap\n"
        "import sys\n"
        "assert not ic._COMPILED and not ap._TABLES, (ic._COMPILED, ap._TABLES)\n"
        "assert 'slimact.ops.inv_act_triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
