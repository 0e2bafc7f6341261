"""PRAC codec: the theory of prac.txt (Thm 6/13, 14, 15/16, Lemma 3) checked by Monte Carlo, plus
memory, bad input, NaN handling, checkpoints and dtypes.

Tolerances come from Theorem 15: one draw has E‖X̃ − X‖² = V = (k − 1)‖X − XQ1Q1ᵀ‖², so the mean
of N independent draws has E‖X̄ − X‖² = V/N. The tests allow 4·V/N (Markov: a 25% event for a
random seed; the seeds are fixed) and show, with the same tolerance, that a biased estimator
(the wrong scale k = 1, or PAC) fails, so the check can fail.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
import torch.nn as nn

import slimact
from slimact.codecs import get_codec
from slimact.codecs.prac import (
    PacCodecConfig,
    PracCodec,
    PracCodecConfig,
    RacCodecConfig,
    prac_reconstruct_ref,
    principal_basis_ref,
    random_complement_ref,
    randomized_basis_ref,
)
from slimact.strategies.prac import PracConfig, prac_report, prac_state

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: 1 thread is faster


def spectrum_matrix(t: int, n: int, seed: int = 0, decay: float = 0.7) -> torch.Tensor:
    """A (t × n) matrix with a few large singular values and a slowly decaying tail (Fig. 2)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(t, n, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    s = torch.tensor([10.0 * decay**i + 0.5 for i in range(n)])
    return (u * s) @ v.T


def draws(x: torch.Tensor, r1: int, r2: int, n_draws: int, scale: float | None = None):
    """X̃ for ``n_draws`` independent Q2 with a fixed Q1 (exact SVD); returns (stack, q1)."""
    n = x.shape[1]
    q1 = principal_basis_ref(x, r1)
    k = (n - r1) / r2 if scale is None else scale
    q2 = random_complement_ref(q1, n, r2, torch.Generator().manual_seed(1), batch=(n_draws,))
    return x @ q1 @ q1.T + k * (x @ q2 @ q2.transpose(1, 2)), q1


def tail(x: torch.Tensor, q1: torch.Tensor) -> float:
    return float((x - x @ q1 @ q1.T).square().sum())


# --- theory ----------------------------------------------------------------------------------


def test_unbiased_monte_carlo_mean_converges_within_theorem15_tolerance():
    x = spectrum_matrix(48, 32)
    r1, r2, n_draws = 4, 4, 3000
    xs, q1 = draws(x, r1, r2, n_draws)
    k = (32 - r1) / r2
    v = (k - 1) * tail(x, q1)
    err = float((xs.mean(0) - x).square().sum())
    assert err <= 4 * v / n_draws, (err, v / n_draws)
    # the same tolerance rejects a biased estimator: no scaling (k = 1) ...
    biased, _ = draws(x, r1, r2, n_draws, scale=1.0)
    assert float((biased.mean(0) - x).square().sum()) > 40 * v / n_draws
    # ... and PAC at the same total rank
    q = principal_basis_ref(x, r1 + r2)
    assert float((x @ q @ q.T - x).square().sum()) > 40 * v / n_draws


def test_variance_matches_theorem15_within_monte_carlo_error():
    x = spectrum_matrix(40, 24, seed=3)
    r1, r2, n_draws = 3, 5, 3000
    xs, q1 = draws(x, r1, r2, n_draws)
    per_draw = (xs - x).square().sum(dim=(1, 2))
    v = ((24 - r1) / r2 - 1) * tail(x, q1)
    se = float(per_draw.std()) / math.sqrt(n_draws)
    assert abs(float(per_draw.mean()) - v) <= 4 * se, (float(per_draw.mean()), v, se)
    assert se < 0.05 * v  # the check is tight enough to mean something


def test_rac_variance_matches_theorem16():
    x = spectrum_matrix(40, 24, seed=4)
    r2, n_draws = 6, 3000
    xs, _ = draws(x, 0, r2, n_draws)
    per_draw = (xs - x).square().sum(dim=(1, 2))
    v = (24 / r2 - 1) * float(x.square().sum())
    se = float(per_draw.std()) / math.sqrt(n_draws)
    assert abs(float(per_draw.mean()) - v) <= 4 * se
    assert float((xs.mean(0) - x).square().sum()) <= 4 * v / n_draws


class OneLinear(nn.Module):
    def __init__(self, n: int, m: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, m, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_linear_weight_gradient_mean_converges_to_exact_gradient():
    """Through the real strategy: E[gYᵀX̃] = gYᵀX (Lemma 3), with T2 = 1 (a new Q2 per step)."""
    torch.manual_seed(0)
    n, m, n_draws = 24, 8, 300
    x = spectrum_matrix(2 * 16, n, seed=5).reshape(2, 16, n)
    gy = torch.randn(2, 16, m)
    ref = OneLinear(n, m)
    model = OneLinear(n, m)
    model.load_state_dict(ref.state_dict())
    ref(x).mul(gy).sum().backward()
    xin = x.clone().requires_grad_(True)
    (ref_gx,) = torch.autograd.grad(ref(xin).mul(gy).sum(), xin)
    slimact.apply(model, PracConfig(linear=(4, 4), t1=10**9, t2=1))
    grads = []
    for _ in range(n_draws):
        model.zero_grad()
        xin = x.clone().requires_grad_(True)
        model(xin).mul(gy).sum().backward()
        grads.append(model.lin.weight.grad.clone())
        torch.testing.assert_close(xin.grad, ref_gx)  # input gradient needs W only: exact
    rep = prac_report(model)["compressed"]["lin:linear#0"]
    assert rep["updates"]["q2"] == n_draws and rep["updates"]["q1"] == 1
    q1 = principal_basis_ref(x.reshape(-1, n), 4)
    v = ((n - 4) / 4 - 1) * tail(x.reshape(-1, n), q1)
    bound = float(torch.linalg.matrix_norm(gy.reshape(-1, m), ord=2)) ** 2 * v
    g_mean = torch.stack(grads).mean(0)
    err = float((g_mean - ref.lin.weight.grad).square().sum())
    assert err <= 4 * bound / n_draws, (err, bound / n_draws)
    one = float((grads[0] - ref.lin.weight.grad).square().sum())
    assert one > 20 * err  # a single draw is far noisier than the mean: the noise is real


@pytest.mark.parametrize("q2", ["regenerate", "store"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [3, 8])
def test_memory_of_a_linear_site_is_tokens_times_rank_plus_projection(dtype, batch, q2):
    n, r1, r2, seq = 64, 12, 7, 33
    model = OneLinear(n, 16).to(dtype)
    slimact.apply(model, PracConfig(linear=(r1, r2), q2=q2))
    x = torch.randn(batch, seq, n, dtype=dtype, requires_grad=True)
    with slimact.measure(model) as m:
        model(x).sum().backward()
    (site,) = [s for s in m.report.sites if s.site == "lin:linear#0"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if q2 == "store":  # P = [Q1, Q2] in fp32, independent of the batch
        projection = n * (r1 + r2) * 4
    else:  # Q1, M = Q1ᵀS and R: Q2 is rebuilt from its seed
        projection = (n * r1 + r1 * r2 + r2 * r2) * 4
    assert site.action.startswith(f"codec:prac/r1={r1},r2={r2}")  # the label names its ranks
    assert site.bytes == batch * seq * (r1 + r2) * itemsize + projection
    assert m.report.total_bytes == site.bytes
    codec = prac_state(model).codecs["lin:linear#0"]
    assert codec.basis_nbytes() == projection


def test_regenerated_q2_equals_the_qr_factor_and_is_orthogonal_to_q1():
    """Q2 = (S − Q1M)R⁻¹ from the seed is QR((I − Q1Q1ᵀ)S)'s Q: orthonormal, in Q1's complement."""
    x = spectrum_matrix(80, 40, seed=3)
    a = PracCodec(PracCodecConfig(r1=6, r2=9, seed=2, t1=10**9, t2=10**9), name="s")
    a.encode(x)
    q1, q2 = a.q1, a.q2
    torch.testing.assert_close(q2.T @ q2, torch.eye(9), atol=1e-5, rtol=0)
    assert float((q1.T @ q2).abs().max()) < 1e-5
    s = torch.randn(40, 9, generator=torch.Generator().manual_seed(a.q2_seed))
    qr_q, _ = torch.linalg.qr(s - q1 @ (q1.T @ s))
    torch.testing.assert_close(q2, qr_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.q2, q2, atol=0, rtol=0)  # rebuilt identically every time
    packed = a.encode(x)
    assert set(packed.tensors) == {"z", "q1", "m", "r"}  # Q2 itself is not kept
    torch.testing.assert_close(a.decode(packed), prac_reconstruct_ref(x, q1, q2), atol=1e-4, rtol=0)


def test_small_micro_batch_keeps_the_tensor_when_compression_would_cost_more():
    """only_if_smaller: Z + basis >= X keeps X and says from how many tokens PRAC pays off."""
    n = 64
    model = OneLinear(n, 16)
    slimact.apply(model, PracConfig(linear=(0.3, 0.3)))
    with slimact.measure(model) as m:
        model(torch.randn(1, 8, n, requires_grad=True)).sum().backward()
    assert m.report.total_bytes == 8 * n * 4  # kept raw
    reason = prac_report(model)["skipped"]["lin:linear#0"]
    assert "pays off from" in reason and "8 tokens" in reason
    forced = OneLinear(n, 16)
    slimact.apply(forced, PracConfig(linear=(0.3, 0.3), only_if_smaller=False))
    with slimact.measure(forced) as m2:
        forced(torch.randn(1, 8, n, requires_grad=True)).sum().backward()
    assert m2.report.total_bytes > 8 * n * 4  # what the check avoids


# --- reconstruction quality, dtypes, shapes --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 7, 33), (130, 17), (2, 3, 4, 40)])
def test_low_rank_input_is_reconstructed_exactly(dtype, shape):
    """When rank(X) <= r1 the tail is 0, so Thm 15 gives X̃ = X (up to the dtype's rounding)."""
    n = shape[-1]
    g = torch.Generator().manual_seed(0)
    rank = max(1, int(0.3 * n) - 1)
    x = torch.randn(math.prod(shape[:-1]), rank, generator=g) @ torch.randn(rank, n, generator=g)
    x = x.reshape(shape).to(dtype)
    codec = get_codec(PracCodecConfig(r1=0.3, r2=0.3))
    out = codec.decode(codec.encode(x))
    assert out.shape == x.shape and out.dtype == dtype
    rel = float((out.float() - x.float()).norm() / x.float().norm())
    assert rel < (2e-5 if dtype == torch.float32 else 2e-2), rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relative_error_is_bounded_by_theorem15(dtype):
    x = spectrum_matrix(200, 48, seed=7)
    codec = PracCodec(PracCodecConfig(r1=0.25, r2=0.25))
    x_t = x.to(dtype)
    xt = codec.decode(codec.encode(x_t)).float()
    q1 = principal_basis_ref(x_t.float(), 12)
    expected = (36 / 12 - 1) * tail(x_t.float(), q1) / float(x_t.float().square().sum())
    rel2 = float((xt - x_t.float()).square().sum() / x_t.float().square().sum())
    assert rel2 < 3 * expected + (1e-4 if dtype == torch.bfloat16 else 1e-9)
    assert rel2 > 0.1 * expected  # the random part does add its variance


def test_pac_is_the_deterministic_truncation_and_rac_has_no_principal_part():
    x = spectrum_matrix(64, 20, seed=2)
    pac = get_codec("pac")
    q = principal_basis_ref(x, 12)
    torch.testing.assert_close(pac.decode(pac.encode(x)), x @ q @ q.T, atol=1e-4, rtol=1e-4)
    rac = get_codec("rac")
    packed = rac.encode(x)
    assert rac.r1 == 0 and rac.r2 == 12 and packed.meta["k"] == pytest.approx(20 / 12)
    assert isinstance(get_codec("prac").config, PracCodecConfig)


def test_codec_matches_formula_reference():
    x = spectrum_matrix(50, 30, seed=9)
    codec = PracCodec(PracCodecConfig(r1=5, r2=7))
    out = codec.decode(codec.encode(x))
    ref = prac_reconstruct_ref(x, codec.q1, codec.q2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    eye = codec.p.T @ codec.p  # [Q1, Q2] is orthonormal: Q2 lies in Q1's complement
    torch.testing.assert_close(eye, torch.eye(12), atol=1e-5, rtol=0)


def test_randomized_svd_captures_the_principal_energy():
    x = spectrum_matrix(300, 64, seed=11)
    exact = principal_basis_ref(x, 16)
    best = float((x @ exact).square().sum())
    got = float((x @ randomized_basis_ref(x, 16, torch.Generator().manual_seed(0))).square().sum())
    assert 0.99 * best <= got <= best * (1 + 1e-5)
    rough = randomized_basis_ref(x, 16, torch.Generator().manual_seed(0), niter=0, oversample=0)
    assert float((x @ rough).square().sum()) < got  # power iterations matter


# --- lazy updates, state, NaN ------------------------------------------------------------------


def test_lazy_updates_follow_t1_and_t2():
    codec = PracCodec(PracCodecConfig(r1=3, r2=3, t1=4, t2=2))
    x = spectrum_matrix(40, 16)
    seen = []
    for _ in range(9):
        codec.encode(x)
        seen.append((codec.q1.clone(), codec.q2.clone()))
    assert codec.updates == {"q1": 3, "q2": 5, "q1_skipped": 0}  # Q1 at 0,4,8; Q2 at 0,2,4,6,8
    assert torch.equal(seen[1][1], seen[0][1]) and not torch.equal(seen[2][1], seen[0][1])


@pytest.mark.parametrize("q2", ["regenerate", "store"])
def test_seeded_and_state_dict_round_trip_reproduces_the_stream(q2):
    cfg = PracCodecConfig(r1=3, r2=4, t1=3, t2=1, seed=5, q2=q2)
    a, b = PracCodec(cfg, name="s"), PracCodec(cfg, name="s")
    xs = [spectrum_matrix(30, 16, seed=i) for i in range(6)]
    for x in xs[:3]:
        torch.testing.assert_close(a.encode(x).tensors["z"], b.encode(x).tensors["z"])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    c = PracCodec(cfg, name="s")
    c.load_state_dict(torch.load(buf, weights_only=True))
    for x in xs[3:]:
        za, zc = a.encode(x).tensors["z"], c.encode(x).tensors["z"]
        assert torch.equal(za, zc)
    first, other = PracCodec(cfg, name="s"), PracCodec(cfg, name="other")
    first.encode(xs[0])
    other.encode(xs[0])
    assert not torch.equal(other.q2, first.q2)  # the stream is per site


def test_nan_keeps_previous_q1_and_warns_with_the_site_name():
    codec = PracCodec(PracCodecConfig(r1=3, r2=3, t1=1, t2=1), name="layers.0.mlp.act_fn:silu#0")
    x = spectrum_matrix(30, 16)
    codec.encode(x)
    q1 = codec.q1.clone()
    bad = x.clone()
    bad[3, 4] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"layers\.0\.mlp\.act_fn:silu#0.*previous Q1"):
        packed = codec.encode(bad)
    assert torch.equal(codec.q1, q1) and codec.q1_pending
    assert torch.isnan(codec.decode(packed)).any()  # NaN in, NaN out
    assert torch.isfinite(codec.p).all()  # the stored subspace is not poisoned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codec.encode(x * 2)  # finite again: the update is retried
    assert not codec.q1_pending and codec.updates["q1"] == 2


def test_nan_on_first_update_uses_a_random_orthonormal_q1():
    codec = PracCodec(PracCodecConfig(r1=3, r2=3), name="site-x")
    bad = spectrum_matrix(30, 16)
    bad[0, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match="site-x.*random Q1"):
        codec.encode(bad)
    torch.testing.assert_close(codec.p.T @ codec.p, torch.eye(6), atol=1e-5, rtol=0)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"r1": 0.6, "r2": 0.5}, r"r1 \+ r2 = 1\.1 must be < 1"),
        ({"r1": -1, "r2": 3}, "r1 must be >= 0, got -1"),
        ({"r1": 0, "r2": 0}, "both 0"),
        ({"r1": 1.5, "r2": 0}, r"\[0, 1\)"),
        ({"t1": 0}, "t1 .* >= 1"),
        ({"svd": "qr"}, "svd must be one of"),
        ({"r1": True}, "int or a float"),
    ],
)
def test_bad_config_raises_with_valid_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PracCodecConfig(**kwargs)


