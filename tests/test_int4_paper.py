"""``int4-paper`` is adacc.txt §3.2 as written, ``int4-naive`` the paper's per-token baseline."""

import math

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact.codecs.token import TokenQuantCodec, TokenQuantConfig
from slimact.meter import measure
from slimact.models import build_model
from slimact.planner.apply import PlanAssign
from slimact.registry import resolve
from slimact.strategies.int4 import Int4Config, NaiveInt4Config

ACT = "layers.0.mlp.down_proj:linear#0"
SDPA = "layers.0.self_attn:scaled_dot_product_attention#"
SCORES = "h.0.attn:softmax#0"


def paper_assign() -> PlanAssign:
    """The codecs ``int4-paper``'s plan (one lazy rule) gives each site, as its runtime does."""
    (cfg,) = resolve("int4-paper")
    return PlanAssign(cfg.plan())


def naive_assign() -> PlanAssign:
    (cfg,) = resolve("int4-naive")
    return PlanAssign(cfg.plan())


def grad_tensor(x: torch.Tensor) -> torch.Tensor:
    return x.requires_grad_(True)


def ramp(rows: int, cols: int, top: float = 1.0) -> torch.Tensor:
    """Rows of values -top .. +top (every group holds both extremes)."""
    return torch.linspace(-top, top, cols).repeat(rows, 1)


# ----------------------------------------------------------------------------- the formulas


def test_act_symmetric_divisor_8_and_clip_to_7():
    x = grad_tensor(ramp(16, 128, top=2.0))  # 16 groups of 128, max |x| = 2 in each
    codec = paper_assign()(ACT, x)
    packed = codec.encode(x.detach())
    scale = packed.tensors["scale"]
    assert torch.equal(scale, torch.full_like(scale, 2.0 / 8))  # S = max|X| / 8
    y = codec.decode(packed).view(16, 128)
    assert float(y.max()) == pytest.approx(7 * 0.25)  # +8 clipped to 7: the max loses one step
    assert float(y.min()) == pytest.approx(-2.0)  # -8 is in range
    assert codec.config.paper_scale and codec.config.group_size == 128


def test_qkv_channelwise_divisor_8():
    chans = torch.arange(1, 65, dtype=torch.float32)  # channel (h, d) holds values up to h*16+d+1
    mem = chans.view(4, 16) * torch.linspace(-1, 1, 64).view(64, 1, 1)  # [S, H, Dh]
    mem = mem.expand(2, 64, 4, 16).contiguous()  # [B, S, H, Dh] in memory, as SDPA's q/k/v
    q = grad_tensor(mem.clone()).transpose(1, 2)  # the [B, H, S, Dh] view SDPA saves
    codec = paper_assign()(SDPA + "0", q)
    assert codec.config.channels == 64 and codec.config.paper_scale
    packed = codec.encode(mem)  # the policy encodes in memory order
    assert torch.allclose(packed.tensors["scale"], chans / 8)  # S = max|channel| / 8
    y = codec.decode(packed).view(2, 64, 64)
    assert torch.allclose(y[0, -1], chans * 7 / 8)  # +max -> +8 -> clipped to 7
    assert torch.allclose(y[0, 0], -chans)  # -max -> -8


def test_scores_asymmetric_divisor_16_offset_midpoint():
    p = grad_tensor(ramp(8, 128, top=1.0) * 0.5 + 0.5)  # softmax-like values in [0, 1]
    codec = paper_assign()(SCORES, p)
    packed = codec.encode(p.detach())
    assert torch.allclose(packed.tensors["scale"], torch.full((8,), 1.0 / 16))  # (max-min)/16
    assert torch.allclose(packed.tensors["offset"], torch.full((8,), 0.5))  # (max+min)/2
    y = codec.decode(packed).view(8, 128)
    assert float(y.min()) == pytest.approx(0.0)  # O - 8 S
    assert float(y.max()) == pytest.approx(0.5 + 7 / 16)  # O + 7 S: the max clips by one step


def test_sdpa_output_is_compressed_logsumexp_is_not():
    out = grad_tensor(torch.randn(2, 64, 4, 16).transpose(1, 2))  # [B, H, S, Dh], [B,S,H,Dh] laid
    lse = grad_tensor(torch.randn(2, 4, 64))
    assign = paper_assign()
    codec = assign(SDPA + "4", out)
    assert codec is not None and codec.config.channels == 64  # H * Dh, o_proj's input width
    assert assign(SDPA + "3", lse) is None
    assert PlanAssign(Int4Config().plan())(SDPA + "4", out) is None  # int4 keeps it exact


def test_naive_per_token_scale_and_clip():
    x = torch.randn(32, 40)  # 32 tokens of 40 channels (not a power of two)
    x[2] *= 50  # one outlier token gets its own scale
    x = grad_tensor(x)
    codec = naive_assign()(ACT, x)
    assert isinstance(codec, TokenQuantCodec) and codec.config.paper_scale
    packed = codec.encode(x.detach())
    amax = x.detach().abs().amax(1)
    assert torch.allclose(packed.tensors["scale"], amax / 8)  # one S = max|row| / 8 per token
    y = codec.decode(packed)
    codes = torch.round(y / (amax / 8)[:, None])
    assert int(codes.max()) <= 7 and int(codes.min()) >= -8


