"""Quantize+pack / unpack+dequantize ops and the int4/int8/channel/outlier codecs.

Every lossy codec is held to its theoretical bound |x - x^| <= S/2 per group (plus the rounding of
the final cast to bf16/fp16), packing is checked bit by bit, and the Triton kernels (run under
TRITON_INTERPRET=1 on CPU) must reproduce the ``*_ref`` codes and scales exactly.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first kernel build (triton reads it then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from slimact.codecs import get_codec  # noqa: E402
from slimact.codecs import quant as CQ  # noqa: E402
from slimact.codecs.outlier import (  # noqa: E402
    OutlierConfig,
    channel_abs_sums,
    channel_abs_sums_ref,
    count_outlier_channels,
    outlier_mask,
)
from slimact.codecs.quant import ChannelQuantConfig, QuantConfig  # noqa: E402
from slimact.codecs.rows import row_stats_ref  # noqa: E402
from slimact.ops import compiled_ref  # noqa: E402
from slimact.ops import quant as Q  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1,), (7,), (33, 5), (3, 17, 9), (4, 64)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def cast_tol(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounding of the final fp32 -> dtype cast (half an ulp of the decoded value) plus a few
    fp32 ulps for the arithmetic of (x - O) / S * S + O."""
    eps = torch.finfo(dtype).eps / 2 + 4 * torch.finfo(torch.float32).eps
    return y.float().abs() * eps + torch.finfo(dtype).tiny


def per_element_scale(q: Q.Quantized) -> torch.Tensor:
    if q.channels:
        return q.scale.repeat(q.numel // q.channels)
    return q.scale.repeat_interleave(q.group_size)[: q.numel]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
@pytest.mark.parametrize("group_size", [2, 16, 128])
def test_group_roundtrip_bound(dtype, shape, bits, symmetric, group_size):
    x = (torch.randn(shape) * 3 + (2.0 if not symmetric else 0.0)).to(dtype)
    q = Q.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, backend="ref")
    y = Q.dequantize(q, dtype=dtype, backend="ref").view(shape)
    assert y.dtype == dtype and y.shape == x.shape
    err = (x.float() - y.float()).abs().view(-1)
    bound = per_element_scale(q) / 2 * (1 + 1e-5) + cast_tol(y, dtype).view(-1)
    assert bool((err <= bound).all()), float((err - bound).max())
    # exact storage: ceil(n/2) (INT4) or n (INT8) code bytes + fp32 scale (+ offset) per group
    groups = -(-x.numel() // group_size)
    code_bytes = (x.numel() + 1) // 2 if bits == 4 else x.numel()
    assert q.codes.numel() == code_bytes and q.scale.numel() == groups
    assert (q.offset is None) == symmetric


def test_paper_scale_clips_the_positive_extreme_by_one_step():
    x = torch.tensor([-1.0, 0.3, 1.0, 0.5])  # max|x| = 1 -> S = 1/8; +1 maps to 8, clipped to 7
    q = Q.quantize(x, bits=4, group_size=4, paper_scale=True, backend="ref")
    y = Q.dequantize(q, backend="ref")
    assert float(q.scale) == pytest.approx(1 / 8)
    assert float(y[2]) == pytest.approx(7 / 8) and float(y[0]) == pytest.approx(-1.0)
    q7 = Q.quantize(x, bits=4, group_size=4, backend="ref")  # default divisor 7: within S/2
    assert float((Q.dequantize(q7, backend="ref") - x).abs().max()) <= float(q7.scale) / 2 + 1e-7


def test_int4_packing_is_exact_low_nibble_first():
    # symmetric, S = 7/7 = 1: codes are the values themselves, stored biased by +8
    x = torch.tensor([-7.0, 7.0, 0.0, 1.0, -1.0])
    q = Q.quantize(x, bits=4, group_size=8, backend="ref")
    biased = [1, 15, 8, 9, 7]
    expect = [biased[0] | biased[1] << 4, biased[2] | biased[3] << 4, biased[4] | 8 << 4]
    assert q.codes.tolist() == expect
    assert torch.equal(Q.dequantize(q, backend="ref"), x)
    q8 = Q.quantize(x, bits=8, group_size=8, backend="ref")  # S = 7/127
    assert q8.codes.tolist() == [1, 255, 128, 128 + 18, 128 - 18]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (9, 5), (3, 4, 6)])
