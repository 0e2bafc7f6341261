"""KV caches under slimact strategies on Hugging Face causal LMs (issue 14.6).

A checkpointed decoder block writes its KV cache again when backward replays it: before the fix
``recompute`` returned a cache twice the sequence long and, at one token, backward raised
``CheckpointError``. Now training forwards run with ``use_cache=False`` and one warning (as HF's
own gradient checkpointing does), blocks handed a cache with grad on run un-checkpointed, and
eval / ``generate`` without grad return the same caches and tokens as the unpatched model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import slimact
from slimact.checkpointing import GUARD_ACTION

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only contend

V, B = 96, 2
CFG = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
)  # fmt: skip
CACHE_MSG = "use_cache=True` is incompatible"


def build(strategy: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).train()
    return slimact.apply(model, strategy) if strategy else model


def tokens(seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, seq), generator=torch.Generator().manual_seed(seed))


def train_step(model, ids, **kwargs):
    """One training forward with ``use_cache=True``; backward of a loss defined at any length."""
    out = model(input_ids=ids, use_cache=True, **kwargs)
    out.logits.float().pow(2).mean().backward()
    return out


def grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def cache_warnings(record) -> list[str]:
    return [str(w.message) for w in record if CACHE_MSG in str(w.message)]


@pytest.mark.parametrize("seq", [1, 2, 7])
def test_recompute_training_forward_drops_the_cache_with_one_warning(seq):
    ref = build()
    ref_out = ref(input_ids=tokens(seq), use_cache=False)
    ref_out.logits.float().pow(2).mean().backward()
    model = build("recompute")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = train_step(model, tokens(seq))  # seq 1: CheckpointError before the fix
        model.zero_grad(set_to_none=True)
        out = train_step(model, tokens(seq))
    assert out.past_key_values is None  # was a cache of 2 * seq tokens
    msgs = cache_warnings(record)
    assert len(msgs) == 1, msgs
    assert "LlamaForCausalLM" in msgs[0] and "use_cache=False" in msgs[0]
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=0)
    for g, r in zip(grads(model), grads(ref)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_use_cache_false_or_config_off_gives_no_warning():
    model = build("recompute")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(input_ids=tokens(4), use_cache=False).logits.sum().backward()
        model.config.use_cache = False
        model(input_ids=tokens(4)).logits.sum().backward()
    assert cache_warnings(record) == []
    model.config.use_cache = True  # default from the config: the guard overrides it too
    with pytest.warns(UserWarning, match=CACHE_MSG):
        out = model(input_ids=tokens(4))
    assert out.past_key_values is None


@pytest.mark.parametrize("train_mode", [False, True])
def test_no_grad_forward_and_generate_keep_the_cache(train_mode):
    ids = tokens(5)
    ref, model = build().train(train_mode), build("recompute").train(train_mode)
    with torch.no_grad():
        a, b = ref(input_ids=ids, use_cache=True), model(input_ids=ids, use_cache=True)
    assert b.past_key_values is not None and b.past_key_values.get_seq_length() == 5
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=0)
    for la, lb in zip(a.past_key_values.layers, b.past_key_values.layers):
        torch.testing.assert_close(lb.keys, la.keys, rtol=0, atol=0)
        torch.testing.assert_close(lb.values, la.values, rtol=0, atol=0)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref.eval(), model.eval()
    torch.testing.assert_close(model.generate(ids, **gen), ref.generate(ids, **gen))


def test_eval_forward_with_grad_writes_the_cache_once():
    ids = tokens(6)
    ref, model = build().eval(), build("recompute").eval()
    a = ref(input_ids=ids, use_cache=True)
    a.logits.sum().backward()
    with pytest.warns(UserWarning, match="runs without recomputation"):
        b = model(input_ids=ids, use_cache=True)  # eval mode: the guard leaves use_cache alone
    b.logits.sum().backward()
    assert b.past_key_values.get_seq_length() == 6  # was 12: written again on the replay
    for g, r in zip(grads(model), grads(ref)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_prefix_cache_passed_into_a_training_forward():
    ids = tokens(9)
    out = {}
    for name in (None, "recompute"):
        model = build(name)
        with torch.no_grad():
            past = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = model(input_ids=ids[:, 4:], past_key_values=past, labels=ids[:, 4:])
        res.loss.backward()
        out[name] = (res.loss.detach(), grads(model), past.get_seq_length())
    assert out["recompute"][2] == out[None][2] == 9  # prefix + new tokens, each written once
    torch.testing.assert_close(out["recompute"][0], out[None][0], rtol=0, atol=0)
    for g, r in zip(out["recompute"][1], out[None][1]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "strategy", ["int4", "prac", "invact", "invact+int4", "chunked-ce", "auto@25%", "auto@10%"]
)
@pytest.mark.parametrize("seq", [1, 6])
def test_other_strategies_with_use_cache_in_training(strategy, seq):
    model = build(strategy)
    ids = tokens(seq)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        labels = dict(labels=ids) if seq > 1 else {}  # one token: no next-token loss
        out = model(input_ids=ids, use_cache=True, **labels)
        loss = out.loss if seq > 1 else out.logits.float().pow(2).mean()
        loss.backward()  # auto (which may recompute) raised CheckpointError at seq 1
    recomputes = any(c.action == "recompute" and not c.skipped for c in slimact.applied(model))
    if recomputes:
        assert out.past_key_values is None
        assert len(cache_warnings(record)) == 1
    else:  # nothing replays a block: the cache is kept, written once
        assert out.past_key_values.get_seq_length() == seq
    assert all(torch.isfinite(g).all() for g in grads(model) if g is not None)
    assert any(g is not None and g.abs().sum() > 0 for g in grads(model))


def test_auto_guard_is_installed_once_and_reverted():
    model = build("auto@10%")
    with pytest.warns(UserWarning, match=CACHE_MSG):  # plans (recompute) on this forward
        model(input_ids=tokens(6), labels=tokens(6)).loss.backward()
    assert any(c.action == "recompute" for c in slimact.applied(model))
    assert any(c.action == GUARD_ACTION for c in slimact.applied(model))
    slimact.revert(model)
    assert not model._forward_pre_hooks
    out = model(input_ids=tokens(6), use_cache=True)
    assert out.past_key_values.get_seq_length() == 6


def test_revert_and_copies():
    model = build("recompute")
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=CACHE_MSG):
        assert twin(input_ids=tokens(3), use_cache=True).past_key_values is None
    slimact.revert(model)
    assert not model._forward_pre_hooks and not model._forward_pre_hooks_with_kwargs
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model(input_ids=tokens(3), use_cache=True)
    assert cache_warnings(record) == []
    assert out.past_key_values.get_seq_length() == 3


def test_encoder_decoder_training_and_generation():
    cfg = transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32,
    )  # fmt: skip

    def bart(strategy=None):
        torch.manual_seed(0)
        model = transformers.BartForConditionalGeneration(cfg).train()
        return slimact.apply(model, strategy) if strategy else model

    ids, labels = tokens(8), tokens(5, seed=2)
    model = bart("recompute")
    with pytest.warns(UserWarning, match=CACHE_MSG):  # decoder layers write an EncoderDecoderCache
        out = model(input_ids=ids, labels=labels, use_cache=True)
    out.loss.backward()
    assert out.past_key_values is None
    ref, model = bart().eval(), bart("recompute").eval()
    gen = dict(max_new_tokens=5, do_sample=False, num_beams=1)
    torch.testing.assert_close(model.generate(ids, **gen), ref.generate(ids, **gen))