@pytest.mark.parametrize("shape", [(3, 37), (1, 1025), (5, 7, 33)])  # odd rows x odd widths
def test_naive_round_trip_error_bound(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.rand(shape[-1]) * 3
    codec = TokenQuantConfig().build()
    packed = codec.encode(x)
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    rows = x.reshape(-1, shape[-1])
    s = rows.abs().amax(1, keepdim=True) / 8
    err = (y.reshape(rows.shape) - rows).abs()
    assert bool((err <= s * (1 + 1e-6)).all())  # within one step (the clipped max)
    below = rows <= 7.5 * s  # everything that is not clipped: within half a step
    assert bool((err[below] <= (s / 2).expand_as(rows)[below] * (1 + 1e-6)).all())
    assert codec.nbytes(packed) == math.ceil(x.numel() / 2) + 4 * rows.shape[0]


def test_paper_act_round_trip_error_bound():
    torch.manual_seed(1)
    x = grad_tensor(torch.randn(64, 96) * 2)
    x.data[:, 5] *= 40  # an outlier channel: stored exactly
    codec = paper_assign()(ACT, x)
    y = codec.decode(codec.encode(x.detach())).view(64, 96)
    assert torch.equal(y[:, 5], x.detach()[:, 5])
    rest = torch.cat([x.detach()[:, :5], x.detach()[:, 6:]], 1)
    s = rest.abs().amax() / 8  # every group's scale is at most this
    assert float((y - x.detach()).abs().max()) <= float(s) * (1 + 1e-6)


def test_naive_nonfinite_and_bad_config():
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    codec = TokenQuantConfig().build()
    y = codec.decode(codec.encode(x))
    assert torch.isnan(y[1, 3]) and y[2, 0] == float("inf")
    assert torch.isfinite(y[0]).all()
    with pytest.raises(ValueError, match="channels must be an int >= 0, got -1"):
        TokenQuantConfig(channels=-1)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        NaiveInt4Config(bits=3)
    with pytest.raises(ValueError, match="paper_scale must be a bool, got 'yes'"):
        Int4Config(paper_scale="yes")


# ----------------------------------------------------------------------------- on a model


def run(strategy, x, autocast=False, seed=0):
    torch.manual_seed(seed)
    model = build_model("llama-tiny")
    if strategy:
        slimact.apply(model, strategy)
    with measure(model, n_tokens=x.numel()) as m:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, targets=x).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return m.report, grads


def cosines(g0, g):
    flat = F.cosine_similarity(
        torch.cat([g0[n].flatten() for n in g0]), torch.cat([g[n].flatten() for n in g0]), dim=0
    )
    per = min(float(F.cosine_similarity(g0[n].flatten(), g[n].flatten(), dim=0)) for n in g0)
    return float(flat), per


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("strategy", ["int4-paper", "int4-naive"])
@pytest.mark.parametrize("shape", [(2, 64), (3, 37)])
def test_gradients_close_to_exact_autograd(strategy, autocast, shape):
    x = torch.randint(0, 250, shape, generator=torch.Generator().manual_seed(0))
    _, g0 = run(None, x, autocast)
    rep, g = run(strategy, x, autocast)
    overall, worst = cosines(g0, g)
    assert overall > 0.97 and worst > 0.9, (overall, worst)
    sdpa_out = [
        r for r in rep.sites if r.op == "scaled_dot_product_attention" and len(r.shape) == 4
    ]
    assert len(sdpa_out) == 8 and all(r.action != "keep" for r in sdpa_out)  # q, k, v, out x 2


def test_naive_bytes_measured():
    b, s = 2, 64
    x = torch.randint(0, 250, (b, s), generator=torch.Generator().manual_seed(0))
    base, _ = run(None, x)
    rep, _ = run("int4-naive", x)
    sites = {r.site: r for r in rep.sites}
    down = sites["layers.0.mlp.down_proj:linear#0"]  # [B*S, 172] fp32 -> codes + 1 scale/token
    n = b * s * 172
    assert down.action == "codec:int4-token" and down.bytes == n // 2 + 4 * b * s
    qkv_in = sites["layers.0.self_attn.q_proj:linear#0"]  # shared by k/v_proj: counted once
    assert qkv_in.bytes == b * s * 64 // 2 + 4 * b * s
    assert sites["layers.0.self_attn.k_proj:linear#0"].bytes == 0
    q = sites[SDPA + "0"]  # [B, H, S, Dh]: a token's row is H * Dh = 64 values
    assert q.bytes == b * s * 64 // 2 + 4 * b * s
    assert sites[":cross_entropy#0"].action == "keep"
    assert rep.total_bytes / base.total_bytes < 0.3
    paper, _ = run("int4-paper", x)
    assert rep.total_bytes < run("int4", x)[0].total_bytes
    assert paper.total_bytes < base.total_bytes


def test_composition_and_revert():
    with pytest.raises(ValueError, match="role 'act' two codecs in every module: int4-token"):
        slimact.apply(build_model("llama-tiny"), "int4-naive+int4")
    assert isinstance(resolve("int4-naive")[0], NaiveInt4Config)
    model = build_model("llama-tiny")
    slimact.apply(model, "invact+int4-naive")
    slimact.revert(model)
    assert slimact.applied(model) == []
