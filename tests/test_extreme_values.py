"""Extreme finite values (issue 14.4): never a wrong finite gradient.

Every strategy is run on llama-tiny with one ``gate_proj`` weight at 1e20 or 1e4, with one
embedding row scaled to 1e30, and with NaN/inf in the input, and each parameter's gradient is
compared with exact autograd. Two references: fp32 autograd, and the float64 truth (the same model
in float64 with the norms' statistics in float64 too). fp32 autograd used to be wrong here itself:
``torch.rsqrt``'s backward ``-0.5·g·rstd³`` underflows float32 once ``mean(x²)`` passes ~1e30 (the
1e20 weight takes the residual stream there), dropping the norm's projection term (cosine -0.1
against the truth). slimact's RMSNorm now uses ``ops.rms_norm.rsqrt``, whose backward keeps every
partial product in range, so fp32 ``none`` agrees with the truth (a regression test below). HF
models' own RMSNorms still differentiate ``rsqrt`` with autograd; a gradient must agree with
fp32 exact autograd *or* with the truth.

A codec that cannot represent a tensor stores it exactly and says so (a ``RuntimeWarning`` naming
the site, the meter's action ``codec:<name>:exact``); normal inputs never trigger that.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact.codecs.base import exact_value, get_codec
from slimact.codecs.outlier import OutlierConfig
from slimact.codecs.prac import PracCodec, PracCodecConfig
from slimact.codecs.quant import ChannelQuantConfig, QuantConfig, range_problem
from slimact.codecs.saving import CodecPolicy
from slimact.models.common import RMSNorm
from slimact.ops.inv_act import inv_act
from slimact.ops.inv_act_approx import exact_df
from slimact.strategies.prac import PacConfig, PracConfig

FINITE_CASES = ("w1e20", "w1e4", "act1e30")
CASES = ("normal", *FINITE_CASES, "nan", "inf")

# near-full ranks so that PRAC's own approximation error stays small on normal inputs (at the
# default ranks llama-tiny's gradient cosine is 0.46-0.69 by design: it is a large-batch method)
PAC_HI = PacConfig(linear=(0.95, 0), nonlinear=(0.95, 0), only_if_smaller=False, svd="exact")
PRAC_HI = PracConfig(linear=(0.8, 0.15), nonlinear=(0.8, 0.15), only_if_smaller=False, svd="exact")
STRATEGIES = {
    "invact": ("invact", 0.99),
    "int4": ("int4", 0.99),
    "int8": ("int8", 0.99),
    "pac": (PAC_HI, 0.985),  # normal inputs: 0.993
    "prac": (PRAC_HI, 0.97),  # normal inputs: 0.974 (the random subspace's noise)
    "invact+int4": ("invact+int4", 0.99),
}


def _build(case: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = slimact.build_model("llama-tiny")
    with torch.no_grad():
        if case == "w1e20":
            m.layers[0].mlp.gate_proj.weight[3, 5] = 1e20
        elif case == "w1e4":
            m.layers[0].mlp.gate_proj.weight[3, 5] = 1e4
        elif case == "act1e30":
            m.embed_tokens.weight[7] *= 1e30
        elif case == "nan":
            m.embed_tokens.weight[7, 0] = float("nan")
        elif case == "inf":
            m.embed_tokens.weight[7, 0] = float("inf")
    return m.to(dtype)


def _batch(case: str) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    if case != "normal":
        ids[0, 10] = 7  # the scaled / poisoned embedding row
    return ids


def _grads(model: torch.nn.Module, ids: torch.Tensor, bf16: bool = False):
    """Parameter gradients of one step, plus the fallback warnings it raised."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            with slimact.measure(model) as meter:
                loss = model(ids, targets=ids).loss
        loss.backward()
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    fallbacks = [str(w.message) for w in caught if "stored exactly" in str(w.message)]
    exact_sites = [s.site for s in meter.report.sites if s.action.endswith(":exact")]
    return grads, fallbacks, exact_sites, meter.report.total_bytes


