"""The ``int4`` strategy (adacc.txt §3.2 layer-specific compression) and its ablations."""

import json

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact import sites
from slimact.classify import ROLES, parse_site, role_of
from slimact.meter import measure
from slimact.models import build_model
from slimact.models.gpt2 import GPT2Config, GPT2Model
from slimact.planner.apply import install, runtime_of
from slimact.planner.plan import Plan
from slimact.registry import resolve
from slimact.strategies.int4 import Int4Config, NaiveInt4Config


def run(model, x, strategy=None):
    if strategy:
        slimact.apply(model, strategy)
    with measure(model, n_tokens=x.numel()) as m:
        out = model(x, targets=x)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return m.report, out.loss.item(), grads


def min_cosine(a, b):
    return min(float(F.cosine_similarity(a[n].flatten(), b[n].flatten(), dim=0)) for n in a)


def fresh(name, seed=0):
    torch.manual_seed(seed)
    return build_model(name)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_int4_roles_memory_and_gradients(name):
    x = torch.randint(0, 200, (4, 64))
    base, base_loss, g0 = run(fresh(name), x)
    rep, loss, g = run(fresh(name), x, "int4")
    assert loss == base_loss  # forward is untouched: only what backward reads is compressed
    assert rep.total_bytes / base.total_bytes < 0.5  # q and k exact: 0.45 on gpt2-tiny
    assert min_cosine(g0, g) > 0.98
    actions = {r.site: r.action for r in rep.sites}
    first = ("layers.0.", "h.0.")
    sdpa = [s for s in actions if "scaled_dot_product_attention" in s and s.startswith(first)]
    # q, k exact (the backward recomputes the softmax from them), v INT8 per channel where it
    # has a storage of its own (GPT-2's q, k and v are views of one c_attn output: all kept)
    v = "keep" if name == "gpt2-tiny" else "codec:int8-channel"
    assert [actions[s] for s in sdpa[:3]] == ["keep", "keep", v]
    assert all(actions[s] == "keep" for s in sdpa[3:])  # output, logsumexp
    assert actions[":cross_entropy#0"] == "keep"
    linear = [s for s in actions if s.endswith(":linear#0") and "attn" not in s]
    assert linear and all(actions[s] == "codec:int4-outlier-g16" for s in linear)


def test_ablations_order_and_revert():
    x = torch.randint(0, 200, (2, 64))
    base, _, g0 = run(fresh("llama-tiny"), x)
    cos, ratio = {}, {}
    for strategy in ("int4", "int4-plain", "int8", "int4-paper"):
        rep, _, g = run(fresh("llama-tiny"), x, strategy)
        cos[strategy], ratio[strategy] = min_cosine(g0, g), rep.total_bytes / base.total_bytes
    assert cos["int8"] > 0.999 and cos["int8"] > cos["int4"] > cos["int4-paper"]
    assert ratio["int4"] < ratio["int8"] and ratio["int4-paper"] < ratio["int4"]
    m = fresh("llama-tiny")
    slimact.apply(m, "int4")
    slimact.revert(m)
    rep, _, g = run(m, x)
    assert rep.total_bytes == base.total_bytes and min_cosine(g0, g) > 0.99999


