"""slimact.compiled.prac: PRAC as a traced pack/unpack pair inside torch.compile (issue 16).

Fast tests check the traced math against ``codecs/prac_ref.py`` with the same random draws, the
estimator's unbiasedness, the site rules and extreme values, without compiling. The ``slow``
tests compile: an exact reconstruction through the inlined hooks (a low-rank input), and
llama-tiny end to end (no graph breaks, fewer bytes, gradients unbiased over steps, autocast).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import slimact
from slimact import compiled as C
from slimact.codecs.prac_ref import (
    prac_reconstruct_ref,
    random_complement_ref,
    randomized_basis_ref,
)
from slimact.compiled.prac import complement_basis, principal_basis
from slimact.models import build_model

PRAC = C.CODECS["prac"]


def _x(*shape, rank=None, dtype=torch.float32, seed=0):
    """A random tensor; with ``rank``, its rows span ``rank`` directions plus 1e-3 noise."""
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        return torch.randn(*shape, generator=g).to(dtype)
    lead, n = shape[:-1], shape[-1]
    x = torch.randn(*lead, rank, generator=g) @ torch.randn(rank, n, generator=g)
    return (x + 1e-3 * torch.randn(*shape, generator=g)).to(dtype)


def _draw_from(gen):
    return lambda shape, device: torch.randn(*shape, generator=gen).to(device)


def _projector(q):
    return q @ q.T


# ----------------------------------------------------------------------------- math vs reference
@pytest.mark.parametrize("shape", [(600, 64), (3, 170, 96), (1000, 130)])
def test_bases_equal_reference_with_same_draws(shape):
    """Same Ω and S: the range finder spans the reference's subspace, Q2 is the reference's."""
    x = _x(*shape, rank=19).reshape(-1, shape[-1])  # r1 signal directions: a unique subspace
    n, r1, r2 = shape[-1], 19, 11
    q1 = principal_basis(x, r1, 2, 8, _draw_from(torch.Generator().manual_seed(5)))
    ref = randomized_basis_ref(x, r1, torch.Generator().manual_seed(5), niter=2, oversample=8)
    torch.testing.assert_close(_projector(q1), _projector(ref), atol=1e-4, rtol=0)
    torch.testing.assert_close(q1.T @ q1, torch.eye(r1), atol=1e-5, rtol=0)
    q2 = complement_basis(q1, r2, _draw_from(torch.Generator().manual_seed(6)))
    q2_ref = random_complement_ref(q1, n, r2, torch.Generator().manual_seed(6))
    torch.testing.assert_close(q2, q2_ref, atol=1e-5, rtol=0)
    assert (q1.T @ q2).abs().max() < 1e-5  # Q2 lies in Q1's complement


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 300, 96), (2, 333, 101), (1200, 64)])
def test_round_trip_equals_reconstruction_formula(shape, dtype):
    """decode(encode(x)) = XQ1Q1ᵀ + kXQ2Q2ᵀ with the payload's own P (prac_reconstruct_ref)."""
    x = _x(*shape, dtype=dtype)
    ranks = C.prac_ranks(PRAC, x)
    assert ranks is not None
    payload = C.encode_prac(x, *ranks, PRAC.prac)
    z, p, out_dtype, tag = payload
    assert tag == "prac" and out_dtype == dtype
    assert not z.is_floating_point() and not p.is_floating_point()  # the meter's "coded" mark
    z, p = z.view(dtype), p.view(torch.float32)
    assert z.shape == (*shape[:-1], sum(ranks)) and p.shape == (shape[-1], sum(ranks))
    y = C.decode(payload)
    assert y.shape == x.shape and y.dtype == dtype
    q1, q2 = p[:, : ranks[0]], p[:, ranks[0] :]
    ref = prac_reconstruct_ref(x.reshape(-1, shape[-1]), q1, q2).to(dtype).reshape(shape)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref.float(), atol=tol * x.float().abs().max(), rtol=tol)


def test_low_rank_input_is_reconstructed_exactly():
    """X of rank 8 < r1: the principal part carries all of X, the random part only noise."""
    x = _x(5, 200, 80, rank=8)
    y = C.decode(C.encode(PRAC, x))
    assert (y - x).norm() / x.norm() < 2e-3  # the 1e-3 noise floor


def test_unbiased():
    """E[X̃] = X (prac.txt Thm 6): the mean of N draws converges at 1/sqrt(N)."""
    torch.manual_seed(0)
    x = _x(1024, 64)
    one = C.decode(C.encode(PRAC, x))
    err1 = ((one - x).norm() / x.norm()).item()
    mean = sum(C.decode(C.encode(PRAC, x)) for _ in range(256)) / 256
    err = ((mean - x).norm() / x.norm()).item()
    assert err1 > 0.3  # a full-rank X: one draw is noisy
    assert err < 2.0 * err1 / 256**0.5


