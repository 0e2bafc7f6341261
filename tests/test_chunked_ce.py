"""Chunked linear + cross-entropy: the op vs autograd, the Triton kernel, compile, the strategy."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

if not torch.cuda.is_available():  # the Triton kernel runs on CPU through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import slimact
from slimact.bench.runner import head_bytes
from slimact.compare import grad_cosine
from slimact.models import build_model
from slimact.ops import chunked_ce_triton as tri
from slimact.ops.chunked_ce import MODES, chunked_linear_cross_entropy, default_chunk_size
from slimact.ops.chunked_ce_loop import ce_grad_ref_, ce_stats_ref
from slimact.reformulate.head import ChunkedCEConfig
from slimact.registry import resolve

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel's device (real or interpreted)
needs_triton = pytest.mark.skipif(not tri.triton_available(), reason="triton not installed")


def _data(n, d, v, bias, dtype=torch.float32, ignore=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore] = -100
    return h, w, b, t


def _params(h, w, b):
    return [x for x in (h, w, b) if x is not None]


def _ref(h, w, b, t, **kw):
    return F.cross_entropy(F.linear(h, w, b).float(), t, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "n,d,v,chunk,bias,eps,reduction",
    [
        (37, 16, 53, 8, True, 0.0, "mean"),  # N not a multiple of the chunk, V odd
        (37, 16, 53, None, False, 0.1, "sum"),
        (1, 8, 5, 4, True, 0.1, "mean"),  # N = 1
        (64, 8, 33, 64, False, 0.0, "sum"),
    ],
)
def test_matches_autograd_fp32(mode, n, d, v, chunk, bias, eps, reduction):
    h, w, b, t = _data(n, d, v, bias)
    kw = dict(label_smoothing=eps, reduction=reduction)
    ref = _ref(h, w, b, t, **kw)
    want = torch.autograd.grad(ref * 1.3, _params(h, w, b))
    got = chunked_linear_cross_entropy(h, w, t, b, chunk_size=chunk, mode=mode, **kw)
    grads = torch.autograd.grad(got * 1.3, _params(h, w, b))
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    for a, e in zip(grads, want, strict=True):
        assert torch.allclose(a, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_matches_torch(mode, reduction):
    h, w, b, t = _data(9, 8, 11, True, ignore=1.0)
    ref = _ref(h, w, b, t, reduction=reduction)
    got = chunked_linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=4, mode=mode)
    assert torch.equal(ref.isnan(), got.isnan())  # mean: 0/0 = nan, as torch; sum: 0
    for a in torch.autograd.grad(got, _params(h, w, b)):
        assert torch.equal(a, torch.zeros_like(a))  # torch's grads are zero too


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(mode, dtype):
    h, w, b, t = _data(40, 16, 97, True, dtype=dtype)
    exact = _ref(*(x.detach().double().requires_grad_() for x in (h, w, b)), t)
    got = chunked_linear_cross_entropy(h, w, t, b, chunk_size=16, mode=mode)
    base = _ref(h, w, b, t)  # what the model computes without the op (logits in dtype)
    assert got.dtype == torch.float32
    err, base_err = (
        abs(float(got.detach()) - float(exact)),
        abs(float(base.detach()) - float(exact)),
    )
    assert err <= 2 * base_err + 1e-3
    for a, e in zip(
        torch.autograd.grad(got, _params(h, w, b)),
        torch.autograd.grad(base, _params(h, w, b)),
        strict=True,
    ):
        assert a.dtype == dtype
        assert F.cosine_similarity(a.double().flatten(), e.double().flatten(), dim=0) > 0.999


@pytest.mark.parametrize("mode", MODES)
def test_autocast_like_linear(mode):
    h, w, b, t = _data(24, 16, 61, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base = _ref(h, w, b, t)
        got = chunked_linear_cross_entropy(h, w, t, chunk_size=8, mode=mode)
    assert got.dtype == torch.float32
    assert torch.allclose(got, base, rtol=1e-2)
    for a, e in zip(
        torch.autograd.grad(got, [h, w]), torch.autograd.grad(base, [h, w]), strict=True
    ):
        assert a.dtype == torch.float32  # the grads of the fp32 leaves, through the casts
        assert F.cosine_similarity(a.flatten(), e.flatten(), dim=0) > 0.999


def test_saves_no_logits_and_names_its_site():
    h, w, _, t = _data(32, 8, 400, False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        chunked_linear_cross_entropy(h, w, t)
    assert sum(x.numel() for x in saved) == 32 * 8 + 400 * 8 + 32 + 32  # h, w, t, lse; no N x V
    model = nn.Linear(8, 400, bias=False)
    with slimact.measure(model) as m:
        chunked_linear_cross_entropy(h, model.weight, t)
    assert {s.site.split(":")[1].split("#")[0] for s in m.report.sites} == {"chunked_ce"}


def test_bad_arguments_raise():
    h, w, _, t = _data(4, 8, 10, False)
    with pytest.raises(ValueError, match="reduction"):
        chunked_linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="differ in D"):
        chunked_linear_cross_entropy(h, w[:, :4], t)
    with pytest.raises(IndexError, match="out of range"):
        chunked_linear_cross_entropy(h, w, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(TypeError, match="share a dtype"):
        chunked_linear_cross_entropy(h, w.bfloat16(), t)
    assert default_chunk_size(32000) == 256 and default_chunk_size(10**9) == 1


@needs_triton
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("v", [5, 77])
def test_triton_kernel_matches_ref(monkeypatch, eps, v):
    monkeypatch.setattr(tri, "MAX_BLOCK", 16)  # V = 77: several blocks per row
    z = (torch.randn(6, v) * 3).to(DEV)
    t = torch.randint(0, v, (6,)).to(DEV)
    t[2] = -100
    lse, loss = ce_stats_ref(z, t, -100, eps)
    lse_k, loss_k = tri.ce_chunk_triton(z.clone(), t, -100, eps)
    assert torch.allclose(lse_k, lse, atol=1e-5) and torch.allclose(loss_k, loss, atol=1e-5)
    scale = torch.tensor(0.37, device=DEV)
    g = ce_grad_ref_(z.clone(), t, lse, scale, -100, eps)
    for given in (None, lse):  # grad in the same pass as the stats, and from a saved lse
        zk = z.clone()
        tri.ce_chunk_triton(zk, t, -100, eps, lse=given, scale=scale)
        assert torch.allclose(zk, g, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("mode", MODES)
def test_triton_backend_end_to_end(mode):
    h, w, b, t = (
        x.detach().to(DEV).requires_grad_(x.requires_grad) for x in _data(20, 8, 37, True)
    )
    ref = _ref(h, w, b, t, label_smoothing=0.1)
    got = chunked_linear_cross_entropy(
        h, w, t, b, label_smoothing=0.1, chunk_size=8, mode=mode, backend="triton"
    )
    assert torch.allclose(got, ref, atol=1e-5)
    for a, e in zip(
        torch.autograd.grad(got, [h, w, b]), torch.autograd.grad(ref, [h, w, b]), strict=True
    ):
        assert torch.allclose(a, e, atol=1e-5)


@pytest.mark.slow  # dynamo's first compile in a process takes ~10 s or more
@pytest.mark.parametrize("mode", MODES)
def test_compiles_without_graph_breaks(mode):
    torch._dynamo.reset()
    h, w, b, t = _data(24, 8, 29, True)

    def f(h, w, b, t):
        return chunked_linear_cross_entropy(h, w, t, b, chunk_size=8, mode=mode) * 2

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)  # raises on any graph break
    got = cf(h, w, b, t)
    want = f(h, w, b, t)
    assert torch.allclose(got, want, atol=1e-6)
    for a, e in zip(
        torch.autograd.grad(got, [h, w, b]), torch.autograd.grad(want, [h, w, b]), strict=True
    ):
        assert torch.allclose(a, e, atol=1e-6)


# ----------------------------------------------------------------------------- the strategy
V_BIG = 4096  # the head dominates llama-tiny (D = 64) like a real vocabulary does llama-20m


def _tiny(strategy: str = "none", vocab: int = V_BIG):
    torch.manual_seed(0)
    model = build_model("llama-tiny", vocab_size=vocab)
    return slimact.apply(model, strategy)


def _batch(vocab: int = V_BIG):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (2, 32), generator=g)
    y = torch.randint(0, vocab, (2, 32), generator=g)
    y[0, :5] = -100
    return x, y


def _step(model, x, y):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(x, targets=y)
    out.loss.backward()
    return m.report, out


def test_config_and_spec():
    assert resolve("chunked-ce@128,precompute") == [ChunkedCEConfig(128, "precompute")]
    for bad in (dict(chunk_size=0), dict(chunk_size=True), dict(mode="x"), dict(backend="y")):
        with pytest.raises(ValueError):
            ChunkedCEConfig(**bad)
    with pytest.raises(ValueError, match="chunk size"):
        resolve("chunked-ce@lots")


def test_strategy_llama_tiny_head_bytes_and_exactness():
    x, y = _batch()
    base = _tiny()
    rb, ob = _step(base, x, y)
    model = _tiny("chunked-ce")
    (change,) = [c for c in slimact.applied(model) if c.action == "chunked-ce"]
    assert not change.skipped and "verified" in change.detail
    r, o = _step(model, x, y)
    assert o.logits is None  # training with targets: no full logits
    assert r.total_bytes < rb.total_bytes
    assert head_bytes(r) <= 0.02 * head_bytes(rb)
    assert any(s.site.startswith("lm_head:chunked_ce#") for s in r.sites)
    assert torch.allclose(o.loss, ob.loss, rtol=1e-6)
    assert grad_cosine(base, model) >= 0.99999
    with torch.no_grad():  # evaluation and generation still get logits
        assert model(x, targets=y).logits.shape == (2, 32, V_BIG)
    assert model(x).logits.shape == (2, 32, V_BIG)
    slimact.revert(model)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


@pytest.mark.parametrize("other", ["int4", "recompute", "invact"])
def test_strategy_composes(other):
    x, y = _batch()
    base, ref = _tiny(), _tiny(other)
    _step(base, x, y)
    _, o_ref = _step(ref, x, y)
    for spec in (f"{other}+chunked-ce", f"chunked-ce+{other}"):
        model = _tiny(spec)
        r, o = _step(model, x, y)
        assert head_bytes(r) <= 0.02 * (2 * 32 * V_BIG * 4)
        assert torch.allclose(o.loss, o_ref.loss, rtol=1e-5)
        # int4 quantizes lm_head's input; chunked-ce keeps the head's saves exact
        assert grad_cosine(base, model) >= min(grad_cosine(base, ref), 0.99999) - 1e-6


def test_gpt2_tied_embeddings():
    torch.manual_seed(0)
    base = build_model("gpt2-tiny", vocab_size=1000)
    model = slimact.apply(copy.deepcopy(base), "chunked-ce")
    x, y = _batch(1000)
    _, ob = _step(base, x, y)
    _, o = _step(model, x, y)
    assert model.lm_head.weight is model.wte.weight
    assert torch.allclose(o.loss, ob.loss, rtol=1e-6)
    assert grad_cosine(base, model) >= 0.99999


def test_deepcopy_is_independent():
    x, y = _batch()
    model = _tiny("chunked-ce")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.lm_head.weight.mul_(2)
    _, o = _step(model, x, y)
    _, oc = _step(clone, x, y)
    assert model.lm_head.weight.grad is not None and clone.lm_head.weight.grad is not None
    assert not torch.allclose(o.loss, oc.loss)
    slimact.revert(clone)
    assert "forward" in model.lm_head.__dict__ and "forward" not in clone.lm_head.__dict__


class _Softcapped(nn.Module):
    """A head that does more than linear + CE: the probe must skip it."""

    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"vocab_size": 50, "max_seq_len": 16})()
        self.emb = nn.Embedding(50, 8)
        self.lm_head = nn.Linear(8, 50, bias=False)

    def forward(self, input_ids, targets=None):
        logits = 3.0 * torch.tanh(self.lm_head(self.emb(input_ids)) / 3.0)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return type("Out", (), {"loss": loss, "logits": logits})()


def test_probe_skips_heads_that_are_not_linear_plus_ce():
    model = slimact.apply(_Softcapped(), "chunked-ce")
    (change,) = slimact.applied(model)
    assert change.skipped and "cannot set the loss" in change.detail
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


def test_probe_catches_soft_capping_hidden_by_small_initial_logits(soft_capped_llama):
    model = soft_capped_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (change,) = slimact.applied(slimact.apply(model, "chunked-ce"))
    assert change.skipped and "soft-capping" in change.detail
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # restored
    (ok,) = slimact.applied(slimact.apply(_tiny(), "chunked-ce"))  # the plain head passes both
    assert not ok.skipped and "verified" in ok.detail


# ----------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_causal_lm(arch, tiny_causal_lm):
    base = tiny_causal_lm(arch)
    model = slimact.apply(copy.deepcopy(base), "chunked-ce")
    (change,) = slimact.applied(model)
    assert not change.skipped and "labels" in change.detail
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, :4] = -100
    for kw in ({}, {"num_items_in_batch": torch.tensor(7)}):  # mean, and sum / items
        base.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        ob = base(input_ids=ids, labels=labels, **kw)
        o = model(input_ids=ids, labels=labels, **kw)
        assert o.logits is None and o["loss"] is o.loss
        assert torch.allclose(o.loss, ob.loss, rtol=1e-6)
        ob.loss.backward()
        o.loss.backward()
        assert grad_cosine(base, model) >= 0.99999
    assert model(input_ids=ids).logits.shape == (2, 12, 512)
    with torch.no_grad():
        want = base.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
        got = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
