"""The INT codecs' fused deferred encode (``ops.quant_stats``: two Triton launches, codes and
verdict statistics) against the eager path it replaces, under ``TRITON_INTERPRET=1``.

The payload (codes, scales, offsets) must be the eager path's bit for bit, the scale bounds
too; the row norms may differ by a few ulps (another summation order), and every verdict must
read the same. Tiny tensors: the interpreter runs a kernel in NumPy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slimact.codecs.base import get_codec
from slimact.ops import device_path
from slimact.ops.deferred import DeferredChecks
from slimact.ops.quant import triton_available

interpreted = pytest.mark.skipif(
    not (triton_available() and device_path.interpreter_on()),
    reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py sets it on a CPU)",
)


def _flat(verdict) -> torch.Tensor:
    return torch.cat([v.reshape(-1).float() for v in verdict])


def _both(codec, x, state=None):
    eager = codec.encode_deferred(x, dict(state or {}))
    with device_path.cuda_path():
        assert codec.fuses(x, dict(state or {}))
        fused = codec.encode_deferred(x, dict(state or {}))
        decoded = codec.decode(fused.packed), codec.decode(eager.packed)
    return eager, fused, decoded


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    odd = torch.randn(13, 7, generator=g)  # groups span rows
    wide = torch.randn(600, 40, generator=g)  # 600 rows: every 2nd row sampled
    nonc = torch.randn(48, 24, generator=g).t()  # non-contiguous
    bad = torch.randn(5, 48, generator=g)
    bad[1, 3], bad[2, 0], bad[4, 47] = float("nan"), float("inf"), -float("inf")
    big = torch.randn(4, 3, 32, generator=g) * 1e20  # squares overflow: the verdict says so
    zeros = torch.zeros(2, 16)
    return [t.to(dtype) for t in (odd, wide, nonc, bad, big, zeros)]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4", "int8", "int4-asym", "int4/g16"])
def test_fused_deferred_encode_matches_the_eager_one(name, dtype):
    codec = get_codec(name)
    for x in _inputs(dtype):
        eager, fused, (y_fused, y_eager) = _both(codec, x)
        assert set(eager.packed.tensors) == set(fused.packed.tensors)
        for k, t in eager.packed.tensors.items():
            assert torch.equal(t, fused.packed.tensors[k]), (name, tuple(x.shape), k)
        assert eager.packed.meta == fused.packed.meta
        torch.testing.assert_close(y_fused, y_eager, equal_nan=True, rtol=0, atol=0)
        a, b = _flat(eager.verdict), _flat(fused.verdict)
        assert a.shape == b.shape
        scales = 2 if codec.config.symmetric else 3
        assert torch.equal(a[-scales:], b[-scales:])  # the scale bounds: bit for bit
        torch.testing.assert_close(b[:-scales], a[:-scales], rtol=4e-7, atol=0)  # the norms
        assert eager.explain(a.tolist()) == fused.explain(b.tolist()), (name, tuple(x.shape))


@interpreted
def test_fused_verdict_reports_what_the_eager_one_reports():
    codec = get_codec("int4")
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    x[5] *= 1e3  # a massive row: beyond the range limit
    eager, fused, _ = _both(codec, x)
    why = fused.explain(_flat(fused.verdict).tolist())
    assert why is not None and why == eager.explain(_flat(eager.verdict).tolist())


@interpreted
def test_a_row_split_site_keeps_the_eager_path():
    codec = get_codec("int4")
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with device_path.cuda_path():
        assert not codec.fuses(x, {"rows": 1})  # massive rows stored exactly: rows.py's path
        assert codec.fuses(x, {"rows": 0})
    assert not codec.fuses(x, {})  # the CPU path


@interpreted
def test_cuda_path_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with device_path.cuda_path():
            pass
    assert not device_path.forced()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())
    )


def _outlier_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 48, generator=g)
    x[:, [5, 30]] *= 40.0  # two outlier channels
    x[3, 7], x[4, 9], x[6, 11] = float("nan"), float("inf"), -float("inf")  # three more
    nonc = (torch.randn(32, 20, generator=g) * torch.linspace(1, 30, 20)).t()  # [20, 32] view
    odd = torch.randn(9, 5, generator=g)  # groups span rows
    return [t.to(dtype) for t in (x, nonc, odd)]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4-outlier", "int4-outlier-g16", "int8-outlier"])
def test_fused_outlier_encode_matches_the_eager_one(name, dtype):
    codec = get_codec(name)
    for x in _outlier_inputs(dtype):
        for capacity in (0, 3, 6):  # not 2: three channels tie at +inf (ties: below)
            sa, sb = {"capacity": capacity}, {"capacity": capacity}
            eager = codec.encode_deferred(x, sa)
            with device_path.cuda_path():
                assert codec.fuses(x, sb)
                fused = codec.encode_deferred(x, sb)
                y_fused, y_eager = codec.decode(fused.packed), codec.decode(eager.packed)
            assert set(eager.packed.tensors) == set(fused.packed.tensors)
            for k, t in eager.packed.tensors.items():
                assert _same(t, fused.packed.tensors[k]), (name, tuple(x.shape), capacity, k)
            assert eager.packed.meta == fused.packed.meta
            assert _same(y_fused, y_eager)
            a, b = _flat(eager.verdict), _flat(fused.verdict)
            assert a.shape == b.shape and a[0] == b[0]  # the outlier count
            torch.testing.assert_close(b, a, rtol=4e-7, atol=0)
            assert eager.explain(a.tolist()) == fused.explain(b.tolist())
            assert sa == sb  # the capacity follows the same count


@interpreted
def test_fused_outlier_encode_of_tied_scores_decodes_as_the_eager_one():
    """Channels whose sums do not vary score -inf alike: no outlier, and which of them fill
    the capacity is the kernel's choice (the lowest) where torch.topk makes its own."""
    codec = get_codec("int4-outlier")
    x = torch.ones(16, 32)
    eager = codec.encode_deferred(x, {"capacity": 3})
    with device_path.cuda_path():
        fused = codec.encode_deferred(x, {"capacity": 3})
        y = codec.decode(fused.packed)
    assert fused.packed.tensors["outlier_idx"].tolist() == [0, 1, 2]
    assert not fused.packed.tensors["outlier_flag"].any()
    assert torch.equal(y, codec.decode(eager.packed))
    assert _flat(fused.verdict)[0] == 0 == _flat(eager.verdict)[0]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int8-channel", "int4-channel"])