def test_dropout_masks_are_bit_packed():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, d_model=64, n_layers=1, n_heads=4, d_ff=256,
                     max_seq_len=64, dropout=0.1)  # fmt: skip
    model = GPT2Model(cfg).train()
    slimact.apply(model, "int4")
    x = torch.randint(0, 128, (2, 32))
    with measure(model) as m:
        model(x, targets=x).loss.backward()
    # CPU dropout saves its float noise {0, 1/(1-p)}; CUDA saves a bool mask: both -> 1 bit
    masks = [r for r in m.report.sites if r.op == "dropout"]
    assert len(masks) == 3 and all(r.action == "codec:bits" for r in masks)
    in_sdpa = [r for r in m.report.sites if r.op == "scaled_dot_product_attention"]
    assert [r.action for r in in_sdpa].count("codec:bits") == 1  # the math path's attention dropout
    for r in masks:
        n = torch.Size(r.shape).numel()
        assert r.bytes <= -(-n // 8) + (4 if r.dtype != "bool" else 0)


def test_filter_fn_and_config_validation():
    x = torch.randint(0, 200, (2, 64))
    m = fresh("llama-tiny")
    slimact.apply(m, "int4", filter_fn=lambda mod, path: path.startswith("layers.0"))
    rep, _, _ = run(m, x)
    compressed = {r.block for r in rep.sites if r.action not in ("keep",)}
    assert compressed == {"layers.0"}
    with pytest.raises(ValueError, match="Int4Config.act='int3' is not a codec"):
        Int4Config(act="int3")
    with pytest.raises(ValueError, match="min_numel must be an int >= 0"):
        Int4Config(min_numel=-1)


def test_role_recognition_is_structural():
    t = torch.randn(4, 16, 64, requires_grad=True)
    assert parse_site("model.layers.3.mlp.down_proj:linear#0") == ("model.layers.3.mlp.down_proj",
                                                                   "linear", 0)  # fmt: skip
    assert role_of("a.mlp.down_proj:linear#0", t) == "act"
    assert role_of("a.input_layernorm:layer_norm#0", t) == "act"
    assert role_of("a.mlp.act:gelu#0", t) == "act"
    assert role_of("a.mlp.act_fn:inv_silu#0", t) == "act"  # InvAct's float save
    assert role_of("a.attn:softmax#0", t) == "scores"
    assert role_of("a.attn:matmul#1", torch.randn(2, 4, 16, 16, requires_grad=True)) == "scores"
    assert role_of("a.attn:matmul#0", torch.randn(2, 4, 16, 8, requires_grad=True)) == "qkv"
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    assert role_of("a.attn:scaled_dot_product_attention#2", q) == "qkv"
    assert role_of("a.attn:scaled_dot_product_attention#4", q) is None
    assert role_of("x:cross_entropy#0", t) is None
    assert role_of("a:mul#0", torch.randn(4, 16, 64)) is None  # no grad: a constant (RoPE)
    assert role_of("a.norm:rsqrt#0", torch.randn(4, 16, 1, requires_grad=True)) is None
    assert role_of("a:dropout#0", torch.rand(8, 8) > 0.5) == "mask"
    assert role_of("a:mask_op#0", torch.tensor([0, 1, 1], dtype=torch.uint8)) == "mask"
    assert role_of("a:mask_op#0", torch.tensor([0, 7, 255], dtype=torch.uint8)) is None
    # an inverted op's packed sign bits are no mask, whatever the bytes (nothing is read)
    assert role_of("a:inv_silu#1", torch.tensor([0, 1, 1], dtype=torch.uint8)) is None
    assert role_of("a:embedding#0", torch.arange(10)) is None


class _InvSiLU(torch.autograd.Function):
    """Stand-in for InvAct's function: saves the output and a packed uint8 bit mask."""

    @staticmethod
    def forward(ctx, x):
        y = F.silu(x)
        mask = (x.reshape(-1) > -1.2785).to(torch.uint8)
        mask = torch.nn.functional.pad(mask, (0, -mask.numel() % 8)).view(-1, 8)
        packed = (mask << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
        ctx.save_for_backward(y, packed, x)
        return y

    @staticmethod
    def backward(ctx, g):
        y, packed, x = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


def test_composes_with_an_invact_style_function():
    x = torch.randint(0, 200, (2, 64))
    m = fresh("llama-tiny")
    for block in m.layers:

        def act(h):
            with sites.role("inv_silu"):
                return _InvSiLU.apply(h)

        block.mlp.act_fn.forward = act
    rep, _, _ = run(m, x, "int4")
    kinds = {(r.op, r.dtype): r.action for r in rep.sites if r.op == "inv_silu"}
    assert kinds[("inv_silu", "float32")] == "codec:int4-outlier-g16"
    assert kinds[("inv_silu", "uint8")] == "reformulate:inv_silu"  # packed bits: left alone


def test_nonfinite_activations_come_back_nonfinite():
    m = fresh("llama-tiny")
    slimact.apply(m, "int4")
    x = torch.randint(0, 200, (2, 64))
    with torch.no_grad():
        m.embed_tokens.weight[x[0, 3]] = float("nan")
    loss = m(x, targets=x).loss
    loss.backward()
    assert torch.isnan(loss)
    assert torch.isnan(m.layers[0].mlp.down_proj.weight.grad).any()


# ----------------------------------------------------------------------------- plans of rules


RULES = {  # per role, in ROLES' order: act, qk (None: kept exact), qkv, scores, mask
    "int4": ("int4-outlier-g16", None, "int8-channel", "int4-asym/g16", "bits"),
    "int4-plain": ("int4/g16", None, "int8-channel", "int4-asym/g16", "bits"),
    "int4-paper": (
        "int4-outlier/paper_scale=True",
        "int4-channel/paper_scale=True",
        "int4-channel/paper_scale=True",
        "int4-asym/paper_scale=True",
        "bits",
    ),
    "int8": ("int8", None, "int8-channel", "int8-asym", "bits"),
    "int4-naive": ("int4-token", "int4-token", "int4-token", "int4-token", "bits"),
}


@pytest.mark.parametrize("name", list(RULES))
def test_each_codec_strategy_is_a_plan_of_one_rule(name):
    """The plan says exactly what is stored: every role's label carries the config's knobs, and
    the runtime the strategy installs runs that very plan (JSON round trip included)."""
    (cfg,) = resolve(name)
    plan = cfg.plan()
    (rule,) = plan.rules
    assert not plan.layers and tuple(rule.codec(r) for r in ROLES) == RULES[name]
    assert rule.sdpa_out == (name in ("int4-paper", "int4-naive"))
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert plan.table().endswith(f"lazy rules of {name}") and RULES[name][0] in plan.table()
    model = slimact.apply(fresh("llama-tiny"), name)
    rt = runtime_of(model)
    assert rt.plan == plan and slimact.applied(model)[0].action == name
    slimact.revert(model)
    assert runtime_of(model) is None and slimact.applied(model) == []


def test_config_overrides_end_up_in_the_labels():
    rule = Int4Config(group_size=32, threshold=2.5).rule()
    assert rule.codec("act") == "int4-outlier/g32,threshold=2.5"
    assert rule.codec("scores") == "int4-asym/g32" and rule.codec("qkv") == "int8-channel"
    paper = Int4Config(paper_scale=True).rule()
    assert paper.codec("qkv") == "int8-channel/paper_scale=True"
    assert NaiveInt4Config(bits=8, paper_scale=False).rule().codec("act") == (
        "int8-token/paper_scale=False"
    )


def test_a_saved_rule_plan_applies_like_the_strategy(tmp_path):
    """``Int4Config().plan()`` saved and loaded, applied as a ``Plan``: the same bytes, actions
    and gradients as ``int4`` itself; an old plan's JSON (no ``rules``) still loads."""
    x = torch.randint(0, 200, (2, 64))
    rep, loss, g = run(fresh("llama-tiny"), x, "int4")
    path = tmp_path / "int4.json"
    Int4Config().plan().save(path)
    rep_p, loss_p, g_p = run(fresh("llama-tiny"), x, Plan.load(path))
    assert loss_p == loss and rep_p.total_bytes == rep.total_bytes
    assert [(r.site, r.action, r.bytes) for r in rep_p.sites] == [
        (r.site, r.action, r.bytes) for r in rep.sites
    ]
    assert all(torch.equal(g[n], g_p[n]) for n in g)
    old = json.loads(path.read_text())
    del old["rules"]
    assert Plan.from_dict(old).rules == ()


def test_rule_plans_compose_and_refuse_a_second_runtime():
    model = slimact.apply(fresh("llama-tiny"), "invact+int4+chunked-ce")
    x = torch.randint(0, 200, (2, 32))
    model(x, targets=x).loss.backward()
    with pytest.raises(ValueError, match="already carries a slimact plan"):
        install(model, Int4Config().plan())  # below the registry: still one runtime per model
    with pytest.raises(ValueError, match="the rules give role 'act' two codecs in every module"):
        slimact.apply(model, "int8")  # the model's plan and int8's conflict (Plan.merge)
    slimact.revert(model)
    assert runtime_of(model) is None and not [m for m in model.modules() if "forward" in m.__dict__]
