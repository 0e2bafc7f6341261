"""Stochastic rounding (SR) in the INT4/INT8 codecs, eager and traced.

SR codes ``floor(x / S + u)``, ``u ~ U[0, 1)``: held to ``E[x^] = x`` (the error of the mean of
k decodes shrinks as 1/sqrt(k), round-to-nearest's does not), ``|x - x^| < S``, the draws a
function of a seed (the same seed the same codes; the saving policy's seed from the site and its
count, carried by checkpoints), the Triton kernel (TRITON_INTERPRET=1 on CPU) and the compiled
CPU path equal to the ref bit for bit, NaN/inf exact, no extra syncs per training step, labels
and specs that round-trip, and clear errors.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first kernel build (triton reads it then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import slimact  # noqa: E402
from slimact import compiled as C  # noqa: E402
from slimact.codecs import base as codec_base  # noqa: E402
from slimact.codecs.base import (  # noqa: E402
    codec_config,
    codec_label,
    draw_seed,
    get_codec,
    site_draw_seed,
)
from slimact.codecs.outlier import OutlierConfig  # noqa: E402
from slimact.codecs.quant import ChannelQuantConfig, QuantConfig  # noqa: E402
from slimact.codecs.saving import CodecPolicy  # noqa: E402
from slimact.codecs.token import TokenQuantConfig  # noqa: E402
from slimact.models import build_model  # noqa: E402
from slimact.ops import compiled_ref  # noqa: E402
from slimact.ops import quant as Q  # noqa: E402
from slimact.ops.quant import _unpack  # noqa: E402
from slimact.ops.stochastic import uniform  # noqa: E402
from slimact.planner.plan import Plan  # noqa: E402
from slimact.registry import resolve  # noqa: E402
from slimact.strategies.int4 import Int4Config  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SR = {"rounding": "stochastic"}


def _x(*shape, dtype=torch.float32, seed=0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3 + shift).to(dtype)


def _scale_per_value(q: Q.Quantized) -> torch.Tensor:
    s = q.scale.abs()
    if q.channels:
        return s.repeat(q.numel // q.channels)
    return s.repeat_interleave(q.group_size)[: q.numel]


def _codes(q: Q.Quantized) -> torch.Tensor:
    return _unpack(q.codes, q.numel, q.bits)


# ----------------------------------------------------------------------------- the draws
def test_the_draws_are_uniform_and_look_independent():
    n = 1 << 16
    u = uniform((n,), seed=12345)
    assert u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u * (1 << 24), (u * (1 << 24)).floor())  # on the 2^-24 grid: exact
    assert abs(float(u.mean()) - 0.5) < 0.01  # sd of the mean: 0.0011
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    chi2 = float(((counts - n / 16) ** 2 / (n / 16)).sum())
    assert chi2 < 45  # 15 degrees of freedom: P(chi2 > 45) < 1e-4
    c = u - 0.5

    def corr(a, b):
        return float((a * b).mean() / (a.square().mean() * b.square().mean()).sqrt())

    assert abs(corr(c[:-1], c[1:])) < 0.02  # neighbours (sd 0.004)
    assert abs(corr(c, uniform((n,), seed=12346) - 0.5)) < 0.02  # neighbouring seeds
    assert abs(corr(c, uniform((n,), seed=12345 + (1 << 31)) - 0.5)) < 0.02  # the high half
    assert torch.equal(u, uniform((n,), seed=12345))


# ----------------------------------------------------------------------------- unbiasedness
@pytest.mark.parametrize(
    "kind",
    ["int4-sym", "int4-asym", "int8-sym", "int4-channel", "int4-keep-cols"],
)
def test_the_mean_of_many_decodes_converges_to_x(kind):
    """The error of the mean of k decodes shrinks ~1/sqrt(k) (as S sqrt(f(1-f)/k)); the nearest
    decode's error is what it is, whatever k."""
    x = _x(64, 48, shift=2.0 if kind == "int4-asym" else 0.0)
    keep = torch.ones(48, dtype=torch.bool).index_fill(0, torch.tensor([3, 40]), False)

    def quant(rounding, seed):
        if kind == "int4-channel":
            return Q.quantize_channelwise(x, rounding=rounding, seed=seed, backend="ref")
        bits = 8 if kind == "int8-sym" else 4
        sym = kind != "int4-asym"
        kc = keep if kind == "int4-keep-cols" else None
        return Q.quantize(
            x, bits=bits, group_size=16, symmetric=sym, keep_cols=kc, rounding=rounding,
            seed=seed, backend="ref",
        )  # fmt: skip

    target = x.masked_fill(~keep, 0.0) if kind == "int4-keep-cols" else x
    near = quant("nearest", 0)
    s = _scale_per_value(near).view_as(x)  # the scale of each value (SR's may differ: asym)
    err_near = float(((Q.dequantize(near, backend="ref").view_as(x) - target) / s).abs().mean())
    acc, errs = torch.zeros_like(x, dtype=torch.float64), {}
    for k in range(1, 257):
        q = quant("stochastic", k)
        acc += Q.dequantize(q, backend="ref").view_as(x).double()
        if k in (4, 64, 256):
            errs[k] = float(((acc / k - target) / s).abs().mean())
    # f(1-f) averages 1/6 for f uniform: E|mean error| ~ sqrt(2/pi * 1/6 / k) S
    assert errs[256] < 0.4 * errs[4] and errs[256] < 0.04, errs
    assert err_near > 0.15, err_near  # nearest: about S/4 per value on average
    assert errs[64] < err_near / 3


