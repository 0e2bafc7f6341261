"""slimact.compiled: traced codec hook pairs, inlined into per-block torch.compile (issue 16).

Fast tests check the traced math against ``slimact.ops.quant``'s reference and the shape rules
without compiling. The ``slow`` tests compile llama-tiny blocks (tens of seconds per codec on a
shared CPU); compiled models are cached per module so each codec compiles once.
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact import compiled as C
from slimact.models import build_model
from slimact.ops.quant import Quantized, dequantize_ref
from slimact.ops.quant import _unpack as unpack_ref


def _ref_codes(ref: Quantized) -> torch.Tensor:
    """The reference's biased codes, one per value, in logical order."""
    return unpack_ref(ref.codes, ref.numel, ref.bits)


def _codes(payload: tuple) -> torch.Tensor:
    """The traced payload's biased codes, one per value, in logical order."""
    return C.unpack_codes(payload[0], payload[3]).reshape(-1)


def _x(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


# ----------------------------------------------------------------------------- math vs reference
@pytest.mark.parametrize("name", ["int8", "int6", "int4"])
@pytest.mark.parametrize(
    "shape", [(4, 64, 128), (3, 7, 96), (50, 100), (2, 3, 13, 40), (8, 2048), (2, 33, 101)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_equals_quant_reference(name, shape, dtype):
    codec = C.CODECS[name]
    x = _x(*shape, dtype=dtype)
    ref = C.encode_ref(codec, x)
    payload = C.encode(codec, x)
    assert ref is not None and len(payload) == 4
    codes, scale, out_dtype, bits = payload
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float32 and out_dtype == dtype
    assert bits == ref.bits
    assert codes.shape[-1] == x.shape[-1] * max(bits, 4) // 8  # packed: 4 / 6 / 8 bits a value
    assert torch.equal(_codes(payload), _ref_codes(ref))
    assert torch.equal(scale.reshape(-1), ref.scale)
    y = C.decode(payload)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, C.decode_ref(ref, x))
    assert torch.equal(y, dequantize_ref(ref, dtype=dtype).view(x.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int8", "int6", "int4", "int4-outlier", "prac"])
def test_noncontiguous_input_decodes_with_its_strides(name, dtype):
    """What a q/k/v transpose saves ([B, H, S, D] over [B, S, H, D] storage) is coded in memory
    order and comes back with the same strides: a compiled backward was laid out for them."""
    x = _x(2, 64, 4, 32, dtype=dtype).permute(0, 2, 1, 3)
    codec = C.CODECS[name]
    payload = C.encode(codec, x)
    assert payload[0] == C.LAYOUT and payload[1] == (0, 2, 1, 3)
    y = C.decode(payload)
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == dtype
    if name == "prac":
        return
    ref = C.encode_ref(codec, x)
    assert torch.equal(_codes(payload[2:]), _ref_codes(ref))  # codes in memory order
    if name != "int4-outlier":  # (its decode puts the exact channels back; the ref zeroes them)
        assert torch.equal(y, C.decode_ref(ref, x))
    contiguous = C.decode(C.encode(codec, x.contiguous()))  # the same values, either layout
    assert torch.equal(y.contiguous(), contiguous)


def test_layouts_that_need_no_permutation_or_have_none():
    x = _x(4, 64, 32)
    assert C.memory_order(x) is None  # contiguous
    assert C.memory_order(x[:, :, :16]) is None  # not dense: decoded contiguous, as before
    assert C.memory_order(x.transpose(0, 1)) == (1, 0, 2)
    assert C.memory_order(x.transpose(1, 2)) == (0, 2, 1)  # channels innermost: coded [.., D, S]
    t = x.transpose(1, 2)
    assert C.decode(C.encode(C.CODECS["int8"], t)).stride() == t.stride()
    kept = x[:, :1].transpose(0, 1)  # kept exact by the shape rules: the tensor itself
    assert (
        len(C.encode(C.CODECS["none"], kept)) == 1 and C.encode(C.CODECS["none"], kept)[0] is kept
    )


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_pack_codes_round_trip_every_code(bits):
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 1 << bits, (3, 5, 64), generator=g).to(torch.uint8)
    u[0, 0], u[0, 1] = (1 << bits) - 1, 0  # every bit set / none
    packed = C.pack_codes(u, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(C.unpack_codes(packed, bits), u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 64, 128), (3, 7, 96), (2, 33, 101)])
def test_outlier_channels_equal_reference_and_are_exact(shape, dtype):
    codec = dataclasses.replace(C.CODECS["int4-outlier"], outliers=0.02)  # k = 2 or 3
    x = _x(*shape, dtype=dtype)
    idx = torch.tensor([1, shape[-1] - 2])
    x[..., idx] *= 40  # two outlier channels
    ref = C.encode_ref(codec, x)
    payload = C.encode(codec, x)
    y = C.decode(payload)
    assert y.shape == x.shape and y.dtype == dtype
    if payload[3] == 8:  # odd widths fall back to INT8 per row, with no outliers
        assert len(payload) == 4 and shape[-1] % 2
        return
    k = codec.outliers_for(shape[-1], 4)
    cols, got = payload[4:]
    assert cols.shape == (x.numel() // shape[-1], k) and cols.dtype == dtype
    assert set(idx.tolist()) <= set(got.tolist())
    assert torch.equal(_codes(payload), _ref_codes(ref))
    assert torch.equal(payload[1].reshape(-1), ref.scale)
    expect = C.decode_ref(ref, x)
    expect[..., got] = x[..., got]
    assert torch.equal(y, expect)
    assert torch.equal(y[..., idx], x[..., idx])


def test_outlier_path_keeps_a_nan_where_it_was():
    """A NaN makes its channel's score NaN, which ``topk`` ranks first: the channel is stored
    exactly, so the NaN comes back alone instead of spreading over its INT4 group."""
    x = _x(64, 256)
    x[5, 10] = float("nan")
    y = C.decode(C.encode(C.CODECS["int4-outlier"], x))
    assert torch.isnan(y[5, 10]) and int(torch.isnan(y).sum()) == 1
    assert torch.equal(y[:, 10][~torch.isnan(x[:, 10])], x[:, 10][~torch.isnan(x[:, 10])])


def test_outlier_separation_keeps_the_small_channels_accurate():
    x = _x(64, 512)
    x[:, [7, 300]] *= 60
    small = torch.ones(512, dtype=torch.bool)
    small[[7, 300]] = False

    def err(name):
        y = C.decode(C.encode(C.CODECS[name], x))
        return float((y - x)[:, small].norm() / x[:, small].norm())

    assert err("int4-outlier") < 0.5 * err("int4")


def test_pack_codes_layout():
    """INT4: byte j holds code j (low nibble) and code j + D/2; INT6: bytes j, j + D/4, j + D/2
    hold codes j, j + D/4, j + D/2 in their low 6 bits and code j + 3D/4's bits 0-1, 2-3, 4-5."""
    u = torch.arange(64, dtype=torch.uint8).view(1, 64)
    p4 = C.pack_codes(u % 16, 4)
    assert p4[0, 3].item() == 3 | (35 % 16) << 4
    p6 = C.pack_codes(u, 6)
    d = 48 + 5
    assert [p6[0, 5 + 16 * i].item() for i in range(3)] == [
        (5 + 16 * i) | ((d >> 2 * i) & 3) << 6 for i in range(3)
    ]


@pytest.mark.parametrize(
    ("name", "last", "expect"),
    [
        ("int8", 512, (8, 512)),  # per row
        ("int4", 512, (4, 32)),
        ("int4", 20, (8, 20)),  # gcd 4 < 8: INT8 per row
        ("int4", 48, (4, 16)),  # gcd(48, 32) = 16
        ("int4", 101, (8, 101)),  # odd: INT8 per row
        ("int6", 1376, (6, 1376)),  # per row
        ("int6", 20, (6, 20)),
        ("int6", 102, (8, 102)),  # 102 % 4 = 2: no four slices, INT8 per row
    ],
)
def test_group_choice(name, last, expect):
    assert C.CODECS[name].group_for(last) == expect


@pytest.mark.parametrize(
    "x",
    [
        _x(4, 300, 1),  # norm statistics (..., 1)
        _x(2, 8, 16),  # below min_numel
        _x(5000),  # 1-D
        torch.randint(0, 9, (64, 64)),  # integer
        torch.ones(63, 65, dtype=torch.bool),  # a mask whose size 8 does not divide
    ],
    ids=["stats", "small", "1d", "int", "bool-odd"],
)
@pytest.mark.parametrize("name", ["int8", "int6", "int4"])
def test_kept_exact_by_shape(x, name):
    payload = C.encode(C.CODECS[name], x)
    assert len(payload) == 1 and payload[0] is x
    assert C.decode(payload) is x
    assert C.encode_ref(C.CODECS[name], x) is None


def _sdpa_graph():
    def f(q, k, v, h):
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        return out[0] + h, out[1], h * 2

    g = torch.fx.symbolic_trace(f).graph
    nodes = {n.name: n for n in g.nodes}
    getitems = [n for n in g.nodes if n.target is operator.getitem]
    return nodes, getitems


def test_attention_roles_from_the_saved_node():
    """SDPA's logsumexp, q and k exact, v and output at attention_bits, everything else at the
    codec's."""
    nodes, (out, lse) = _sdpa_graph()
    x = _x(2, 4, 64, 32)
    int4 = C.CODECS["int4"]
    assert C.choose(int4, x, lse) is None
    assert C.choose(int4, x, out) == C.choose(int4, x, nodes["v"]) == (8, 32)
    assert C.choose(int4, x, nodes["q"]) is None and C.choose(int4, x, nodes["k"]) is None
    assert C.choose(int4, x, nodes["h"]) == (4, 32)
    assert C.choose(int4, x, None) == (4, 32)
    exact_attn = C.CompiledCodec(bits=4, group_size=32, attention_bits=0)
    assert C.choose(exact_attn, x, out) is None
    coded_qk = C.CompiledCodec(bits=4, group_size=32, qk_bits=None)  # None: attention_bits
    assert C.choose(coded_qk, x, nodes["q"]) == (8, 32)
    six = C.CompiledCodec(bits=6, qk_bits=6)
    assert C.choose(six, x, nodes["q"]) == C.choose(six, x, nodes["k"]) == (6, 32)
    # int6: q and k exact, v and the output at 8
    int6 = C.CODECS["int6"]
    assert C.choose(int6, x, nodes["q"]) is None and C.choose(int6, x, nodes["k"]) is None
    assert C.choose(int6, x, nodes["v"]) == C.choose(int6, x, out) == (8, 32)
    assert C.choose(int6, x, lse) is None
    # the pack reads the node from AOTAutograd's per-tensor context
    from torch._functorch._aot_autograd.graph_compile import _saved_tensor_hook_context

    with _saved_tensor_hook_context({"_node": lse}):
        assert C.encode(int4, x)[0] is x
    with _saved_tensor_hook_context({"_node": nodes["q"]}):
        assert C.encode(int4, x)[0] is x  # q: exact
    with _saved_tensor_hook_context({"_node": nodes["v"]}):
        assert C.encode(int4, x)[3] == 8


@pytest.mark.parametrize("shape", [(64, 64), (2, 4, 64, 64), (8, 129, 8)])
@pytest.mark.parametrize("name", ["int8", "int6", "int4"])
def test_masks_packed_as_bits_losslessly(shape, name):
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.9  # dropout's keep
    payload = C.encode(C.CODECS[name], x)
    assert payload[1] is torch.bool and payload[0].dtype == torch.uint8
    assert payload[0].numel() * 8 == x.numel()  # one bit per value
    y = C.decode(payload)
    assert y.dtype == torch.bool and y.shape == x.shape and torch.equal(y, x)
    # the layout: bit i of byte j is value i * numel / 8 + j of the flat mask
    flat, m = x.flatten(), x.numel() // 8
    assert all(bool(payload[0][j] >> i & 1) == bool(flat[i * m + j]) for i, j in ((0, 0), (7, 1)))
    assert C.encode(C.CompiledCodec(bits=8, masks=False), x)[0] is x  # opted out: kept
    assert C.encode(C.CODECS["none"], x)[0] is x  # the identity codec keeps everything


def test_none_codec_keeps_everything():
    x = _x(64, 64)
    assert C.encode(C.CODECS["none"], x)[0] is x


def test_error_bound():
    x = _x(16, 256)
    for name, levels in (("int8", 127), ("int6", 31), ("int4", 7)):
        codec = C.CODECS[name]
        y = C.decode(C.encode(codec, x))
        _, g = codec.group_for(256)
        step = x.view(16, -1, g).abs().amax(-1, keepdim=True) / levels
        assert ((y - x).view(16, -1, g).abs() <= step / 2 + 1e-6).all()


def test_config_validation():
    with pytest.raises(ValueError, match="bits"):
        C.CompiledCodec(bits=2)
    with pytest.raises(ValueError, match="even"):
        C.CompiledCodec(bits=4, group_size=3)
    with pytest.raises(ValueError, match="filtering"):
        C.CompiledCodec(filtering="some")
    with pytest.raises(ValueError, match="qk_bits"):
        C.CompiledCodec(qk_bits=5)
    with pytest.raises(ValueError, match="outliers"):
        C.CompiledCodec(bits=4, outliers=1.0)
    with pytest.raises(ValueError, match="unknown compiled codec"):
        C.CompiledCodecConfig("int3")


def test_hook_pair_is_graph_modules_built_once():
    pack, unpack = C.hook_pair("int8")
    assert isinstance(pack, torch.fx.GraphModule) and isinstance(unpack, torch.fx.GraphModule)
    assert C.hook_pair("int8") == (pack, unpack)  # same objects: dynamo guards on their ids
    assert C.hook_pair("int8") is not C.hook_pair("int4")


def test_hook_pair_works_eagerly():
    """The same GraphModules are valid eager hooks (a reference for the inlined path)."""
    w = _x(128, 128, seed=1).requires_grad_()
    x = _x(32, 128, seed=2)

    def loss():
        return (F.silu(x @ w) @ w).square().mean()

    loss().backward()
    exact = w.grad.clone()
    w.grad = None
    with C.codec_hooks("int8"):
        loss().backward()
    assert F.cosine_similarity(w.grad.flatten(), exact.flatten(), dim=0) > 0.999


def test_strategies_registered():
    names = slimact.strategy_names()
    for n in (
        "compiled-none",
        "compiled-int8",
        "compiled-int6",
        "compiled-int4",
        "compiled-int4-outlier",
        "compiled-prac",
    ):
        assert n in names


def test_forward_live_bytes_matches_meter(one_thread):
    model = build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 32))
    with slimact.measure(model) as m:
        _ = model(x, targets=x).loss
    live, loss = C.forward_live_bytes(lambda: model(x, targets=x).loss)
    assert loss.requires_grad
    # the profiler sees every saved storage plus the 4-byte loss; the meter counts only saves
    assert abs(live - m.report.total_bytes) <= 0.01 * m.report.total_bytes


def test_no_blocks_is_reported():
    changes = C.compile_blocks_with(torch.nn.Linear(4, 4), C.BlockChoice(codec="int8"))
    assert len(changes) == 1 and changes[0].skipped


# ----------------------------------------------------------------------------- compiled (slow)
X = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(2))


