"""CoLALinear, the CoLA model family, convert() and the ``cola`` strategy marker (cola.txt §3)."""

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimact
from slimact.cola import (
    CoLAConfig,
    CoLAGPT2Model,
    CoLALinear,
    CoLALlamaModel,
    cola_linear,
    convert,
    is_cola_model,
)
from slimact.cola.layers import second_moment
from slimact.models import GPT2Config, LlamaConfig, build_model, count_params

# ---------------------------------------------------------------- CoLALinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7, 13), (5, 13), (1, 1, 13)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "identity"])
def test_cola_linear_matches_reference_output_and_grads(dtype, shape, activation):
    lin = CoLALinear(13, 11, 5, activation, bias=True).to(dtype)
    with torch.no_grad():
        lin.cola_b.bias.normal_()
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    a = lin.A.detach().clone().requires_grad_()
    b = lin.B.detach().clone().requires_grad_()
    bias = lin.bias.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y = lin(x)
    act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}.get(
        activation, lambda t: t
    )
    y_ref = act(x2 @ a.t()) @ b.t() + bias  # B σ(A x) + bias, written out
    assert y.shape == (*shape[:-1], 11) and y.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(y, cola_linear(x, lin.A, lin.B, lin.bias, activation))
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    torch.testing.assert_close(lin.A.grad, a.grad, **tol)
    torch.testing.assert_close(lin.B.grad, b.grad, **tol)
    torch.testing.assert_close(lin.bias.grad, bias.grad, **tol)


@pytest.mark.parametrize("bad", [0, -3, 8, 10, 2.5, True, None])
def test_cola_linear_rejects_bad_rank_with_valid_range(bad):
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, 7\]"):
        CoLALinear(8, 16, bad)


def test_cola_linear_rejects_unknown_activation():
    with pytest.raises(ValueError, match="unknown CoLA activation 'tanh'; valid: silu"):
        CoLALinear(8, 8, 2, "tanh")


def test_second_moment_quadrature():
    assert second_moment("identity") == pytest.approx(1.0, abs=1e-10)
    assert second_moment("relu") == pytest.approx(0.5, abs=1e-10)
    z = torch.randn(2_000_000, dtype=torch.float64)
    assert second_moment("silu") == pytest.approx(float(F.silu(z).square().mean()), rel=5e-3)


def test_init_matches_full_rank_output_scale():
    torch.manual_seed(1)
    lin = CoLALinear(512, 1376, 128, "silu", target_std=0.02)
    x = torch.randn(4096, 512)  # unit-RMS input, as after RMSNorm
    with torch.no_grad():
        z = lin.cola_a(x)
        y = lin(x)
    assert float(z.std()) == pytest.approx(1.0, rel=0.05)  # A ~ N(0, 1/d_in)
    assert float(y.std()) == pytest.approx(0.02 * math.sqrt(512), rel=0.1)  # = full-rank scale


def test_nan_in_gives_nan_out_not_garbage():
    lin = CoLALinear(8, 8, 3)
    x = torch.randn(2, 8)
    x[0, 0] = float("nan")
    y = lin(x)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()


# ---------------------------------------------------------------- model family


@pytest.mark.parametrize(
    "name,paper_m", [("cola-60m", 43), ("cola-130m", 94), ("cola-350m", 185), ("cola-1b", 609)]
)
def test_param_counts_match_table5(name, paper_m):
    assert count_params(name) / 1e6 == pytest.approx(paper_m, rel=0.02)


@pytest.mark.slow
def test_sizes_ranks_and_both_sigma_defaults():
    expect = {"cola-60m": (128, 512, True), "cola-130m": (256, 768, True),
              "cola-350m": (256, 1024, False), "cola-1b": (512, 2048, False),
              "cola-7b": (1024, 4096, False), "cola-20m": (128, 512, True)}  # fmt: skip
    for name, (r, d, both) in expect.items():
        m = build_model(name, device="meta")
        assert (m.config.rank, m.config.d_model, m.config.both_sigma) == (r, d, both), name
        act = m.layers[0].mlp.act_fn
        assert isinstance(act, nn.SiLU) if both else isinstance(act, nn.Identity)
        assert isinstance(m.layers[0].mlp.down_proj, CoLALinear)
    assert count_params("cola-20m") < 0.45 * count_params("llama-20m")


