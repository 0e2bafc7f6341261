"""``invact`` / ``invact-act`` on slimact's and Hugging Face models: swaps, skips, memory, grads."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimact
from slimact.compare import grad_cosine
from slimact.reformulate import InvActConfig, fallback_report


def _build(name, **kw):
    torch.manual_seed(0)
    return slimact.build_model(name, **kw)


def _step(model, x, measure=True):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(x, targets=x)
    out.loss.backward()
    return m.report.total_bytes, out.loss.item()


def _changes(model):
    return {c.path: c for c in slimact.applied(model)}


@pytest.mark.parametrize(
    "name,act,norms",
    [
        ("llama-tiny", "invact:silu", ["layers.0.input_layernorm", "norm"]),
        ("gpt2-tiny", "invact:gelu_tanh", ["h.0.ln_1", "h.1.ln_2", "ln_f"]),
    ],
)
def test_slimact_models(name, act, norms):
    x = torch.randint(0, 257, (2, 32))
    base = _build(name)
    b_bytes, b_loss = _step(base, x)
    model = slimact.apply(_build(name), "invact")
    ch = _changes(model)
    act_paths = [p for p, c in ch.items() if c.action == act and not c.skipped]
    assert len(act_paths) == 2 and all("saved by" in ch[p].detail for p in act_paths)
    for p in norms:
        assert ch[p].action.startswith("invnorm") and not ch[p].skipped, ch[p]
    bytes_, loss = _step(model, x)
    assert bytes_ < b_bytes
    assert abs(loss - b_loss) < 1e-6  # forward unchanged
    assert grad_cosine(base, model) > 0.9999
    keys = set(model.state_dict())
    slimact.revert(model)
    assert set(model.state_dict()) == keys
    assert _step(model, x)[0] == b_bytes


def test_invact_act_leaves_norms_alone():
    model = slimact.apply(_build("llama-tiny"), "invact-act")
    actions = {c.action for c in slimact.applied(model) if not c.skipped}
    assert actions == {"invact:silu"}


def test_filter_fn_and_double_apply():
    model = slimact.apply(_build("llama-tiny"), "invact", filter_fn=lambda m, p: "layers.0" in p)
    ch = _changes(model)
    assert ch["layers.1.mlp.act_fn"].skipped and ch["layers.1.mlp.act_fn"].detail == "filtered out"
    assert not ch["layers.0.mlp.act_fn"].skipped
    slimact.apply(model, "invact")
    again = [c for c in slimact.applied(model)[len(ch) :] if c.path == "layers.0.mlp.act_fn"]
    assert again[0].skipped and "already" in again[0].detail


class _Toy(nn.Module):
    """act -> dropout -> linear (no saving possible) next to act -> linear (saving)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act1, self.drop = nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1)
        self.fc2, self.act2, self.fc3 = nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 4)
        self.norm = nn.LayerNorm(4)

    @property
    def dummy_inputs(self):
        return {"x": torch.randn(2, 8)}

    def forward(self, x):
        return self.norm(self.fc3(self.act2(self.fc2(self.drop(self.act1(self.fc1(x)))))))


def test_activation_followed_by_dropout_is_skipped_with_reason():
    model = slimact.apply(_Toy(), "invact")
    ch = _changes(model)
    assert ch["act1"].skipped and "not saved by the next op" in ch["act1"].detail
    assert not ch["act2"].skipped and "fc3" in ch["act2"].detail
    # the LayerNorm's output is the model output: nothing saves it either
    assert ch["norm"].skipped
    toy = _Toy()
    rng = torch.get_rng_state()
    slimact.apply(toy, "invact")
    assert torch.equal(rng, torch.get_rng_state())  # the probe forward left RNG untouched


def test_unverified_without_dummy_input():
    model = slimact.apply(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)), "invact")
    (c,) = [c for c in slimact.applied(model) if c.path == "1"]
    assert not c.skipped and "unverified" in c.detail