def test_channelwise_bound(dtype, shape):
    x = (torch.randn(shape) * torch.linspace(0.1, 10, shape[-1])).to(dtype)
    q = Q.quantize_channelwise(x, backend="ref")
    y = Q.dequantize(q, dtype=dtype, backend="ref").view(shape)
    assert q.scale.numel() == shape[-1]
    err = (x.float() - y.float()).abs().view(-1)
    bound = per_element_scale(q) / 2 * (1 + 1e-5) + cast_tol(y, dtype).view(-1)
    assert bool((err <= bound).all())


@pytest.mark.skipif(not Q.triton_available(), reason="triton is not importable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 100, 257])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True)])
def test_triton_matches_ref(dtype, n, bits, symmetric):
    x = (torch.randn(n) * 3).to(dtype).to(DEV)
    if n > 5:
        x[3], x[4] = float("nan"), float("inf")
    a = Q.quantize(x, bits=bits, group_size=16, symmetric=symmetric, backend="ref")
    b = Q.quantize(x, bits=bits, group_size=16, symmetric=symmetric, backend="triton")
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert torch.equal(a.nonfinite, b.nonfinite)
    if not symmetric:
        assert torch.equal(a.offset, b.offset)
    ya, yb = (
        Q.dequantize(a, dtype=dtype, backend="ref"),
        Q.dequantize(b, dtype=dtype, backend="triton"),
    )
    # one rounding apart at most: a GPU kernel may fuse q * scale + offset into one FMA
    eps = torch.finfo(dtype).eps
    finite = ya.float()[torch.isfinite(ya)]
    atol = eps * float(finite.abs().max()) if not symmetric else 0.0
    # NaN and ±inf come back as themselves (coded in band)
    torch.testing.assert_close(ya.float(), yb.float(), rtol=eps, atol=atol, equal_nan=True)


@pytest.mark.skipif(not Q.triton_available(), reason="triton is not importable")
@pytest.mark.parametrize("group_size", [16, 128])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True)])
def test_triton_matches_ref_across_programs(group_size, bits, symmetric):
    # several programs, each holding many groups, the last one part-filled (one odd group too)
    n = 2 * Q._TILE + 3 * group_size + 5
    x = (torch.randn(n) * torch.rand(n) * 8).to(DEV)
    x[[7, Q._TILE + 1, n - 2]] = torch.tensor(
        [float("nan"), float("inf"), -float("inf")], device=DEV
    )
    a = Q.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, backend="ref")
    b = Q.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, backend="triton")
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert torch.equal(a.nonfinite, b.nonfinite)
    if not symmetric:
        assert torch.equal(a.offset, b.offset)
    ya, yb = Q.dequantize(a, backend="ref"), Q.dequantize(b, backend="triton")
    torch.testing.assert_close(ya, yb, rtol=1e-6, atol=1e-6 * 8, equal_nan=True)
    c = Q.quantize_channelwise(x[: 2 * Q._TILE + 48].view(-1, 16), bits=bits, backend="ref")
    d = Q.quantize_channelwise(x[: 2 * Q._TILE + 48].view(-1, 16), bits=bits, backend="triton")
    assert torch.equal(c.codes, d.codes)
    torch.testing.assert_close(
        Q.dequantize(c, backend="ref"), Q.dequantize(d, backend="triton"), equal_nan=True
    )


@pytest.mark.skipif(not Q.triton_available(), reason="triton is not importable")
def test_triton_channelwise_and_keep_cols_match_ref():
    x = torch.randn(5, 6, device=DEV)
    a, b = (Q.quantize_channelwise(x, backend=be) for be in ("ref", "triton"))
    assert torch.equal(a.codes, b.codes)
    torch.testing.assert_close(Q.dequantize(a, backend="ref"), Q.dequantize(b, backend="triton"))
    keep = torch.tensor([True, False, True, True, True, False], device=DEV)
    a, b = (Q.quantize(x, keep_cols=keep, group_size=4, backend=be) for be in ("ref", "triton"))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


# ----------------------------------------------------------------------------- the CPU path
# backend="auto" off CUDA runs the refs compiled by inductor (ops.compiled_ref) for tensors of
# at least MIN_NUMEL values: it must give the eager ref's codes, scales and counts bit for bit.
def _big(shape, dtype, seed=0):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    flat = x.view(-1)
    flat[5], flat[1000], flat[-1] = float("nan"), float("inf"), -float("inf")
    return x


_CPU_PATH_SHAPES = [((64, 512), 16, True), ((64, 512), 128, False), ((3, 7001), 16, False)]
_CPU_PATH_SHAPES.append(((130, 136), 32, True))
_CPU_PATH_CODES = [(4, True), (4, False), (8, True)]
_CPU_PATH_FAST = {  # every shape, dtype and code once (each case is an inductor compile)
    (torch.float32, (64, 512), 4, True),
    (torch.bfloat16, (64, 512), 8, True),
    (torch.float32, (3, 7001), 4, False),
    (torch.bfloat16, (130, 136), 4, True),
}