def test_asymmetric_extremes_are_not_clipped():
    """Asymmetric SR divides by 2^b - 2 so the group's max and min stay inside the codes: their
    decodes average to themselves (nearest mode's 15 would clip the max's upward draws)."""
    x = torch.tensor([0.0, 0.37, 0.91, 1.0] * 4)
    q0 = Q.quantize(x, group_size=16, symmetric=False, rounding="stochastic", backend="ref")
    assert float(q0.scale) == pytest.approx(1 / 14)
    ys = torch.stack([
        Q.dequantize(Q.quantize(x, group_size=16, symmetric=False, rounding="stochastic",
                                seed=s, backend="ref"), backend="ref")
        for s in range(400)
    ])  # fmt: skip
    assert torch.allclose(ys.mean(0), x, atol=0.01)
    assert float(ys.max()) <= 1.0 + 1e-6 and float(ys.min()) >= -1e-6


# ----------------------------------------------------------------------------- the bound
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (3, 17, 9)])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_each_decode_is_within_one_step(dtype, shape, bits, symmetric):
    """|x - x^| < S, and each code is floor(x/S) or the one above it (x^ brackets x)."""
    x = _x(*shape, dtype=dtype, shift=0.0 if symmetric else 2.0)
    for seed in (0, 1, 2**40 + 3):
        q = Q.quantize(x, bits=bits, group_size=16, symmetric=symmetric, backend="ref",
                       rounding="stochastic", seed=seed)  # fmt: skip
        y = Q.dequantize(q, dtype=torch.float32, backend="ref").view(shape)
        s = _scale_per_value(q).view(shape)
        err = (x.float() - y).abs()
        assert bool((err < s * (1 + 1e-5) + 1e-30).all()), float((err / s).max())
        yd = Q.dequantize(q, dtype=dtype, backend="ref").view(shape)  # the cast's rounding on top
        tol = yd.float().abs() * torch.finfo(dtype).eps
        assert bool(((x.float() - yd.float()).abs() <= s * (1 + 1e-5) + tol).all())


def test_paper_scale_keeps_its_clipped_maximum():
    """adacc's divisor 8 puts the maximum on code 8, clipped to 7 in either mode (documented:
    that one value stays biased); the others are unbiased."""
    x = torch.tensor([-1.0, 0.3, 1.0, 0.55])
    ys = torch.stack([
        Q.dequantize(Q.quantize(x, group_size=4, paper_scale=True, rounding="stochastic",
                                seed=s, backend="ref"), backend="ref")
        for s in range(400)
    ])  # fmt: skip
    assert float(ys[:, 2].max()) == pytest.approx(7 / 8)
    assert torch.allclose(ys.mean(0)[[0, 1, 3]], x[[0, 1, 3]], atol=0.02)