def test_variant_invariants_and_absolute_ranks_checked_against_n():
    with pytest.raises(ValueError, match="r2 must be 0"):
        PacCodecConfig(r2=0.1)
    with pytest.raises(ValueError, match="r1 must be 0"):
        RacCodecConfig(r1=2)
    codec = PracCodec(PracCodecConfig(r1=10, r2=6), name="lin:linear#0")
    with pytest.raises(ValueError, match=r"lin:linear#0.*n=16.*1 <= r1 \+ r2 <= 15"):
        codec.encode(torch.randn(4, 16))
    with pytest.raises(ValueError, match="floating"):
        PracCodec(PracCodecConfig()).encode(torch.ones(4, 16, dtype=torch.uint8))


def test_k_scale_ablation_scales_k_per_role_and_is_validated():
    """prac.txt App. D.3's ablation knob: k = k_scale·(n − r1)/r2; the default keeps k0."""
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    k0 = PracCodecConfig(r1=16, r2=8, svd="exact").build()
    half = PracCodecConfig(r1=16, r2=8, svd="exact", k_scale=0.5).build()
    k0.encode(x), half.encode(x)
    assert k0.k == (64 - 16) / 8 and half.k == 0.5 * k0.k
    cfg = PracConfig(k_scale=(1.2, 0.2))
    assert cfg.codec_config(8, 8, "linear").k_scale == 1.2
    assert cfg.codec_config(8, 8, "norm").k_scale == 0.2
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="k_scale must be a finite number > 0"):
            PracCodecConfig(k_scale=bad)
    with pytest.raises(ValueError, match="k_scale must be a pair"):
        PracConfig(k_scale=(1.0,))