def test_cola_tiny_forward_backward_and_learns():
    torch.manual_seed(0)
    m = build_model("cola-tiny")
    assert is_cola_model(m)
    assert len([x for x in m.modules() if isinstance(x, CoLALinear)]) == 7 * 2
    x = torch.randint(0, 257, (2, 16))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = m(x, targets=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_config_rejects_bad_rank():
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, 63\].*got 64"):
        CoLAConfig(d_model=64, n_heads=4, d_ff=172, rank=64)
    with pytest.raises(ValueError, match=r"mlp_rank.*\[1, 31\]"):
        CoLAConfig(d_model=64, n_heads=4, d_ff=32, rank=8, mlp_rank=40)


# ---------------------------------------------------------------- convert


def test_convert_llama_config_defaults_to_quarter_rank():
    m = convert(LlamaConfig(vocab_size=257, d_model=64, n_layers=2, n_heads=4, d_ff=172))
    assert isinstance(m, CoLALlamaModel) and m.config.rank == 16 and m.config.both_sigma
    assert m.layers[1].self_attn.k_proj.rank == 16
    y = m(torch.randint(0, 257, (1, 8))).logits
    assert y.shape == (1, 8, 257)


def test_convert_gpt2_uses_gelu_and_bias():
    cfg = GPT2Config(vocab_size=257, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=64)
    m = convert(cfg, rank=8, both_sigma=False)
    assert isinstance(m, CoLAGPT2Model)
    c_attn = m.h[0].attn.c_attn
    assert (c_attn.in_features, c_attn.rank, c_attn.out_features) == (64, 8, 192)
    assert c_attn.activation == "gelu_tanh" and c_attn.bias is not None
    assert isinstance(m.h[0].mlp.act, nn.Identity)
    x = torch.randint(0, 257, (2, 16))
    m(x, targets=x).loss.backward()


def test_convert_hf_llama_config_offline():
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    m = convert(hf, rank=12)
    assert (m.config.d_model, m.config.d_ff, m.config.vocab_size) == (64, 160, 300)
    assert m.layers[0].mlp.gate_proj.out_features == 160 and m.config.rank == 12
    hf_gqa = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        convert(hf_gqa)


def test_convert_instance_keeps_other_weights_and_reports_left_alone():
    torch.manual_seed(0)
    src = build_model("llama-tiny")
    src.layers[0].mlp.extra = nn.Linear(64, 10)  # not a LLaMA projection
    src.layers[1].self_attn.q_proj = nn.Linear(64, 32, bias=False)  # odd shape
    with pytest.warns(UserWarning, match=r"layers\.0\.mlp\.extra.*layers\.1\.self_attn\.q_proj"):
        new = convert(src, rank=8)
    left = dict(new.cola_left_alone)
    assert set(left) == {"layers.0.mlp.extra", "layers.1.self_attn.q_proj", "lm_head"}
    assert "Linear(64->32) matches no projection" in left["layers.1.self_attn.q_proj"]
    assert isinstance(new.layers[0].self_attn.q_proj, CoLALinear)
    assert isinstance(src.layers[0].self_attn.q_proj, nn.Linear)  # source untouched
    torch.testing.assert_close(new.embed_tokens.weight, src.embed_tokens.weight)
    assert new.config.rank == 8


def test_convert_rejects_unknown_objects():
    with pytest.raises(TypeError, match="expected a slimact LlamaConfig"):
        convert({"d_model": 64})
    with pytest.raises(TypeError, match="has no .config"):
        convert(nn.Linear(4, 4))


def test_convert_instance_without_warning_for_plain_llama():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = convert(build_model("llama-tiny"))
    assert [p for p, _ in new.cola_left_alone] == ["lm_head"]


# ---------------------------------------------------------------- strategy marker


def test_cola_strategy_is_a_marker_on_cola_models_only():
    m = build_model("cola-tiny")
    x = torch.randint(0, 257, (1, 16))
    before = m(x).logits
    slimact.apply(m, "cola")
    changes = slimact.applied(m)
    assert len(changes) == 14 and all(c.action == "cola" and not c.skipped for c in changes)
    torch.testing.assert_close(m(x).logits, before)
    with pytest.raises(ValueError, match="needs a CoLA model.*build_model\\('cola-20m'\\)"):
        slimact.apply(build_model("llama-tiny"), "cola")