# ----------------------------------------------------------------------------- reproducibility
def test_the_same_seed_gives_the_same_codes_and_another_does_not():
    x = _x(40, 64)
    a, b, c = (
        Q.quantize(x, group_size=16, rounding="stochastic", seed=s, backend="ref")
        for s in (7, 7, 8)
    )
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert not torch.equal(a.codes, c.codes) and torch.equal(a.scale, c.scale)
    assert 0.2 < float((_codes(a) != _codes(c)).float().mean()) < 0.6
    near = Q.quantize(x, group_size=16, seed=7, backend="ref")  # seed ignored when nearest
    assert torch.equal(near.codes, Q.quantize(x, group_size=16, seed=8, backend="ref").codes)


def test_a_policy_seeds_each_encode_by_site_and_count_and_checkpoints_the_count():
    """The saving policy draws the n-th encode of a site from site_draw_seed(site, n); two
    policies with the same history encode alike; a policy restored from site_state_dict draws
    as the uninterrupted one; a codec swapped in for the site keeps counting."""
    x = _x(64, 48)
    codec = get_codec("int4-outlier-g16/sr")

    def run(policy, site, t):
        policy.reset()
        stored = policy(site, t)
        policy.end()
        return stored

    p1 = CodecPolicy(lambda site, t: codec)
    first = [run(p1, "m:linear#0", x.clone()) for _ in range(3)]
    codes = [s.packed.tensors["codes"] for s in first]
    assert not torch.equal(codes[0], codes[1]) and not torch.equal(codes[1], codes[2])
    with draw_seed(site_draw_seed("m:linear#0", 1)):  # the second encode's draws, directly
        assert torch.equal(codec.encode(x).tensors["codes"], codes[1])
    p2 = CodecPolicy(lambda site, t: codec)
    assert torch.equal(run(p2, "m:linear#0", x.clone()).packed.tensors["codes"], codes[0])
    other = run(p2, "m:linear#1", x.clone()).packed.tensors["codes"]  # another site: other draws
    assert not torch.equal(other, codes[0])
    # resume: a new policy (and codec) with the first policy's site states after two encodes
    p3 = CodecPolicy(lambda site, t: codec)
    for _ in range(2):
        run(p3, "m:linear#0", x.clone())
    states = p3.site_state_dict()
    assert states["m:linear#0"]["draws"] == 2
    resumed = CodecPolicy(lambda site, t: get_codec("int4-outlier-g16/sr"))
    resumed.load_site_state_dict(states)
    assert torch.equal(run(resumed, "m:linear#0", x.clone()).packed.tensors["codes"], codes[2])
    # a new codec instance for the site (a new plan) continues the count: no repeated draws
    swap = {"codec": codec}
    p4 = CodecPolicy(lambda site, t: swap["codec"])
    run(p4, "m:linear#0", x.clone())
    swap["codec"] = get_codec("int4-outlier-g16/sr")
    assert torch.equal(run(p4, "m:linear#0", x.clone()).packed.tensors["codes"], codes[1])


def test_a_codec_outside_a_policy_counts_its_own_encodes():
    x = _x(32, 32)
    c1, c2 = get_codec("int4/sr"), get_codec("int4/sr")
    a = [c1.encode(x).tensors["codes"] for _ in range(2)]
    b = [c2.encode(x).tensors["codes"] for _ in range(2)]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], a[1])


def test_each_rank_draws_its_own_and_rank_0_as_one_process(monkeypatch):
    """Under torch.distributed the rank is in the seed: ranks' rounding noise is independent,
    so it averages out in the all-reduce; rank 0 keeps the single-process draws."""
    alone = site_draw_seed("layers.0.mlp:linear#0", 3)
    monkeypatch.setattr(codec_base.dist, "is_initialized", lambda: True)
    seeds = {}
    for rank in range(3):
        monkeypatch.setattr(codec_base.dist, "get_rank", lambda r=rank: r)
        seeds[rank] = site_draw_seed("layers.0.mlp:linear#0", 3)
    assert seeds[0] == alone and len(set(seeds.values())) == 3