def _f64_norm_forward(self, x):  # RMSNorm with its statistics in x's dtype (float64 here)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * (x * rstd)


_REFS: dict = {}


def _references(case: str, bf16: bool = False):
    """(fp32 exact autograd, float64 truth) gradients; under bf16 autocast the truth keeps the
    autocast forward and computes only the norms' statistics in float64."""
    key = (case, bf16)
    if key not in _REFS:
        ids = _batch(case)
        exact32 = _grads(_build(case), ids, bf16)[0]
        truth = _build(case) if bf16 else _build(case, torch.float64)
        for mod in truth.modules():
            if isinstance(mod, RMSNorm):
                if bf16:
                    mod.forward = types.MethodType(_bf16_truth_norm_forward, mod)
                else:
                    mod.forward = types.MethodType(_f64_norm_forward, mod)
        _REFS[key] = (exact32, _grads(truth, ids, bf16)[0])
    return _REFS[key]


def _bf16_truth_norm_forward(self, x):
    dtype = x.dtype
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * (xd * rstd).to(dtype)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0, eps=0))


def check_gradients(got: dict, refs: tuple[dict, dict], bar: float) -> None:
    exact32, truth = refs
    assert got.keys() == exact32.keys()
    worst = []
    for name, ref in exact32.items():
        g = got[name]
        if not bool(torch.isfinite(ref).all()):
            # NaN in may give NaN out, never garbage: finite where autograd is not is wrong
            assert not bool(torch.isfinite(g).all()), f"{name}: finite gradient, autograd NaN/inf"
            continue
        assert bool(torch.isfinite(g).all()), f"{name}: non-finite gradient, autograd is finite"
        if float(ref.norm()) == 0.0:
            assert float(g.norm()) == 0.0, name
            continue
        c = max(_cos(ref, g), _cos(truth[name], g))
        worst.append((c, name))
    if worst:
        c, name = min(worst)
        assert c >= bar, f"gradient cosine {c:.4f} < {bar} at {name}"


def _run(strategy, case: str, bf16: bool = False):
    m = slimact.apply(_build(case), strategy)
    return _grads(m, _batch(case), bf16)


MATRIX = [(n, c) for n in STRATEGIES for c in CASES if c != "inf" or n in ("int4", "prac")]


@pytest.mark.parametrize(("name", "case"), MATRIX)
def test_gradient_matches_exact_autograd(name, case):
    strategy, bar = STRATEGIES[name]
    grads, fallbacks, exact_sites, _ = _run(strategy, case)
    check_gradients(grads, _references(case), bar)
    if case == "normal":
        assert not fallbacks and not exact_sites, "a normal batch must not trigger the fallback"
    elif case in FINITE_CASES and name != "invact" and (name != "invact+int4" or case == "w1e20"):
        # invact needs none (its inversion holds at these magnitudes); with invact+int4 the 1e30
        # rows reach only the inverted norms, which save their normalized output, and the 1e4
        # weight makes one massive MLP channel, stored exactly as an outlier channel by both
        # operands of the product and by down_proj's input (its other channels are normal)
        assert fallbacks, "an unrepresentable tensor must be reported"
        assert exact_sites, "the meter must show the exactly stored site"
        assert any(s in fallbacks[0] for s in exact_sites + [f.split(":")[0] for f in fallbacks])


@pytest.mark.parametrize(
    ("name", "case"), [("invact", "w1e20"), ("int4", "w1e20"), ("int8", "w1e4")]
)
def test_gradient_under_bf16_autocast(name, case):
    strategy, bar = STRATEGIES[name]
    grads, fallbacks, _, _ = _run(strategy, case, bf16=True)
    check_gradients(grads, _references(case, bf16=True), bar)
    assert bool(fallbacks) == (name != "invact")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_auto_plan_gradient(case):
    from slimact.strategies.auto import AutoConfig

    grads, fallbacks, _, _ = _run(AutoConfig(budget="25%", cache=None, repeats=1), case)
    check_gradients(grads, _references(case), 0.97)  # auto may pick PRAC-family codecs
    if case == "normal":
        assert not fallbacks


