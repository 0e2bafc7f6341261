"""The inverted activations inside torch.compile: opaque forward, traced backward (inv_act_traced)."""

import pytest
import torch
import torch.nn.functional as F

from slimact.compiled import compiled_saved_tensors
from slimact.ops import compiled_ref as ic
from slimact.ops import inv_act_approx as ap
from slimact.ops import inv_act_traced as it
from slimact.ops.inv_act import inv_act, inv_act_bwd_ref, inv_act_fwd_ref

TOL = {torch.float32: 3e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}
DYNAMO = pytest.importorskip("torch._dynamo")


def _x(n, dtype, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    x[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -1e30, 0.0, -0.0, 1e30, -90])
    return x.to(dtype)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 1001])
def test_planar_bits_layout(n):
    s = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    p = it.pack_bits_planar_ref(s)
    m = (n + 7) // 8
    assert p.dtype == torch.uint8 and p.numel() == m  # the same n/8 bytes as the §2 layout
    want = [sum(int(s[k * m + j]) << k for k in range(8) if k * m + j < n) for j in range(m)]
    assert p.tolist() == want  # element i is bit i // m of byte i % m
    assert torch.equal(it.unpack_bits_planar_ref(p, n), s)


@pytest.mark.parametrize("kind", ap.KINDS)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("n", [3 * 5 * 7 * 11 * 13, 1 << 14])  # n % 8 != 0 and == 0
def test_traced_backward_matches_ref(kind, dtype, n):
    """fwd_graph_ref + inv_act_bwd_graph (eager) against the §2 refs: same y, same bits, dx
    within the table's tolerance of the Newton reference, NaN where it is NaN."""
    x = _x(n, dtype).view(-1, 5) if n % 5 == 0 else _x(n, dtype)
    y, side = it.fwd_graph_ref(x, kind)
    y0, side0 = inv_act_fwd_ref(x, kind)
    fin = ~y0.isnan()
    assert torch.equal(y[fin], y0[fin])
    s0 = (x.float() if dtype != torch.float64 else x) < ap.BRANCH[kind].T
    assert torch.equal(it.unpack_bits_planar_ref(side, n).view(x.shape), s0)
    dy = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    d0 = inv_act_bwd_ref(dy, y0, side0, kind)
    d1 = it.inv_act_bwd_graph(dy, y, side, ap.newton_table(kind), kind)
    assert d1.dtype == dtype and d1.shape == x.shape
    assert not bool((d1.isnan() & ~d0.isnan()).any())
    ok = ~d0.isnan()
    tol = TOL[dtype] * dy[ok].double().abs() + 2 * torch.finfo(dtype).eps * d0[ok].double().abs()
    assert bool(((d1[ok].double() - d0[ok].double()).abs() <= tol + 1e-30).all())


def test_op_opcheck():
    x = torch.randn(3, 41, 7)
    for kind in ap.KINDS:
        torch.library.opcheck(it._fwd_op, (x, ap.newton_table(kind), kind))


def test_eligible():
    big = torch.empty(ic.MIN_NUMEL)
    assert it.eligible(big, "newton", "bitmask", "auto")
    assert it.eligible(big.bfloat16(), "newton", "bitmask", "inductor")
    assert not it.eligible(big[:10], "newton", "bitmask", "auto")  # small: the Newton ref
    assert not it.eligible(big.double(), "newton", "bitmask", "auto")
    assert not it.eligible(big, "paper", "bitmask", "auto")
    assert not it.eligible(big, "newton", "lsb", "auto")
    assert not it.eligible(big, "newton", "bitmask", "torch")


class SwiGLU(torch.nn.Module):
    def __init__(self, d, f, kind="silu", inverted=True):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.up = torch.nn.Linear(d, f), torch.nn.Linear(d, f)
        self.down = torch.nn.Linear(f, d)
        self.kind, self.inverted = kind, inverted

    def forward(self, x):
        g = self.gate(x)
        act = inv_act(g, self.kind) if self.inverted else ap.act_ref(g, self.kind)
        return self.down(act * self.up(x))


def _grads(model, x, compiled=None, dtype=None):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    fn = model if compiled is None else compiled
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = fn(x).float().pow(2).mean()
    saved = compiled_saved_tensors(loss)
    loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())], saved


def _check(got, want, rel):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        err = float((g.double() - w.double()).abs().max())
        assert err <= rel * float(w.double().abs().max()) + 1e-12, (err, rel)


@pytest.mark.parametrize(
    "kind,shape,f,dtype,rel",
    [
        ("silu", (3, 37, 24), 151, None, 1e-4),  # 3·37·151 = 16761 gate elements: n % 8 != 0
        ("silu", (4, 64, 24), 80, torch.bfloat16, 3e-2),  # bf16 autocast, n % 8 == 0
        ("gelu_tanh", (2, 50, 24), 200, None, 1e-4),
    ],
)
def test_compiled_block_gradients_match_autograd(kind, shape, f, dtype, rel):
    """A SwiGLU with the inverted activation, compiled (fullgraph: no graph breaks): every
    gradient against exact autograd of the same block with torch's own activation; what the
    compiled graph saves includes the packed bits (1 bit per gate element)."""
    d = shape[-1]
    x = torch.randn(*shape)
    want, _ = _grads(SwiGLU(d, f, kind, inverted=False), x, dtype=dtype)
    model = SwiGLU(d, f, kind)
    n = x[..., :1].numel() * f
    assert n >= ic.MIN_NUMEL
    DYNAMO.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got, saved = _grads(model, x, compiled, dtype)
    assert [t.numel() for t in saved if t.dtype == torch.uint8] == [(n + 7) // 8]
    _check(got, want, rel)


@pytest.mark.slow
def test_inductor_saves_output_and_bits_not_input():
    """Under inductor's min-cut partitioner the opaque forward's y and bits are what is kept:
    not the activation's input, and no more float bytes than torch's own SiLU compiled."""
    x = torch.randn(4, 64, 32)
    sizes = {}
    for inverted in (False, True):
        model = SwiGLU(32, 96, inverted=inverted)
        DYNAMO.reset()
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        got, saved = _grads(model, x, compiled)
        want, _ = _grads(SwiGLU(32, 96, inverted=False), x)
        _check(got, want, 1e-4)
        gate = model.gate(x).detach()
        floats = [
            t.reshape(gate.shape)
            for t in saved
            if t.is_floating_point() and t.numel() == gate.numel()
        ]
        sizes[inverted] = sum(t.numel() for t in floats)
        if inverted:
            bits = [t for t in saved if t.dtype == torch.uint8]
            assert [t.numel() for t in bits] == [gate.numel() // 8]
            assert not any(torch.equal(t, gate) for t in floats)  # x of the SiLU is not kept
            assert any(torch.allclose(t, F.silu(gate), atol=1e-6) for t in floats)  # y is
    assert sizes[True] <= sizes[False], sizes


def test_table_reads_are_guarded_by_the_table_shape():
    """dinv_table reads the table unchecked (no per-lane bounds check): a table of another shape
    is refused up front."""
    y = torch.randn(10)
    with pytest.raises(ValueError, match="newton_table"):
        ap.dinv_table(y, y < 0, "silu", ap.newton_table("silu")[:-1])