def _grads(model, x=X, y=Y, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, targets=y).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]).double()


def _cos(a, b):
    return float(F.cosine_similarity(a, b, dim=0))


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64
    return build_model("llama-tiny")


@pytest.fixture(scope="module")
def exact(base):
    return _grads(base)


_CACHE: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="module")
def compiled_model(base):
    from torch._dynamo.utils import counters

    counters.clear()

    def get(strategy: str) -> torch.nn.Module:
        if strategy not in _CACHE:
            _CACHE[strategy] = slimact.apply(copy.deepcopy(base), strategy)
            _grads(_CACHE[strategy])  # compile
        return _CACHE[strategy]

    yield get
    _CACHE.clear()


@pytest.mark.slow
def test_compiled_none_matches_autograd(compiled_model, exact):
    g = _grads(compiled_model("compiled-none"))
    torch.testing.assert_close(g, exact, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", ["compiled-int8", "compiled-int6", "compiled-int4", "compiled-int4-outlier"]
)
def test_lossy_codecs_gradient_cosine(compiled_model, exact, strategy):
    g = _grads(compiled_model(strategy))
    assert _cos(g, exact) >= 0.99
    assert not torch.equal(g, exact)  # the codec really ran


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["compiled-int8", "compiled-int4"])
def test_hooks_are_inlined(compiled_model, strategy):
    """After compilation the pack/unpack helpers never run (nothing per tensor in Python), and
    what the compiled region saves for backward is the packed payload (uint8 codes)."""
    model = compiled_model(strategy)
    before = dict(C.TRACE_CALLS)
    _grads(model)
    loss = model(X, targets=Y).loss
    assert C.TRACE_CALLS == before
    saved = C.compiled_saved_tensors(loss)
    assert any(t.dtype == torch.uint8 for t in saved)
    # statistics (..., 1) stay exact fp32
    assert any(t.dtype == torch.float32 and t.shape[-1] == 1 and t.dim() == 3 for t in saved)


