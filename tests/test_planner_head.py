"""The planner's head action: the loss head profiled and planned as ``chunked-ce``.

With a real vocabulary the loss head's logits dominate the saved bytes; before the head was an
action, ``auto@10%`` was infeasible whenever the head alone held more than 10% (issue 17).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import slimact
from slimact.planner import profile_model
from slimact.planner.reforms import HEAD_KIND
from slimact.planner.solve import solve_plan
from slimact.strategies.auto import AutoConfig

V, B, S = 4096, 2, 32


def _batch():
    x = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(0))
    return x[:, :-1], x[:, 1:]


def _model():
    torch.manual_seed(0)
    return slimact.build_model("llama-tiny", vocab_size=V)


def _step(model, ids, tgt):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model) as m:
        out = model(ids, targets=tgt)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return m.report.total_bytes, out.loss.detach(), grads


@pytest.fixture(scope="module")
def profile():
    torch.set_num_threads(1)
    ids, tgt = _batch()
    model = _model()
    model.train()
    return profile_model(model, ids, tgt, repeats=1, codecs=["int8", "int4-channel"])


def _head(prof):
    root = prof.kinds[-1]
    return [r for r in root.reforms if r.kind == HEAD_KIND]


def test_head_is_profiled_as_a_reformulation(profile):
    (head,) = _head(profile)
    assert head.path == "lm_head"
    assert ":cross_entropy#0" in head.silenced and "lm_head:linear#0" in head.silenced
    root = profile.kinds[-1]
    h = next(s for s in root.storages if "lm_head:linear#0" in s.sites)
    assert h.id in head.added  # the chunked op keeps the head's input
    assert any("chunked_ce" in x for x in head.saver_sites[str(h.id)])
    assert 0 < head.extra_bytes <= 64 * B * S  # per-token log-sum-exp (and targets), no logits
    logits = next(s for s in root.storages if ":cross_entropy#0" in s.sites)
    assert logits.bytes >= B * S * V * 4  # what it saves: the (N, V) log-probabilities


def test_ten_percent_is_feasible_only_with_the_head_action(profile):
    plan = solve_plan(profile, "10%", codecs=())  # recompute and reformulations only: exact
    root = plan.layers[-1]
    assert "lm_head" in root.reform
    no_head = dataclasses.replace(
        profile,
        kinds=[
            *profile.kinds[:-1],
            dataclasses.replace(
                profile.kinds[-1],
                reforms=[r for r in profile.kinds[-1].reforms if r.kind != HEAD_KIND],
            ),
        ],
    )
    with pytest.raises(ValueError, match="smallest feasible budget"):
        solve_plan(no_head, "10%", codecs=())


def test_planned_head_keeps_the_budget_and_exact_gradients(profile):
    ids, tgt = _batch()
    base_bytes, base_loss, base_grads = _step(_model(), ids, tgt)
    plan = solve_plan(profile, "10%", codecs=())
    model = _model()
    slimact.apply(model, plan)
    got_bytes, loss, grads = _step(model, ids, tgt)
    assert got_bytes <= plan.budget_bytes * 1.02 and got_bytes <= 0.102 * base_bytes
    torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-6)
    for name, g in base_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    slimact.revert(model)
    assert _step(model, ids, tgt)[0] == base_bytes  # the head and root forwards are restored


def test_auto_ten_percent_plans_the_head_lazily(tmp_path):
    ids, tgt = _batch()
    base_bytes = _step(_model(), ids, tgt)[0]
    model = _model()
    cfg = AutoConfig(budget="10%", cache=str(tmp_path), repeats=1, codecs=("int8",))
    slimact.apply(model, cfg)
    got = _step(model, ids, tgt)[0]  # plans on this very batch, then runs it
    assert got <= 0.102 * base_bytes
    assert any(c.path == "lm_head" for c in slimact.applied(model) if not c.skipped)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_causal_lm_plans_the_head(arch, tmp_path, tiny_causal_lm):
    """The planner profiles a Hugging Face causal LM with its ``labels`` (its loss included), so
    ``auto@10%`` sees the logits, reformulates the head, and keeps the budget exactly."""
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()

    def step(model):
        model.zero_grad(set_to_none=True)
        with slimact.measure(model) as m:
            out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return (
            m.report.total_bytes,
            out.loss.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )

    base = tiny_causal_lm(arch, V, layers=2, max_pos=64)
    base.train()
    base_bytes, base_loss, base_grads = step(base)
    model = tiny_causal_lm(arch, V, layers=2, max_pos=64)
    model.train()
    cfg = AutoConfig(budget="10%", cache=str(tmp_path), repeats=1, codecs=())
    slimact.apply(model, cfg)
    got, loss, grads = step(model)  # planned lazily on this batch, labels included
    assert got <= 0.102 * base_bytes
    assert any(c.path == "lm_head" and c.action == "chunked-ce" for c in slimact.applied(model))
    torch.testing.assert_close(loss, base_loss, rtol=1e-5, atol=1e-6)
    for name, g in base_grads.items():  # recompute + reformulations only: exact
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
