"""The CPU path's compile cache (``slimact.ops.compiled_ref``): keys, and failures kept local."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from slimact.ops import compiled_ref as cr

pytestmark = pytest.mark.compiled_refs  # the compiled CPU path itself


def f_good(x, *, k):
    return x * k + 1


def f_bad(x, *, k):
    return x * k - 1


@pytest.fixture
def fresh(monkeypatch):
    for name, empty in (("_COMPILED", {}), ("_BROKEN", []), ("_EAGER_KEYS", {})):
        monkeypatch.setattr(cr, name, empty)
    monkeypatch.setattr(cr, "_WORKED", [True])  # the compiler has worked in this process


def test_requires_grad_is_part_of_the_key(fresh):
    """Dynamo guards on requires_grad: without it in the key, a codec's saved tensors (some
    requiring grad, some not) recompiled one entry past dynamo's limit of 8."""
    x = torch.randn(1 << 14)
    with torch.no_grad():
        a = cr.call(f_good, x, k=2.0)
        b = cr.call(f_good, x.clone().requires_grad_(True), k=2.0)
    assert torch.equal(a, x * 2.0 + 1) and torch.equal(b, a)
    keys = [key for key in cr._COMPILED if key[0] is f_good]
    assert len(keys) == 2 and not cr._BROKEN and not cr._EAGER_KEYS


class _Mode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_torch_function_modes_are_part_of_the_key(fresh):
    """Dynamo guards on the types of the active TorchFunctionModes (the site router runs one):
    a ref called inside and outside such a mode, in many states, compiles each state once and
    never falls back to eager."""
    x = torch.randn(1 << 14)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recompile-limit fallback warns
        for i in range(12):
            with _Mode() if i % 2 else contextlib.nullcontext():
                assert torch.equal(cr.call(f_good, x, k=3.0), x * 3.0 + 1)
    keys = [key for key in cr._COMPILED if key[0] is f_good]
    assert len(keys) == 2 and not cr._EAGER_KEYS and not cr._BROKEN


def test_a_failure_after_the_compiler_worked_is_that_keys_alone(fresh, monkeypatch):
    real = torch.compile

    def compile_(fn, **kw):  # the compiler works, except for f_bad's frame
        if fn.__name__.startswith("f_bad"):

            def run(*args):
                raise RuntimeError("FailOnRecompileLimitHit: stand-in")

            return run
        return real(fn, **kw)

    monkeypatch.setattr(torch, "compile", compile_)
    x = torch.randn(1 << 14)
    with pytest.warns(RuntimeWarning, match="f_bad failed for one input state .*the others stay"):
        assert torch.equal(cr.call(f_bad, x, k=3.0), x * 3.0 - 1)  # eager, still right
    assert cr.available() and len(cr._EAGER_KEYS) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for that key
        assert torch.equal(cr.call(f_bad, x, k=3.0), x * 3.0 - 1)
        assert torch.equal(cr.call(f_good, x, k=3.0), x * 3.0 + 1)  # compiled, as before
    assert any(key[0] is f_good for key in cr._COMPILED) and cr.available()


class _CudaLike:
    """What :func:`cr.run` reads of its first tensor: a CUDA tensor of ``MIN_NUMEL`` values."""

    is_cuda = True

    def numel(self) -> int:
        return cr.MIN_NUMEL


def test_cuda_tensors_run_eagerly_unless_the_switch_is_on(monkeypatch):
    """The CUDA A/B switch: off by default, on inside ``compiled_refs_on_cuda()`` (nested, and
    restored on exit); ``run_cuda`` leaves CPU tensors eager even inside."""
    calls = []
    monkeypatch.setattr(cr, "call", lambda fn, *t, **s: calls.append(fn) or "compiled")
    monkeypatch.setattr(cr, "_ON_CUDA", [False])
    t = _CudaLike()

    def eager(x):
        return "eager"

    assert cr.run(eager, t) == "eager" and cr.run_cuda(eager, t) == "eager" and not calls
    with cr.compiled_refs_on_cuda():
        assert (
            cr.on_cuda() and cr.run(eager, t) == "compiled" and cr.run_cuda(eager, t) == "compiled"
        )
        with cr.compiled_refs_on_cuda(False):
            assert cr.run(eager, t) == "eager"
        assert cr.run_cuda(eager, torch.randn(cr.MIN_NUMEL)) == "eager"  # CPU: eager
        assert cr.run(eager, torch.randn(cr.MIN_NUMEL)) == "compiled"  # the CPU path as ever
    assert not cr.on_cuda() and len(calls) == 3


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False)])
def test_the_environment_variable_sets_the_default(monkeypatch, value, on):
    monkeypatch.setenv(cr.CUDA_ENV, value)
    assert cr.env_on_cuda() is on


@pytest.mark.gpu
def test_cuda_statistics_compiled_match_the_eager_refs():
    """The codecs' statistics compiled on CUDA (the switch on) agree with their eager refs, and
    were compiled (no eager fallback)."""
    from slimact.codecs import outlier
    from slimact.codecs import quant as cq
    from slimact.ops.quant import quantize

    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    x[:, 3] *= 40
    x[5, 7] = float("nan")
    q = quantize(x, bits=4, group_size=16)

    def stats():
        return cq.row_stats(x, 0, 256.0), outlier.outlier_scores(x), cq.scale_stats(q)

    eager = stats()
    with cr.compiled_refs_on_cuda():
        fused = stats()
    assert not cr._EAGER_KEYS and cr.available()
    assert any(key[2][0][0][0] == "cuda" for key in cr._COMPILED)
    for a, b in zip(eager, fused):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4, equal_nan=True)  # z near 0: atol