def test_deferred_and_checked_outlier_encodes_draw_alike():
    """The outlier codec's deferred encode (capacity from a checked one) decodes as the checked
    encode of the same seed, bit for bit."""
    x = _x(64, 48)
    x[:, [5, 30]] *= 40.0
    codec = get_codec("int4-outlier-g16/sr")
    state: dict = {}
    with draw_seed(99):
        checked = codec.encode(x)
        codec.calibrate(checked, state)
        deferred = codec.encode_deferred(x, state).packed
    assert torch.equal(codec.decode(checked), codec.decode(deferred))


# ----------------------------------------------------------------------------- ref vs kernels
@pytest.mark.skipif(not Q.triton_available(), reason="triton is not importable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 100, 257])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_triton_matches_ref_bit_for_bit(dtype, n, bits, symmetric):
    x = _x(n, dtype=dtype).to(DEV)
    if n > 5:
        x[3], x[4] = float("nan"), -float("inf")
    for seed in (0, 2**61 + 12345):
        kw = dict(bits=bits, group_size=16, symmetric=symmetric, rounding="stochastic", seed=seed)
        a, b = Q.quantize(x, backend="ref", **kw), Q.quantize(x, backend="triton", **kw)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
        assert torch.equal(a.nonfinite, b.nonfinite)
        assert symmetric or torch.equal(a.offset, b.offset)


@pytest.mark.skipif(not Q.triton_available(), reason="triton is not importable")
def test_triton_channelwise_and_keep_cols_match_ref_bit_for_bit():
    x = _x(9, 6).to(DEV)
    x[2, 1] = float("inf")
    kw = dict(rounding="stochastic", seed=31)
    a, b = (Q.quantize_channelwise(x, backend=be, **kw) for be in ("ref", "triton"))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    keep = torch.tensor([True, False, True, True, True, False], device=DEV)
    a, b = (
        Q.quantize(x, keep_cols=keep, group_size=4, backend=be, **kw) for be in ("ref", "triton")
    )
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize(
    "shape,group_size,keep,symmetric",
    [((64, 512), 16, True, True), ((3, 7001), 16, False, False), ((130, 136), 32, True, True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_path_equals_ref(shape, group_size, keep, symmetric, dtype):
    assert math.prod(shape) >= compiled_ref.MIN_NUMEL
    x = _x(*shape, dtype=dtype)
    x.view(-1)[[5, 1000]] = torch.tensor([float("nan"), float("inf")], dtype=dtype)
    keep_cols = None
    if keep:
        keep_cols = torch.ones(shape[-1], dtype=torch.bool)
        keep_cols[[1, shape[-1] // 2]] = False
    kw = dict(group_size=group_size, symmetric=symmetric, keep_cols=keep_cols, **SR, seed=5)
    a, b = Q.quantize(x, backend="ref", **kw), Q.quantize(x, **kw)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert symmetric or torch.equal(a.offset, b.offset)
    c = Q.quantize_channelwise(x, **SR, seed=5)
    assert torch.equal(c.codes, Q.quantize_channelwise(x, backend="ref", **SR, seed=5).codes)


# ----------------------------------------------------------------------------- special values
@pytest.mark.parametrize(
    "label", ["int4/sr", "int4-asym/sr", "int8/sr", "int8-channel/sr", "int4-outlier-g16/sr"]
)
@pytest.mark.parametrize("deferred", [False, True])
def test_nan_and_inf_come_back_exactly(label, deferred):
    codec = get_codec(label)
    x = _x(64, 32)
    x[2, 3], x[5, 0], x[9, 7] = float("nan"), float("inf"), -float("inf")
    packed = codec.encode_deferred(x, {}).packed if deferred else codec.encode(x)
    assert "fallback" not in packed.meta  # coded in band (or, outlier codec, exact channels)
    y = codec.decode(packed)
    assert torch.isnan(y[2, 3]) and y[5, 0] == float("inf") and y[9, 7] == -float("inf")
    finite = torch.isfinite(x)
    assert bool(torch.isfinite(y[finite]).all())


@pytest.mark.parametrize("symmetric", [True, False])
def test_extreme_values_decode_finite_and_within_a_step(symmetric):
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, big / 3, 1.0, 0.0, -1e-38, 1e-38, 5e-39] * 2)
    for seed in range(20):
        q = Q.quantize(x, group_size=8, symmetric=symmetric, rounding="stochastic", seed=seed,
                       backend="ref")  # fmt: skip
        y = Q.dequantize(q, backend="ref")
        assert bool(torch.isfinite(y).all())
        s = _scale_per_value(q)
        assert bool(((x.double() - y.double()).abs() <= s.double() * (1 + 1e-6)).all())
    zeros = Q.quantize(torch.zeros(32), group_size=16, rounding="stochastic", backend="ref")
    assert torch.equal(Q.dequantize(zeros, backend="ref"), torch.zeros(32))


# ----------------------------------------------------------------------------- traced codecs
@pytest.mark.parametrize("name", ["int8", "int6", "int4", "int4-outlier"])
@pytest.mark.parametrize("shape", [(4, 64, 128), (3, 7, 96), (2, 33, 101)])
def test_traced_sr_with_the_hash_draws_equals_the_ref(name, shape):
    """The traced pack rounds floor(x/S + draw); given the eager hash's draws it codes what
    ``quantize_ref`` codes with that seed, bit for bit."""
    codec = C.resolve_codec(f"{name}-sr")
    assert codec.rounding == "stochastic"
    x = _x(*shape)
    ref = C.encode_ref(codec, x, seed=77)
    payload = C.encode(codec, x, draw=lambda shp, dev: uniform(shp, 77, dev))
    assert ref is not None
    assert torch.equal(C.unpack_codes(payload[0], payload[3]).reshape(-1), _codes(ref))
    assert torch.equal(payload[1].reshape(-1), ref.scale)


def test_traced_sr_is_unbiased_eagerly():
    codec = C.resolve_codec("int4-sr")
    x = _x(16, 64)
    near = C.decode(C.encode(C.CODECS["int4"], x))
    s = x.view(16, 2, 32).abs().amax(-1, keepdim=True).expand(16, 2, 32).reshape(16, 64) / 7
    acc = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(256):
        acc += C.decode(C.encode(codec, x)).double()
    err = float(((acc / 256 - x) / s).abs().mean())
    assert err < 0.04 and float(((near - x) / s).abs().mean()) > 0.15


def test_traced_sr_lowers_in_a_compiled_graph_and_averages_to_the_exact_gradient():
    """Under torch.compile the draws are inductor's seeded RNG (prims.inductor_random): the
    graph lowers, each call draws afresh (reproducible from torch.manual_seed), and the mean of
    the weight gradients over calls converges to the exact one."""
    torch.manual_seed(0)
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(256, 64)

    def f(x, w):
        return (x.sin() @ w).square().sum() / 2  # sin(x) saved for the weight gradient

    exact = torch.autograd.grad(f(x, w), w)[0]
    fc = torch.compile(f, dynamic=False)
    grads = []
    with C.codec_hooks("int8-sr"):
        torch.manual_seed(1)
        for _ in range(16):
            grads.append(torch.autograd.grad(fc(x, w), w)[0])
        torch.manual_seed(1)
        again = torch.autograd.grad(fc(x, w), w)[0]
    assert torch.equal(again, grads[0]) and not torch.equal(grads[0], grads[1])

    def rel(g):
        return float((g - exact).norm() / exact.norm())

    one, mean = rel(grads[0]), rel(torch.stack(grads).mean(0))
    assert 0 < one < 0.05 and mean < one / 2.5, (one, mean)


def test_compiled_specs_take_sr():
    cfg = resolve("compiled-int4@sr")[0]
    assert cfg.codec == "int4-sr" and cfg.name == "compiled-int4@sr"
    assert cfg.choice.label == "codec:compiled-int4-sr"
    cfg = resolve("compiled-int8@0.25,rounding=stochastic")[0]
    assert (cfg.codec, cfg.budget, cfg.name) == ("int8-sr", 0.25, "compiled-int8@0.25,sr")
    assert slimact.registry.compiled_spec("int4@sr") == "compiled-int4@sr"
    with pytest.raises(ValueError, match=r"unknown compiled codec 'prac-sr'.*int8-sr"):
        resolve("compiled-prac@sr")
    with pytest.raises(ValueError, match=r"region budget.*'sr'"):
        resolve("compiled-int8@fast")
    with pytest.raises(ValueError, match=r"CompiledCodec.rounding must be one of"):
        C.CompiledCodec(rounding="up")


# ----------------------------------------------------------------------------- the strategy
def test_int4_sr_strategy_labels_and_plan_json_round_trip():
    cfg = resolve("int4@sr")[0]
    assert cfg == Int4Config(rounding="stochastic") == resolve("int4@rounding=stochastic")[0]
    assert cfg.name == "int4@sr" and resolve("int8@sr")[0].name == "int8@sr"
    labels = dict(cfg.rule().codecs)
    assert labels == {
        "act": "int4-outlier-g16/sr",
        "qkv": "int8-channel/sr",
        "scores": "int4-asym/g16,sr",
        "mask": "bits",
    }
    plan = cfg.plan()
    back = Plan.from_dict(__import__("json").loads(plan.to_json()))
    assert back.rules == plan.rules
    assert resolve("int8@sr,group_size=32")[0] == dataclasses.replace(
        resolve("int8")[0], rounding="stochastic", group_size=32
    )


def test_codec_labels_round_trip():
    for cfg in (
        OutlierConfig(group_size=16, rounding="stochastic"),
        QuantConfig(bits=8, symmetric=False, rounding="stochastic"),
        ChannelQuantConfig(rounding="stochastic"),
        TokenQuantConfig(rounding="stochastic"),
    ):
        label = codec_label(cfg)
        assert label.endswith("sr") and codec_config(label) == cfg
    assert codec_label(OutlierConfig(group_size=16, rounding="stochastic")) == "int4-outlier-g16/sr"
    assert codec_config("int4-outlier-g16/rounding=stochastic") == codec_config(
        "int4-outlier-g16/sr"
    )
    assert codec_label(OutlierConfig(group_size=16)) == "int4-outlier-g16"  # nearest: unchanged


def test_clear_errors():
    with pytest.raises(ValueError, match=r"QuantConfig.rounding must be one of \('nearest', "):
        QuantConfig(rounding="up")
    with pytest.raises(ValueError, match=r"OutlierConfig.rounding must be one of"):
        codec_config("int4-outlier/rounding=random")
    with pytest.raises(ValueError, match=r"parameter 'sr' is not a field of PracCodecConfig"):
        codec_config("prac/sr")
    with pytest.raises(ValueError, match=r"Int4Config.rounding must be one of"):
        resolve("int4@rounding=dither")
    with pytest.raises(ValueError, match=r"'fast' must be 'sr' or key=value with key one of"):
        resolve("int4@fast")
    with pytest.raises(ValueError, match=r"rounding must be one of"):
        Q.quantize(torch.ones(4), rounding="down")
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got -1"):
        Q.quantize(torch.ones(4), rounding="stochastic", seed=-1)


def test_int4_sr_trains_and_reports_its_actions():
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), "int4@sr")
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with slimact.measure(model, n_tokens=ids.numel()) as m:
        loss = model(ids, targets=ids).loss
    loss.backward()
    actions = {s.action for s in m.report.sites}
    assert "codec:int4-outlier-g16/sr" in actions and "codec:int8-channel/sr" in actions
    assert "int4@sr" in slimact.registry.applied_strategies(model)


def test_no_extra_syncs_per_step():
    from test_syncs import count_syncs, extra

    assert extra(count_syncs("int4@sr")) == {}


@pytest.mark.usefixtures("isolated_cache", "one_thread")
def test_a_resumed_run_draws_as_the_uninterrupted_one(tmp_path):
    """The sites' draw counts are checkpointed (the plan runtime's ``codec-sites`` state), so
    training resumed at step 3 is bitwise the straight run."""
    from slimact.train import train
    from test_checkpoint import TEXT, cfg, losses

    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    kw = dict(strategy="int4@sr", baseline="off")
    straight = train(cfg(str(data), tmp_path / "straight", **kw))
    train(cfg(str(data), tmp_path / "split", stop_at=3, **kw))
    resumed = train(cfg(str(data), tmp_path / "split", resume=True, **kw))
    assert resumed.resumed_from == 3
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")  # bitwise
    assert [r["grad_norm"] for r in resumed.history] == [r["grad_norm"] for r in straight.history]
    nearest = train(cfg(str(data), tmp_path / "nearest", strategy="int4", baseline="off"))
    assert [r["grad_norm"] for r in nearest.history] != [r["grad_norm"] for r in straight.history]