def _cpu_path_cases():
    for dtype in (torch.float32, torch.bfloat16):
        for shape, group_size, keep in _CPU_PATH_SHAPES:
            for bits, symmetric in _CPU_PATH_CODES:
                fast = (dtype, shape, bits, symmetric) in _CPU_PATH_FAST
                marks = () if fast else (pytest.mark.slow,)
                args = (dtype, shape, group_size, keep, bits, symmetric)
                yield pytest.param(*args, marks=marks)


@pytest.mark.compiled_refs
@pytest.mark.parametrize("dtype,shape,group_size,keep,bits,symmetric", list(_cpu_path_cases()))
def test_compiled_cpu_path_equals_ref(dtype, shape, group_size, keep, bits, symmetric):
    """(130, 136) with groups of 32: the flat keep path (136 % 32 != 0); (64, 512) with 16:
    whole groups per row; (3, 7001): a padded last group."""
    assert math.prod(shape) >= compiled_ref.MIN_NUMEL
    x = _big(shape, dtype)
    keep_cols = None
    if keep:
        keep_cols = torch.ones(shape[-1], dtype=torch.bool)
        keep_cols[[1, shape[-1] // 2]] = False
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric, keep_cols=keep_cols)
    a, b = Q.quantize(x, backend="ref", **kw), Q.quantize(x, **kw)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert torch.equal(a.nonfinite, b.nonfinite) and int(a.nonfinite.sum()) == 3
    assert (a.offset is None) == symmetric and (symmetric or torch.equal(a.offset, b.offset))
    ya, yb = Q.dequantize(a, dtype=dtype, backend="ref"), Q.dequantize(b, dtype=dtype)
    eps = torch.finfo(dtype).eps  # an FMA may fuse q * scale + offset (asymmetric)
    torch.testing.assert_close(
        yb, ya, rtol=0 if symmetric else eps, atol=0 if symmetric else eps, equal_nan=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.compiled_refs
def test_compiled_cpu_channelwise_equals_ref(dtype, bits):
    x = _big((257, 96), dtype).view(-1, 96)
    a = Q.quantize_channelwise(x, bits=bits, backend="ref")
    b = Q.quantize_channelwise(x, bits=bits)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert torch.equal(a.nonfinite, b.nonfinite)
    ya, yb = Q.dequantize(a, backend="ref"), Q.dequantize(b)
    torch.testing.assert_close(yb, ya, rtol=0, atol=0, equal_nan=True)  # NaN comes back


@pytest.mark.parametrize("c,group_size", [(512, 16), (136, 32), (96, 32)])
def test_keep_cols_is_zeroing_the_columns(c, group_size):
    """Both keep paths (whole groups per row, and flat) code exactly the zeroed input."""
    x = torch.randn(40, c)
    keep = torch.ones(c, dtype=torch.bool)
    keep[[0, c - 1]] = False
    a = Q.quantize_ref(x, 4, group_size, keep_cols=keep)
    b = Q.quantize_ref(x.masked_fill(~keep, 0.0), 4, group_size)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


@pytest.mark.compiled_refs
def test_compiled_cpu_range_statistics_equal_ref():
    """The codecs' per-tensor statistics, compiled on CPU: the row norms of the range check and
    the outlier channels' absolute sums."""
    x = torch.randn(300, 200) * 5
    x[7] *= 1e3
    assert CQ.row_stats(x, 0, 256.0) is not None
    torch.testing.assert_close(CQ.row_stats(x, 0, 256.0), row_stats_ref(x), rtol=1e-6, atol=0)
    torch.testing.assert_close(channel_abs_sums(x), channel_abs_sums_ref(x), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["int4", "int4-asym", "int8", "int4-channel", "int4-outlier"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_codecs_roundtrip_shape_dtype_bytes(name, dtype):
    codec = get_codec(name)
    x = torch.randn(6, 33).to(dtype)
    p = codec.encode(x)
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert codec.nbytes(p) == sum(t.untyped_storage().nbytes() for t in p.tensors.values())
    assert codec.nbytes(p) < x.numel() * x.element_size()
    cos = torch.nn.functional.cosine_similarity(x.float().flatten(), y.float().flatten(), dim=0)
    assert float(cos) > (0.99 if "4" in name else 0.9999)
    assert codec.metadata()["codec"] == name


@pytest.mark.parametrize("name", ["int4", "int4-asym", "int8", "int4-channel", "int4-outlier"])
def test_codecs_empty_and_noncontiguous(name):
    codec = get_codec(name)
    e = torch.empty(0, 4)
    assert codec.decode(codec.encode(e)).shape == (0, 4)
    base = torch.randn(8, 12)
    x = base.t()  # non-contiguous [12, 8]
    y = codec.decode(codec.encode(x))
    ref = codec.decode(codec.encode(x.contiguous()))
    assert y.shape == x.shape and torch.equal(y, ref)


@pytest.mark.parametrize("name", ["int4", "int4-asym", "int8", "int4-channel", "int4-outlier"])
def test_nonfinite_values_take_the_exact_path(name):
    codec = get_codec(name)
    x = torch.randn(16, 8)
    x[2, 3], x[5, 0], x[9, 7] = float("nan"), float("inf"), -float("inf")
    y = codec.decode(codec.encode(x))
    bad = ~torch.isfinite(x)
    assert torch.isnan(y[2, 3]) and y[5, 0] == float("inf") and y[9, 7] == -float("inf")
    assert bool(torch.isfinite(y[~bad]).all())
    # the other values are still quantized against finite scales
    assert float((y[~bad] - x[~bad]).abs().max()) < 0.5 * float(x[~bad].abs().max())


def test_nonfinite_raise_mode_and_bad_inputs():
    x = torch.randn(4, 4)
    x[0, 0] = float("nan")
    for cfg in (QuantConfig(nonfinite="raise"), OutlierConfig(nonfinite="raise"),
                ChannelQuantConfig(nonfinite="raise")):  # fmt: skip
        with pytest.raises(ValueError, match="non-finite"):
            cfg.build().encode(x)
    with pytest.raises(TypeError, match="int64"):
        get_codec("int4").encode(torch.arange(10))
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        QuantConfig(bits=3)
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        QuantConfig(group_size=12)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        QuantConfig(nonfinite="zero")
    with pytest.raises(ValueError, match="threshold must be a number > 0"):
        OutlierConfig(threshold=0)
    with pytest.raises(ValueError, match="channels=5 does not divide"):
        ChannelQuantConfig(channels=5).build().encode(torch.randn(4, 4))
    with pytest.raises(ValueError, match="backend must be one of"):
        Q.quantize(torch.randn(4), backend="cuda")


def test_outlier_channels_detected_kept_exact_and_counted():
    torch.manual_seed(1)
    x = torch.randn(64, 48)
    hot = [5, 30]
    x[:, hot] *= 40.0
    assert count_outlier_channels(x) == 2
    assert outlier_mask(x).nonzero().view(-1).tolist() == hot
    codec = get_codec("int4-outlier")
    p = codec.encode(x)
    assert p.meta["n_outliers"] == 2 and p.tensors["outlier_idx"].tolist() == hot
    y = codec.decode(p)
    assert torch.equal(y[:, hot], x[:, hot])
    normal = [c for c in range(48) if c not in hot]
    plain = get_codec("int4").decode(get_codec("int4").encode(x))
    err_outlier = (y[:, normal] - x[:, normal]).abs().mean()
    err_plain = (plain[:, normal] - x[:, normal]).abs().mean()
    assert err_outlier < err_plain / 5  # the outliers no longer inflate the normal groups' scales
    # exact cost: INT4 codes + scales + k*rows original values + k int32 indices
    groups = -(-x.numel() // 128)
    assert codec.nbytes(p) == x.numel() // 2 + 4 * groups + 64 * 2 * 4 + 2 * 4


def test_outlier_threshold_and_degenerate_inputs():
    x = torch.randn(32, 16)
    x[:, 3] *= 4.0
    assert count_outlier_channels(x, threshold=100.0) == 0
    assert count_outlier_channels(torch.ones(8, 16)) == 0  # std 0: no outliers
    assert count_outlier_channels(torch.randn(8, 1)) == 0  # a single channel
    assert count_outlier_channels(torch.arange(6).view(2, 3)) == 0  # integers: none


def test_count_true_is_exact_past_float32s_integers():
    """count_true sums in floating point (a vectorized reduction when compiled); past 2**24
    values along the dim float32 would round, so it sums in float64 there."""
    mask = torch.rand(5, 37, generator=torch.Generator().manual_seed(0)) < 0.3
    for dim in (0, 1, -1):
        got = Q.count_true(mask, dim)
        assert got.dtype == torch.int32 and torch.equal(got, mask.sum(dim, dtype=torch.int32))
    long = torch.ones(2**24 + 3, dtype=torch.bool)
    assert int(Q.count_true(long, 0)) == 2**24 + 3