@pytest.mark.parametrize("case", FINITE_CASES)
def test_fp32_exact_autograd_matches_the_float64_truth(case):
    """The model's own RMSNorm backward must not underflow (it gave cosine -0.1 at w1e20)."""
    exact32, truth = _references(case)
    worst = min(_cos(exact32[n], truth[n]) for n in truth if float(truth[n].norm()) > 0)
    assert worst >= (0.98 if case == "act1e30" else 0.999), worst


@pytest.mark.parametrize(("name", "case"), [("prac", "w1e20"), ("pac", "act1e30")])
def test_default_prac_stores_extreme_tensors_exactly_instead_of_crashing(name, case):
    """linalg.svd used to fail on these (non-finite XᵀX); now the sites are stored exactly."""
    grads, fallbacks, exact_sites, _ = _run(name, case)
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
    assert fallbacks and exact_sites


def test_extreme_operand_stores_its_siblings_exactly():
    """silu(gate) holds 1e20 values: up, saved beside it by the same product, is exact too."""
    _, fallbacks, _, _ = _run("int4", "w1e20")
    text = "\n".join(fallbacks)
    assert "layers.0.mlp:mul#0" in text and "layers.0.mlp:mul#1" in text
    assert "saved by the same op as layers.0.mlp:mul#1" in text


def test_normal_batch_bytes_do_not_depend_on_the_check():
    """The range check only reads: with it off, a normal batch stores the same bytes."""
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    for cfg in (QuantConfig(), QuantConfig(bits=8), ChannelQuantConfig(), OutlierConfig()):
        on, off = cfg.build(), type(cfg)(**{**vars(cfg), "max_range": None}).build()
        a, b = on.encode(x), off.encode(x)
        assert "fallback" not in a.meta and on.nbytes(a) == off.nbytes(b)
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in b.tensors)


# --- codec level -------------------------------------------------------------------------------


def _rows(scale_row: float, value: float = 1.0) -> torch.Tensor:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * value
    x[5] *= scale_row
    return x


@pytest.mark.parametrize("name", ["int4", "int4-asym", "int8", "int8-channel", "int4-outlier"])
@pytest.mark.parametrize(
    ("x", "reason"),
    [
        (_rows(1e20), "overflow"),
        (_rows(1e3), "dynamic range"),
        (_rows(1.0, 1e-35), "group scale"),  # scales below the kernels' 1/scale floor
    ],
    ids=["1e20", "row-1e3", "tiny"],
)
def test_codec_stores_unrepresentable_tensor_exactly(name, x, reason):
    codec = get_codec(name)
    if reason == "dynamic range" and name in ("int4", "int8", "int4-outlier"):
        # a massive row above normal ones: the symmetric codecs store the row exactly on its
        # own (codecs.quant.massive_rows); a massive component in every row is stored whole
        # (test_codec_values.test_massive_component_everywhere_stored_whole)
        packed = codec.encode(x)
        assert "fallback" not in packed.meta and packed.meta["n_rows"] == 1
        assert torch.equal(codec.decode(packed)[5], x[5])
        assert codec.nbytes(packed) < x.numel() * x.element_size() / 2
        return
    packed = codec.encode(x)
    assert reason in packed.meta["fallback"]
    assert torch.equal(codec.decode(packed), x)  # exactly, not a wrong finite value
    assert codec.nbytes(packed) == x.numel() * x.element_size()  # as if kept: no copy
    assert sum(codec.fallbacks.values()) == 1


def test_codec_keeps_normal_tensors_and_nan_on_their_usual_path():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    codec = get_codec("int4")
    assert "fallback" not in codec.encode(x).meta
    x[3, 3] = float("nan")
    packed = codec.encode(x)  # NaN alone is no range problem: the sparse exact path keeps it
    assert "fallback" not in packed.meta
    y = codec.decode(packed)
    assert torch.isnan(y[3, 3]) and torch.isfinite(y[torch.isfinite(x)]).all()
    assert range_problem(torch.zeros(8, 8), 0, 256.0) is None


