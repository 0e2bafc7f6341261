"""The loss head under fine-tuning stacks: peft, autocast, ``num_items_in_batch``, TRL's fused
head, calls without labels, and a model compiled whole after ``slimact.apply``.

Tiny random Hugging Face Llamas (CPU, offline); each check against the unpatched model's own
loss and gradients on a padded batch with ``-100`` labels."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import slimact
from slimact.strategies.auto import AutoConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V = 128


def _llama(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).train()


def _lora(model: torch.nn.Module, task_type: str | None = "CAUSAL_LM") -> torch.nn.Module:
    torch.manual_seed(1)  # non-zero B: every LoRA weight gets a gradient
    cfg = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False,
        task_type=task_type,
    )  # fmt: skip
    return peft.get_peft_model(model, cfg)


def _batch() -> dict:
    """Three rows of 12, 8 and 5 tokens, right-padded: attention_mask and -100 labels."""
    ids = torch.randint(1, V, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _step(model, **extra) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**_batch(), **extra).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _same(got, want) -> None:
    (loss, grads), (ref, ref_grads) = got, want
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _head_rows(model) -> list:
    return [c for c in slimact.applied(model) if c.action == "chunked-ce"]


@pytest.mark.parametrize("strategy", ["chunked-ce", "auto@14%"])
def test_peft_lora_head_trains_the_shifted_loss(strategy, tmp_path):
    """Through a ``PeftModel`` the labels are shifted as the wrapped causal LM shifts them: the
    chunked head's loss and every LoRA gradient are the model's own (a padded batch)."""
    want = _step(_lora(_llama()))
    model = _lora(_llama())
    # exact (no codec), at a budget only plans with the chunked head meet (the smallest
    # feasible is 12%), so the choice does not hang on the profile's timings
    spec = AutoConfig(budget="14%", cache=str(tmp_path), codecs=(), repeats=1)
    spec = strategy if strategy == "chunked-ce" else spec
    slimact.apply(model, spec)
    got = _step(model)  # auto plans on this batch
    rows = _head_rows(model)
    assert rows and not any(r.skipped for r in rows), rows
    _same(got, want)
    assert all("lora_" in n for n in got[1])  # the base weights are frozen


def test_peft_model_without_task_type_sees_the_wrapped_label():
    """``PeftModel`` without a task type forwards ``*args, **kwargs``: the label parameter is
    the wrapped model's."""
    want = _step(_lora(_llama(), task_type=None))
    model = slimact.apply(_lora(_llama(), task_type=None), "chunked-ce")
    assert [r.skipped for r in _head_rows(model)] == [False]
    _same(_step(model), want)


def _autocast_forward(model: torch.nn.Module) -> torch.nn.Module:
    """The model's forward under bf16 autocast, as accelerate's ``mixed_precision`` (so
    ``Trainer(bf16=True)``) wraps it before a callback applies slimact."""
    fwd = torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward)
    model.forward = types.MethodType(fwd, model)
    return model