def test_unrecognised_activation_and_gemma_norm_skipped():
    class QuickGELUActivation(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(1.702 * x)

    class GemmaRMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.eps, self.weight = 1e-6, nn.Parameter(torch.zeros(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    model = nn.Sequential(GemmaRMSNorm(4), nn.Linear(4, 4), QuickGELUActivation(), nn.Linear(4, 2))
    ch = _changes(slimact.apply(model, InvActConfig(probe=False)))
    assert ch["0"].skipped and "1+w" in ch["0"].detail
    assert ch["2"].skipped and "not GELU" in ch["2"].detail


def test_config_validation():
    with pytest.raises(ValueError, match="mode"):
        InvActConfig(mode="exact")
    with pytest.raises(ValueError, match="ops"):
        InvActConfig(ops=("relu",))
    with pytest.raises(ValueError, match="variant"):
        InvActConfig(variant="sign")
    assert InvActConfig().name == "invact" and InvActConfig(norms=False).name == "invact-act"


def test_runtime_fallback_is_reported_per_site():
    model = slimact.apply(_build("llama-tiny"), "invact")
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight[0] = 0.0
    x = torch.randint(0, 257, (1, 16))
    with slimact.measure(model) as m:
        model(x, targets=x).loss.backward()
    ops = {s.site.split(":")[0]: s.op for s in m.report.sites if "norm" in s.op}
    assert ops["layers.1.post_attention_layernorm"] == "inv_rms_norm_fallback"
    assert ops["layers.0.post_attention_layernorm"] == "inv_rms_norm"
    rep = fallback_report(model)
    assert rep["layers.1.post_attention_layernorm"]["fallbacks"] == 1
    assert rep["layers.0.input_layernorm"]["reason"] is None


transformers = pytest.importorskip("transformers")


def _hf(kind):
    torch.manual_seed(0)
    if kind == "bert":
        cfg = transformers.BertConfig(
            vocab_size=99,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        return transformers.BertModel(cfg)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=2, n_positions=64)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def _hf_step(model, ids):
    model.train()
    torch.manual_seed(1)  # same dropout masks in both runs
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(input_ids=ids)
    h = out.logits if hasattr(out, "logits") else out.last_hidden_state
    (h.float().pow(2).mean()).backward()
    return m.report.total_bytes, h.detach()


@pytest.mark.parametrize(
    "kind,act,skipped_norm",
    [
        ("bert", "invact:gelu", "embeddings.LayerNorm"),
        ("gpt2", "invact:gelu_tanh", None),
        ("llama", "invact:silu", None),
    ],
)
def test_hugging_face_models(kind, act, skipped_norm):
    ids = torch.randint(0, 99, (2, 24))
    base = _hf(kind)
    b_bytes, b_out = _hf_step(base, ids)
    model = slimact.apply(_hf(kind), "invact")
    ch = slimact.applied(model)
    swapped = [c for c in ch if c.action == act and not c.skipped]
    assert len(swapped) == 2, [(c.path, c.action, c.detail) for c in ch]
    norms = [c for c in ch if c.action.startswith("invnorm") and not c.skipped]
    assert len(norms) >= 4
    if skipped_norm:
        (c,) = [c for c in ch if c.path == skipped_norm]
        assert c.skipped and "dropout" in c.detail
    bytes_, out = _hf_step(model, ids)
    assert bytes_ < b_bytes
    assert torch.allclose(out, b_out, atol=1e-5)
    assert grad_cosine(base, model) > 0.9999


def test_hf_activation_classes_are_recognised():
    from transformers import activations as A

    names = ["GELUActivation", "NewGELUActivation", "FastGELUActivation", "SiLUActivation"]
    names += [n for n in ("GELUTanh", "PytorchGELUTanh") if hasattr(A, n)]
    want = {"GELUActivation": "gelu", "SiLUActivation": "silu"}
    for n in names:
        model = nn.Sequential(nn.Linear(4, 4), getattr(A, n)(), nn.Linear(4, 2))
        (c,) = [c for c in slimact.applied(slimact.apply(model, "invact")) if c.path == "1"]
        assert not c.skipped and c.action == f"invact:{want.get(n, 'gelu_tanh')}", (n, c)
        x = torch.randn(3, 4, requires_grad=True)
        model(x).sum().backward()
        assert torch.isfinite(x.grad).all()
    quick = nn.Sequential(nn.Linear(4, 4), A.QuickGELUActivation(), nn.Linear(4, 2))
    (c,) = [c for c in slimact.applied(slimact.apply(quick, "invact")) if c.path == "1"]
    assert c.skipped


def test_hf_gelu_matches_torch_grad():
    act = transformers.activations.NewGELUActivation()
    model = slimact.apply(nn.Sequential(nn.Linear(6, 6), act, nn.Linear(6, 1)), "invact")
    x = torch.randn(5, 6, requires_grad=True)
    model(x).sum().backward()
    g = x.grad.clone()
    slimact.revert(model)
    x.grad = None
    model(x).sum().backward()
    assert torch.allclose(g, x.grad, atol=1e-4)
    assert F.gelu is not None
