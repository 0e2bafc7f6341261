"""``apply(model, spec, compile=True)`` on Hugging Face decoders: zero graph breaks, exact bytes
from the meter, gradients close to eager autograd (small configs, random weights, offline)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact import hf

transformers = pytest.importorskip("transformers")
dynamo = pytest.importorskip("torch._dynamo")

V, B, S = 128, 2, 32
DEC = dict(
    vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
)  # fmt: skip


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    t = transformers
    if arch == "gpt2":
        cfg = t.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=S)
        # no dropout: inductor draws other masks than eager, and the gradients are compared
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        cfg.bos_token_id = cfg.eos_token_id = V - 1
        return t.GPT2LMHeadModel(cfg)
    cls = {"llama": t.LlamaForCausalLM, "qwen2": t.Qwen2ForCausalLM}.get(arch)
    cls = cls or t.MistralForCausalLM
    cfg = {"llama": t.LlamaConfig, "qwen2": t.Qwen2Config, "mistral": t.MistralConfig}[arch]
    return cls(cfg(**DEC))


def _step(model):
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return m.report.total_bytes, grads.double()


@pytest.mark.parametrize(
    "arch",
    ["llama", pytest.param("qwen2", marks=pytest.mark.slow)]
    + [pytest.param(a, marks=pytest.mark.slow) for a in ("mistral", "gpt2")],
)
def test_compiled_codec_blocks_on_hf(arch):
    torch.set_num_threads(1)
    eager = build(arch)
    e_bytes, e_grads = _step(eager)
    model = slimact.apply(copy.deepcopy(eager), "int8+recompute", compile=True)
    assert [c.detail for c in slimact.applied(model)] == [
        "recompute/budget=0+codec:compiled-int8"
    ] * 2
    dynamo.reset()
    _step(model)  # compiles
    c_bytes, c_grads = _step(model)
    assert hf.graph_breaks() == {}
    assert c_bytes < 0.5 * e_bytes
    assert F.cosine_similarity(c_grads, e_grads, dim=0) > 0.999


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(
    ("strategy", "cos"), [("compiled-int6", 0.999), ("compiled-int4-outlier", 0.99)]
)
def test_sub_int8_codecs_on_hf(arch, strategy, cos):
    """INT6 (four codes in three bytes) and outlier INT4 (top-k channels exact, ``topk`` and
    ``index_copy`` in the traced hooks) inside HF blocks: no graph break, fewer bytes."""
    torch.set_num_threads(1)
    eager = build(arch)
    e_bytes, e_grads = _step(eager)
    model = slimact.apply(copy.deepcopy(eager), strategy)
    dynamo.reset()
    _step(model)  # compiles
    c_bytes, c_grads = _step(model)
    assert hf.graph_breaks() == {}
    assert c_bytes < 0.5 * e_bytes
    assert F.cosine_similarity(c_grads, e_grads, dim=0) > cos