@pytest.mark.slow
def test_zero_graph_breaks_and_fewer_bytes(compiled_model):
    from torch._dynamo.utils import counters

    none = compiled_model("compiled-none")
    int8 = compiled_model("compiled-int8")
    assert not counters["graph_break"]
    b_none, _ = C.forward_live_bytes(lambda: none(X, targets=Y).loss)
    b_int8, _ = C.forward_live_bytes(lambda: int8(X, targets=Y).loss)
    assert b_int8 < 0.6 * b_none


@pytest.mark.slow
def test_bf16_autocast(compiled_model, base):
    exact = _grads(base, autocast=True)
    g = _grads(compiled_model("compiled-int8"), autocast=True)
    assert _cos(g, exact) >= 0.99


@pytest.mark.slow
def test_odd_shapes():
    """Head dim 20 (INT4 groups fall back to INT8 rows), d_ff 101 (odd), seq 13, batch 3."""
    torch.manual_seed(0)
    model = build_model("llama-tiny", d_model=60, n_heads=3, d_ff=101)
    x = torch.randint(0, 257, (3, 13))
    exact = _grads(model, x, x)
    slimact.apply(model, "compiled-int4")
    g = _grads(model, x, x)
    assert _cos(g, exact) >= 0.99
    slimact.revert(model)
    torch.testing.assert_close(_grads(model, x, x), exact, rtol=0, atol=0)