def test_exact_payload_refuses_an_in_place_change():
    x = _rows(1e20)
    codec = get_codec("int4")
    packed = codec.encode(x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        codec.decode(packed)


def test_prac_codec_on_huge_values_is_exact_and_keeps_its_subspace():
    codec = PracCodec(PracCodecConfig(r1=4, r2=4, t1=1, t2=1), name="site-a")
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    codec.encode(x)
    q1 = codec.q1.clone()
    big = x.clone()
    big[7] *= 1e30  # used to raise in linalg.svd
    packed = codec.encode(big)
    assert "overflow" in packed.meta["fallback"] and torch.equal(codec.decode(packed), big)
    assert torch.equal(codec.q1, q1) and codec.q1_pending  # no update from the extreme rows
    assert "fallback" not in codec.encode(x).meta and not codec.q1_pending


def test_prac_codec_large_but_representable_values_use_a_scaled_basis():
    """max |x| >= 2^20 is scaled by a power of two before the SVD: same subspace, no overflow."""
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    a = PracCodec(PracCodecConfig(r1=4, r2=4, svd="exact"), name="s")
    b = PracCodec(PracCodecConfig(r1=4, r2=4, svd="exact"), name="s")
    a.encode(x)
    packed = b.encode(x * 2.0**40)
    assert "fallback" not in packed.meta
    torch.testing.assert_close(b.q1.abs(), a.q1.abs(), atol=1e-4, rtol=0)


def test_prac_codec_svd_failure_stores_exactly(monkeypatch):
    import slimact.codecs.prac as prac

    def boom(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(prac, "randomized_basis_ref", boom)
    codec = PracCodec(PracCodecConfig(r1=4, r2=4), name="site-b")
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    packed = codec.encode(x)
    assert "did not converge" in packed.meta["fallback"] and torch.equal(codec.decode(packed), x)
    assert codec.q1_pending and codec.updates["q1_failed"] == 1


def test_prac_codec_nan_is_stored_exactly():
    codec = PracCodec(PracCodecConfig(r1=4, r2=4), name="site-c")
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    x[1, 2] = float("nan")
    with pytest.warns(RuntimeWarning, match="site-c"):
        packed = codec.encode(x)
    y = codec.decode(packed)
    assert torch.isnan(y[1, 2]) and torch.equal(y[torch.isfinite(x)], x[torch.isfinite(x)])


def test_policy_reports_each_site_once():
    codec = get_codec("int4")
    policy = CodecPolicy(lambda site, t: codec)
    x = _rows(1e20)
    with pytest.warns(RuntimeWarning, match=r"site m:linear#0: stored exactly.*overflow"):
        stored = policy("m:linear#0", x)
    assert exact_value(stored.packed) is x or torch.equal(stored.unpack(), x)
    assert stored.action == "codec:int4:exact"
    policy.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy("m:linear#0", x.clone())  # counted, not warned again
    assert sum(policy.fallbacks["m:linear#0"].values()) == 2


# --- inverted activations ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_inverted_activation_matches_autograd_at_extreme_magnitudes(kind, dtype):
    """y = f(x) and one bit recover f'(x) as torch computes it, from 1e3 up to the dtype's max
    and on the far left tail (NaN exactly where torch's own backward is NaN: tanh-GELU's x³
    overflows above ~1e13)."""
    top = torch.finfo(dtype).max
    vals = [1e3, 1e4, 1e10, 1e20, 1e30, top / 2, top, -1e3, -1e20, -top, -20.0, -90.0, -110.0]
    x = torch.tensor(vals, dtype=torch.float64).clamp(-top, top).to(dtype)
    xr = x.clone().requires_grad_()
    inv_act(xr, kind).backward(torch.ones_like(x))
    want, got = exact_df(x, kind), xr.grad
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok].float(), want[ok].float(), atol=1e-6, rtol=1e-2)
    # where torch's backward is NaN the inversion gives NaN too, or the true limit (0 on the left)
    limit = (x > 0).to(got.dtype)
    assert bool((torch.isnan(got) | (got == limit))[~ok].all())