def test_fused_channelwise_encode_matches_the_eager_one(name, dtype):
    codec = get_codec(name)
    for x in _inputs(dtype):
        eager = codec.encode_deferred(x, {})
        with device_path.cuda_path():
            fused = codec.encode_deferred(x, {})
            y_fused, y_eager = codec.decode(fused.packed), codec.decode(eager.packed)
        for k, t in eager.packed.tensors.items():
            assert _same(t, fused.packed.tensors[k]), (name, tuple(x.shape), k)
        assert eager.packed.meta == fused.packed.meta and _same(y_fused, y_eager)
        a, b = _flat(eager.verdict), _flat(fused.verdict)
        assert a.shape == b.shape and torch.equal(a[-2:], b[-2:])
        torch.testing.assert_close(b, a, rtol=4e-7, atol=0)
        assert eager.explain(a.tolist()) == fused.explain(b.tolist())


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outlier_decode_in_one_launch_matches_the_eager_one(dtype):
    """A checked encode's payload (every stored channel an outlier, no flags) and a deferred
    one's (flags), decoded by the dequantize kernel writing the exact columns in its pass."""
    codec = get_codec("int4-outlier-g16")
    x = _outlier_inputs(dtype)[0]
    for packed in (codec.encode(x), codec.encode_deferred(x, {"capacity": 6}).packed):
        assert "outlier_idx" in packed.tensors
        with device_path.cuda_path():
            fused = codec.decode(packed)
        # one rounding apart at most in bf16 (the interpreter truncates to bf16: test_quant.py)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(fused, codec.decode(packed), rtol=eps, atol=0, equal_nan=True)
        idx = packed.tensors["outlier_idx"].long()
        flags = packed.tensors.get("outlier_flag", torch.ones(idx.numel(), dtype=torch.bool))
        assert _same(fused[:, idx[flags]], x[:, idx[flags]])  # the exact columns: exact


def _ref_twin(codec):
    return type(codec)(dataclasses.replace(codec.config, backend="ref"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name", ["int4", "int8", "int4-asym", "int4-outlier-g16", "int8-outlier", "int8-channel"]
)
def test_fused_codecs_on_cuda_match_the_refs(name, dtype):
    """On CUDA: the fused kernels (atomics, the column kernel's ticket) against the refs run
    eagerly on the same tensors, twice in a row (the ticket is reset between calls)."""
    codec = get_codec(name)
    ref = _ref_twin(codec)
    g = torch.Generator().manual_seed(4)
    big = torch.randn(2048, 1024, generator=g)
    big[:, [7, 300]] *= 50.0
    big[5, 9] = float("nan")
    shapes = [big, torch.randn(96, 48, 24, generator=g).transpose(0, 1), torch.randn(37, 48)]
    for x in (t.to(dtype).cuda() for t in shapes):
        state = {"capacity": 3}
        eager = ref.encode_deferred(x, dict(state))
        for _ in range(2):
            fused = codec.encode_deferred(x, dict(state))
            for k, t in eager.packed.tensors.items():
                assert _same(t, fused.packed.tensors[k]), (name, tuple(x.shape), k)
            a, b = _flat(eager.verdict), _flat(fused.verdict)
            torch.testing.assert_close(b, a, rtol=2e-6, atol=0)
            assert eager.explain(a.tolist()) == fused.explain(b.tolist())
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(
            codec.decode(fused.packed).float(), ref.decode(eager.packed).float(), rtol=eps,
            atol=0, equal_nan=True,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verdict_batch_casts_into_float64_on_cuda():
    checks = DeferredChecks()
    got: list = []
    f32 = torch.tensor([1.5, 2.25], device="cuda")
    i64 = torch.tensor([3, 2**40 + 1], device="cuda")
    checks.add([f32, i64], got.extend)
    checks.wait()
    assert got == [1.5, 2.25, 3.0, float(2**40 + 1)]


@interpreted
def test_the_fused_kernels_can_be_turned_off(monkeypatch):
    """``SLIMACT_FUSED_CODECS=0``: the quantize kernel alone, the statistics eager; unset, the
    fused kernels run in the interpreter only, not on a device no GPU check has verified."""
    monkeypatch.setattr(device_path, "_FUSED_SETTING", "")
    assert device_path.fused_codecs() == device_path.interpreter_on()
    monkeypatch.setattr(device_path, "interpreter_on", lambda: False)
    assert not device_path.fused_codecs()
    monkeypatch.setattr(device_path, "_FUSED_SETTING", "1")
    assert device_path.fused_codecs()
    monkeypatch.undo()
    monkeypatch.setattr(device_path, "_FUSED_SETTING", "0")
    x = torch.randn(16, 32)
    for name in ("int4", "int4-outlier"):
        with device_path.cuda_path():
            assert not get_codec(name).fuses(x, {})