@pytest.mark.slow
def test_revert_restores_eager(base, compiled_model, exact):
    from slimact.hf import patched_modules

    model = copy.deepcopy(base)
    slimact.apply(model, "compiled-int8")
    assert patched_modules(model)
    with pytest.raises(TypeError, match="cannot copy"):
        copy.deepcopy(model)
    slimact.revert(model)
    assert patched_modules(model) == []
    assert torch.equal(_grads(model), exact)
    with slimact.measure(model) as m:  # eager again: the router names every save
        _ = model(X, targets=Y).loss
    assert any(s.op == "linear" for s in m.report.sites)


def test_the_outlier_codec_is_named_as_its_eager_twin_and_its_old_name_still_reads():
    """The traced outlier codec is ``int4-outlier`` (the eager codec's word order); its earlier
    name ``outlier-int4`` still reads, in a spec, a codec name and a saved choice."""
    from slimact.compiled.strategies import CompiledCodecConfig
    from slimact.registry import resolve

    assert "int4-outlier" in C.CODECS and "outlier-int4" not in C.CODECS
    assert C.resolve_codec("outlier-int4") is C.CODECS["int4-outlier"]
    assert C.resolve_codec("outlier-int4-sr").rounding == "stochastic"
    assert C.BlockChoice(0.5, "outlier-int4").codec == "int4-outlier"
    old = {"budget": 0.5, "codec": "outlier-int4-sr", "offload": False}
    assert C.BlockChoice.from_dict(old) == C.BlockChoice(0.5, "int4-outlier-sr")
    (config,) = resolve("compiled-outlier-int4@0.25,sr")
    assert config == CompiledCodecConfig("int4-outlier-sr", 0.25)
    assert config.name == "compiled-int4-outlier@0.25,sr"
    assert "compiled-outlier-int4" not in slimact.strategy_names()
    with pytest.raises(ValueError, match="unknown compiled codec 'int4-outliers'"):
        C.resolve_codec("int4-outliers")