def test_probe_accepts_a_plain_head_under_autocast():
    """The probe computes the chunked loss under the autocast the head runs in, and compares at
    bf16's tolerance: a plain Llama head under a bf16 forward is patched, not skipped."""
    ref_model = _autocast_forward(_llama())
    want = _step(ref_model)
    model = slimact.apply(_autocast_forward(_llama()), "chunked-ce")
    assert [r.skipped for r in _head_rows(model)] == [False], _head_rows(model)
    loss, grads = _step(model)
    torch.testing.assert_close(loss, want[0], rtol=2e-2, atol=0)
    for name, g in want[1].items():
        cos = torch.nn.functional.cosine_similarity(grads[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


def test_num_items_in_batch_is_sum_over_items():
    """With ``num_items_in_batch`` (Trainer under gradient accumulation) the chunked loss is
    HF's: the sum over the batch's tokens divided by the items, not the batch mean."""
    items = torch.tensor(40)
    want = _step(_llama(), num_items_in_batch=items)
    model = slimact.apply(_llama(), "chunked-ce")
    got = _step(model, num_items_in_batch=items)
    _same(got, want)
    assert not torch.isclose(got[0], _step(_llama())[0], rtol=1e-3)  # it is not the mean


class _MeanOnlyLlama(transformers.LlamaForCausalLM):
    """A causal LM whose loss ignores ``num_items_in_batch`` (always the batch mean)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        kwargs.pop("num_items_in_batch", None)
        return super().forward(input_ids, attention_mask, labels=labels, **kwargs)


def test_probe_skips_a_head_whose_loss_ignores_num_items():
    """The chunked loss divides by ``num_items_in_batch``; a model that does not would train
    another objective under gradient accumulation, so the probe skips its head."""
    model = _llama()
    model.__class__ = _MeanOnlyLlama
    slimact.apply(model, "chunked-ce")
    (row,) = _head_rows(model)
    assert row.skipped and "chunked loss" in row.detail, row


class _NoKwargsLlama(transformers.LlamaForCausalLM):
    """A causal LM whose forward takes no ``num_items_in_batch`` (nor ``**kwargs``)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        return super().forward(input_ids, attention_mask=attention_mask, labels=labels)


def test_probe_passes_num_items_only_where_the_forward_takes_them():
    """``Trainer`` passes no ``num_items_in_batch`` to a forward that cannot take it, and
    neither does the probe: such a plain head is patched, its loss the model's."""
    model = _llama()
    model.__class__ = _NoKwargsLlama
    want = _step(model)
    slimact.apply(model, "chunked-ce")
    assert [r.skipped for r in _head_rows(model)] == [False], _head_rows(model)
    _same(_step(model), want)


def test_auto_plans_the_head_only_after_the_probe(soft_capped_llama, tmp_path):
    """``auto`` considers the chunked head only where the fixed strategy's loss check passes:
    a soft-capped head (more than linear + cross-entropy) is never planned."""
    (row,) = _head_rows(slimact.apply(soft_capped_llama(), "chunked-ce"))
    assert row.skipped
    model = soft_capped_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator())
    ref = soft_capped_llama()(ids, targets=ids.roll(-1, 1)).loss
    slimact.apply(model, AutoConfig(budget="20%", cache=str(tmp_path), codecs=("int8",), repeats=1))
    loss = model(ids, targets=ids.roll(-1, 1)).loss  # planned on this batch
    loss.backward()
    assert not [r for r in _head_rows(model) if not r.skipped], _head_rows(model)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)


def test_trl_fused_head_call_runs_unchanged():
    """TRL's trainers call ``model(..., labels=..., fused_lm_head=True)`` and read the labels in
    their patched forward: slimact leaves such a call as it is (never hides its labels), says
    so once, and the loss is TRL's own; under peft as the SFTTrainer wraps it."""
    trl_utils = pytest.importorskip("trl.trainer.utils")

    def fused(model):
        trl_utils.add_fused_lm_head(model, outputs=("log_probs",))
        return model

    want = _step(_lora(fused(_llama())), fused_lm_head=True)
    for model in (_lora(fused(_llama())), fused(_lora(_llama()).get_base_model())):
        slimact.apply(model, "chunked-ce")
        assert [r.skipped for r in _head_rows(model)] == [False]
        with pytest.warns(UserWarning, match="fused_lm_head=True") as rec:
            got = _step(model, fused_lm_head=True)
            _step(model, fused_lm_head=True)
        assert sum("fused_lm_head" in str(w.message) for w in rec) == 1  # once per model
        if isinstance(model, peft.PeftModel):
            _same(got, want)


def test_training_call_without_labels_says_so_once():
    """A training forward without labels (a custom loop computing its own loss) runs the head
    unchanged, logits included, and says once that it saves nothing there."""
    model = slimact.apply(_llama(), "chunked-ce")
    ids = _batch()["input_ids"]
    with pytest.warns(UserWarning, match="without `labels`") as rec:
        logits = model(ids).logits
        model(ids)
    assert sum("without `labels`" in str(w.message) for w in rec) == 1
    assert logits.shape == (*ids.shape, V) and logits.stride()[-1] == 1
    with warnings.catch_warnings():  # eval and labelled calls: nothing to say
        warnings.simplefilter("error")
        with torch.no_grad():
            model(ids)
        model(**_batch())


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
@pytest.mark.parametrize("strategy", ["int4", "chunked-ce"])
def test_compile_after_apply_is_refused(how, strategy):
    """A model compiled whole after ``slimact.apply`` would run past slimact's hooks, silently
    uncompressed: its first call raises, naming ``compile=True``."""
    model = slimact.apply(_llama(), strategy)
    if how == "torch.compile":
        model = torch.compile(model, backend="aot_eager")
    else:
        model.compile(backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"compiled whole.*compile=True"):
        model(**_batch())


def test_revert_under_a_wrapper_installed_after_apply():
    """accelerate's ``prepare`` (mixed precision: ``Trainer(bf16=True)``) wraps ``model.forward``
    after ``slimact.apply``, holding the chunked root inside: after ``slimact.revert`` the model
    computes its own loss through that wrapper (the held root passes calls through)."""
    want = _step(_llama())
    model = slimact.apply(_llama(), "chunked-ce")
    held = model.forward
    model.forward = types.MethodType(lambda self, *a, **kw: held(*a, **kw), model)
    slimact.revert(model)
    _same(_step(model), want)
