import time

import pytest
import torch

from slimact.models import build_model, count_params, model_names

TABLE5 = {"llama-60m": 58e6, "llama-130m": 134e6, "llama-350m": 368e6, "llama-1b": 1339e6}


@pytest.mark.parametrize("name,expected", TABLE5.items())
def test_param_counts_match_cola_table5(name, expected):
    assert abs(count_params(name) - expected) / expected < 0.02


def test_gpt2_124m_count_and_tied_embeddings():
    m = build_model("gpt2-124m", device="meta")
    assert m.lm_head.weight is m.wte.weight
    assert abs(count_params(m) - 124.4e6) / 124.4e6 < 0.01


def test_large_models_build_on_meta():
    m = build_model("llama-7b", device="meta")
    assert next(m.parameters()).device.type == "meta"
    assert 6.5e9 < count_params(m) < 7.0e9


def test_tiny_builds_fast():
    t0 = time.perf_counter()
    build_model("llama-tiny")
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_forward_backward(name):
    m = build_model(name)
    x = torch.randint(0, m.config.vocab_size, (2, 17))
    targets = torch.randint(0, m.config.vocab_size, (2, 17))
    out = m(x, targets=targets)
    assert out.logits.shape == (2, 17, m.config.vocab_size)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing
    # untrained model: loss near log(vocab)
    assert abs(out.loss.item() - torch.log(torch.tensor(float(m.config.vocab_size)))) < 0.5


def test_causality():
    m = build_model("llama-tiny").eval()
    x = torch.randint(0, 257, (1, 12))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 257
    with torch.no_grad():
        a, b = m(x).logits, m(y).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_vocab_override_and_registry():
    m = build_model("llama-60m", vocab_size=257, device="meta")
    assert m.config.vocab_size == 257
    assert "llama-20m" in model_names() and "gpt2-355m" in model_names()
    with pytest.raises(ValueError, match="valid models: .*llama-tiny"):
        build_model("llama-3b")


def test_bad_input():
    m = build_model("llama-tiny")
    with pytest.raises(ValueError, match="max_seq_len 256"):
        m(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        m(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="divisible"):
        build_model("llama-tiny", n_heads=5)
