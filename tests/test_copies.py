"""Copies of a model with a strategy applied are independent and behave like the original.

``copy.deepcopy`` used to give a copy whose forward ran the *original* module (instance forwards
were closures over it), and ``pickle``/``torch.save`` failed on the closures in the change log.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch

import slimact
from slimact.models import build_model
from slimact.patching import NotCopyable, overrides
from slimact.planner.apply import runtime_of
from slimact.state import state_of
from slimact.strategies.auto import AutoConfig

B, S = 2, 64


def _ids(vocab: int = 257) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(1))


def _loss(model, x):
    if hasattr(model, "generation_config"):  # a Hugging Face model
        return model(input_ids=x, labels=x).loss
    return model(x, targets=x).loss


def _step(model, x):
    """One measured forward+backward: (loss, report, grads by name)."""
    with slimact.measure(model) as m:
        loss = _loss(model, x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), m.report, grads


def _bytes(report):
    return [(s.site, s.action, s.bytes) for s in report.sites]


def _patched(model):
    return [m for m in model.modules() if "forward" in m.__dict__]


def check_copy(model, x):
    """deepcopy and pickle round-trip of ``model`` (a strategy applied, never stepped)."""
    c = copy.deepcopy(model)
    rt, rt_c = runtime_of(model), runtime_of(c)
    assert _patched(c) or rt_c is not None, "the strategy patched nothing: nothing to test"
    if rt is not None:  # auto: the plan runtime (its hooks, policy, codecs) belongs to the copy
        assert rt_c is not rt and rt_c.model is c and rt_c.policy is not rt.policy
    own = {id(m) for m in c.modules()}
    for m in _patched(c):  # every override runs the copy's own modules
        for o in overrides(m):
            assert o.module is m
            assert all(id(a) in own for a in o.args if isinstance(a, torch.nn.Module))
    loss, report, grads = _step(model, x)
    loss_c, report_c, grads_c = _step(c, x)
    assert torch.equal(loss_c, loss)
    assert _bytes(report_c) == _bytes(report) and report_c.total_bytes == report.total_bytes
    assert grads_c.keys() == grads.keys() and grads
    for name, g in grads.items():  # the copy's backward reached the copy's parameters only
        assert torch.allclose(grads_c[name], g, rtol=1e-4, atol=1e-6), name
        p = model.get_parameter(name)
        assert torch.equal(p.grad, g), f"{name}: the copy's backward changed the original's grad"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():  # one SGD step on the copy (torch.optim would import dynamo: slow)
        for p in c.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.5)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n}: a step on the copy changed the original"
    assert any(not torch.equal(p, before[n]) for n, p in c.named_parameters())
    with torch.no_grad():
        assert not torch.equal(_loss(c, x), loss)
        # (bit-equal where the no-grad forward runs the same ops: a plan with an inverted
        # activation runs the plain one without grad, which may differ in the last bit)
        assert torch.allclose(_loss(model, x), loss, rtol=1e-6, atol=0)
    slimact.revert(c)
    assert not _patched(c) and runtime_of(c) is None
    assert _patched(model) or runtime_of(model) is not None

    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in _patched(loaded):
        assert all(o.module is m for o in overrides(m))
    loss_l, report_l, _ = _step(loaded, x)
    assert torch.allclose(loss_l, loss)
    assert report_l.total_bytes > 0
    assert all(p.grad is not None for p in loaded.parameters() if p.requires_grad)
    return loaded


@pytest.mark.parametrize("strategy", ["int4", "int8", "prac", "invact+int4", "recompute"])
def test_deepcopy_and_pickle_llama(strategy, one_thread):
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), strategy)
    loaded = check_copy(model, _ids())
    assert [c.action for c in slimact.applied(loaded)] == [c.action for c in slimact.applied(model)]
    slimact.revert(loaded)
    assert not _patched(loaded)


def test_deepcopy_and_pickle_auto(tmp_path, one_thread):
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    fast = dict(repeats=1, codecs=("int4", "int8"), cache=str(tmp_path))
    slimact.apply(model, AutoConfig(budget="50%", **fast))
    x = _ids()
    _loss(model, x).backward()  # lazy planning happens on the first training forward
    model.zero_grad(set_to_none=True)
    check_copy(model, x)


@pytest.mark.parametrize("strategy", ["int4", "recompute"])
def test_deepcopy_and_pickle_hf_llama(strategy, one_thread):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
    )  # fmt: skip
    model = slimact.apply(transformers.LlamaForCausalLM(cfg), strategy)
    loaded = check_copy(model, _ids(128))
    for m in (model, copy.deepcopy(model), loaded):  # Trainer keeps the columns forward takes
        assert "input_ids" in inspect.signature(m.forward).parameters


def test_copy_of_a_copy_and_applied_log_are_independent(one_thread):
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), "invact+int4")
    c2 = copy.deepcopy(copy.deepcopy(model))
    rt, rt2 = runtime_of(model), runtime_of(c2)  # int4: a plan of rules on the plan runtime
    assert rt2 is not rt and rt2.model is c2 and rt2.assign is not rt.assign
    assert rt2.plan == rt.plan and rt2.plan.rules
    for m in _patched(c2):  # invact's swaps: overrides of the copy's own modules
        assert overrides(m) and all(o.module is m for o in overrides(m))
    slimact.revert(model)  # reverting the original leaves the copy's patches alone
    assert _patched(c2) and not _patched(model)
    assert runtime_of(model) is None and runtime_of(c2) is rt2 and rt2.policy is not None
    x = _ids()
    with torch.no_grad():
        assert torch.allclose(_loss(c2, x), _loss(model, x), rtol=1e-5, atol=1e-5)


def test_prac_state_is_copied_not_shared(one_thread):
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), "prac")
    x = _ids()
    _loss(model, x).backward()
    c = pickle.loads(pickle.dumps(model))
    state, state_c = (state_of(m).stateful["prac"] for m in (model, c))
    assert state_c is not state and state_c.forwards == state.forwards
    assert state_c.modules[""] is c
    _loss(c, x).backward()
    assert state_c.forwards == state.forwards + 1


def test_not_copyable_says_what_to_do():
    nc = NotCopyable(lambda x: x + 1, "a torch.compile'd block forward")
    assert nc(1) == 2
    for fn in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="torch.compile'd block forward.*slimact.revert"):
            fn(nc)


def test_slimact_keeps_one_typed_state_per_model(one_thread):
    """One ``ModelState`` under one key (issue 15.4), copied with the model, emptied by revert."""
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), "invact+int4")
    keys = [k for k in model.__dict__ if k.startswith("_slimact")]
    assert keys == ["_slimact"], keys
    st = state_of(model)
    assert [c.action for c in st.applied] == [c.action for c in slimact.applied(model)]
    assert st.strategies == ["invact", "int4"] and st.runtime is not None
    c = pickle.loads(pickle.dumps(model))
    assert state_of(c) is not st and state_of(c).strategies == st.strategies
    assert state_of(c).runtime is not st.runtime and state_of(c).runtime.model is c
    slimact.revert(model)
    assert state_of(model).applied == [] and state_of(model).runtime is None
    assert state_of(c).runtime is not None and state_of(c).runtime.plan.rules  # its own