# ----------------------------------------------------------------------------- site rules
def test_ranks_follow_the_paper_rule():
    tp = C.TracedPrac()
    assert tp.ranks((2048, 512), 4, linear=True) == (153, 153)  # ⌊0.3 n⌋
    assert tp.ranks((2048, 512), 4, linear=False) == (102, 102)  # ⌊0.2 n⌋
    # Z + P not smaller than X: kept (few tokens, or n close to the tokens)
    assert tp.ranks((600, 512), 4, linear=True) is None
    assert tp.ranks((2048, 1376), 4, linear=True) is None
    assert tp.ranks((2048, 6), 4, linear=True) is None  # below min_features
    assert C.TracedPrac(other=0.0).ranks((2048, 512), 4, linear=False) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"linear": 0.5}, "linear"),
        ({"other": -0.1}, "other"),
        ({"niter": -1}, "niter"),
        ({"oversample": 1.5}, "oversample"),
        ({"sketch_rows": -4}, "sketch_rows"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        C.TracedPrac(**kwargs)


def test_feeds_linear_reads_the_graph():
    lin = nn.Linear(16, 16, bias=False)

    def f(x):
        h = F.silu(x)
        return lin(h.view(-1, 16)).sum() + h.sum()

    gm = make_fx(f)(torch.randn(4, 8, 16))
    silu = next(n for n in gm.graph.nodes if "silu" in str(n.target))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert C.feeds_linear(silu)  # through a view into mm
    assert not C.feeds_linear(x)  # read by silu only


def test_sdpa_tensors_and_statistics_are_kept():
    x = _x(2, 300, 64)
    assert C.prac_ranks(PRAC, x[..., :1]) is None  # a statistic
    assert C.prac_ranks(PRAC, x.to(torch.int32)) is None
    assert C.encode(PRAC, x[..., :1])[0] is not None and len(C.encode(PRAC, x[..., :1])) == 1


def test_masks_still_packed_as_bits():
    m = torch.rand(64, 64) > 0.5
    payload = C.encode(PRAC, m)
    assert payload[0].dtype == torch.uint8 and torch.equal(C.decode(payload), m)


# ----------------------------------------------------------------------------- extreme values
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_in_gives_nan_out_not_garbage(bad):
    """The bad value's row decodes to NaN or inf; every other row is as a clean X gives."""
    x = _x(600, 64, rank=8)
    x[3, 5] = bad
    y = C.decode(C.encode(PRAC, x))
    assert not torch.isfinite(y[3]).any()  # NaN (inf in: inf or NaN)
    rest = torch.ones(600, dtype=torch.bool).index_fill(0, torch.tensor([3]), False)
    assert torch.isfinite(y[rest]).all()
    assert (y[rest] - x[rest]).norm() / x[rest].norm() < 2e-3  # rank 8: still exact


def test_huge_values_do_not_overflow():
    """|x| ~ 1e30: XᵀX would overflow fp32; the basis is computed from X / max|X|."""
    x = _x(600, 64, rank=8) * 1e30
    y = C.decode(C.encode(PRAC, x))
    assert torch.isfinite(y).all()
    assert (y.double() - x.double()).norm() / x.double().norm() < 2e-3


# ----------------------------------------------------------------------------- compiled (slow)
@pytest.mark.slow
def test_inlined_hooks_reconstruct_a_low_rank_input_exactly(one_thread):
    """The inlined path end to end: a linear layer's saved input of rank 4 comes back exactly,
    so its weight gradient equals autograd's; a second step gives the same (fresh draws)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = _x(8, 128, 64, rank=4)
    lin(x).square().sum().backward()
    exact = lin.weight.grad.clone()
    fn = torch.compile(lambda t: lin(t).square().sum(), dynamic=False)
    for _ in range(2):
        lin.zero_grad()
        with C.codec_hooks("prac"):
            loss = fn(x)
        saved = C.compiled_saved_tensors(loss)
        assert not any(t.shape == x.shape for t in saved)  # X itself is not kept
        loss.backward()
        torch.testing.assert_close(lin.weight.grad, exact, rtol=5e-3, atol=5e-3 * exact.abs().max())


X = torch.randint(0, 257, (4, 128), generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 257, (4, 128), generator=torch.Generator().manual_seed(2))


def _grads(model, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(X, targets=Y).loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]).double()


def _cos(a, b):
    return float(F.cosine_similarity(a, b, dim=0))


@pytest.mark.slow
def test_llama_tiny_end_to_end(one_thread):
    """No graph breaks, the loss unchanged, fewer bytes than compiled none, and the gradient
    unbiased: the mean over 16 steps is much closer to autograd's than one step (fresh draws
    each step), under fp32 and bf16 autocast."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64
    base = build_model("llama-tiny")
    counters.clear()
    none = slimact.apply(copy.deepcopy(base), "compiled-none")
    prac = slimact.apply(copy.deepcopy(base), "compiled-prac")
    for autocast in (False, True):
        loss_ref, exact = _grads(base, autocast)
        steps = [_grads(prac, autocast) for _ in range(16)]
        torch.testing.assert_close(steps[0][0], loss_ref, rtol=1e-4, atol=1e-5)
        one = _cos(steps[0][1], exact)
        mean = _cos(sum(g for _, g in steps) / len(steps), exact)
        assert 0.2 < one < 0.999  # the codec ran, lossy
        assert 1 - mean < 0.5 * (1 - one)
    assert not counters["graph_break"]
    b_none, _ = C.forward_live_bytes(lambda: none(X, targets=Y).loss)
    b_prac, _ = C.forward_live_bytes(lambda: prac(X, targets=Y).loss)
    assert b_prac < 0.95 * b_none
    before = dict(C.TRACE_CALLS)
    _grads(prac)
    assert C.TRACE_CALLS == before  # inlined: no Python per saved tensor
    with slimact.measure(prac) as m:  # the payloads (integer views) are reported as coded
        _ = prac(X, targets=Y).loss
    graph = [s for s in m.report.sites if ":compiled#" in s.site]
    assert {s.action for s in graph} == {"keep", "codec:compiled"}
