"""slimact.planner.compiled_root: the eager root's options in a compiled plan.

Measured on llama-tiny (eager, no compile: fast); the solver's use of them on synthetic
profiles, against brute force over every (root option, block counts) pair."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

import slimact
from slimact.compiled import BlockChoice
from slimact.models import build_model
from slimact.planner.compiled import CompiledProfile, OptionStat, solve_compiled
from slimact.planner.compiled_root import RootOption, install_root, profile_root, root_reforms

X = torch.randint(0, 257, (2, 65), generator=torch.Generator().manual_seed(3))


def _root_bytes(model) -> int:
    with slimact.measure(model) as m:
        model(X[:, :-1], targets=X[:, 1:])
    return m.report.per_block["(outside blocks)"]


def test_root_int8_measured_and_installed_through_the_plan_runtime():
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    raw = _root_bytes(model)
    before = copy.deepcopy(model.state_dict())
    keep, int8 = profile_root(
        model, X[:, :-1], X[:, 1:], raw, ("none", "int8"), repeats=1, reform=False
    )
    assert keep.codec == "none" and keep.bytes == raw and keep.label == "keep"
    assert int8.label == "codec:int8" and int8.sites
    assert int8.bytes < raw and int8.seconds > 0
    assert 0 < int8.grad_err < 2e-3  # lossy, within auto's default cap
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert install_root(model, keep) == []
    changes = install_root(model, int8)
    assert changes and changes[0].action == "plan"
    assert _root_bytes(model) == int8.bytes  # the prediction is the meter's count
    changes[0].undo()  # the runtime's undo (compiled-auto's revert calls it)
    assert _root_bytes(model) == raw


def test_root_reformulated_head_and_norm_measured_and_installed():
    """llama-tiny's root with the loss head chunked and the final norm inverted: the logits,
    log-probabilities and the norm's input are no longer kept (exact), and INT8 on the head's
    input h on top; every option's bytes are the meter's count once installed, and undo
    restores the model's own bytes."""
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    ids, t = X[:, :-1], X[:, 1:]
    raw = _root_bytes(model)
    assert root_reforms(model, ids.device) == (("lm_head", "chunked-ce"), ("norm", "invnorm:rms"))
    options = profile_root(model, ids, t, raw, ("none", "int8"), repeats=1)
    by_label = {o.label: o for o in options}
    assert list(by_label) == [
        "keep",
        "codec:int8",
        "reformulate:chunked_ce+reformulate:inv_rms_norm",
        "reformulate:chunked_ce+reformulate:inv_rms_norm+codec:int8",
    ]
    reformed = by_label["reformulate:chunked_ce+reformulate:inv_rms_norm"]
    both = by_label["reformulate:chunked_ce+reformulate:inv_rms_norm+codec:int8"]
    assert reformed.bytes < by_label["codec:int8"].bytes < raw
    assert both.bytes < reformed.bytes and set(both.sites) == {
        "norm:inv_rms_norm#0",
        "lm_head:chunked_ce#0",
    }
    assert reformed.grad_err < 1e-9 and not reformed.keeps  # exact
    assert 0 < both.grad_err < 2e-3
    reference = _loss_and_grads(model)
    for option in options[1:]:
        twin = copy.deepcopy(model)
        changes = install_root(twin, option)
        assert _root_bytes(twin) == option.bytes
        if option is reformed:
            loss, grads = _loss_and_grads(twin)
            assert torch.allclose(loss, reference[0], rtol=1e-5, atol=1e-6)
            for g, r in zip(grads, reference[1]):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
        changes[0].undo()
        assert _root_bytes(twin) == raw


def _loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    loss = model(X[:, :-1], targets=X[:, 1:]).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_root_reforms_leave_out_a_head_the_chunked_loss_cannot_replace(soft_capped_llama):
    """chunked-ce's probe refuses the soft-capped head, so no option reformulates it (a
    reformulated option would train on another loss); the norm is still inverted."""
    model = soft_capped_llama()
    ids, t = X[:, :-1], X[:, 1:]
    assert root_reforms(model, ids.device) == (("norm", "invnorm:rms"),)
    options = profile_root(model, ids, t, _root_bytes(model), ("none",), repeats=1)
    assert [o.label for o in options] == ["keep", "reformulate:inv_rms_norm"]
    assert options[1].grad_err < 1e-9 and options[1].bytes < options[0].bytes


GRID = [(1.0, "none", 1000, 1.0), (1.0, "int8", 300, 1.05), (0.0, "int8", 40, 1.35)]


def _profile(roots):
    stats = [OptionStat(BlockChoice(b, c), n, s) for b, c, n, s in GRID]
    return CompiledProfile(
        blocks={"k": [f"layers.{i}" for i in range(4)]},
        options={"k": stats},
        baseline_bytes=500 + 4 * 1200,
        root_bytes=500,
        static_bytes=0,
        batch=(1, 8),
        profile_time_s=0.0,
        load=(None, None),
        root_options=roots,
    )


@pytest.mark.parametrize("share", [0.5, 0.3, 0.15, 0.1, 0.06])
def test_solver_picks_the_root_option_jointly(share):
    roots = [RootOption("none", 500), RootOption("int8", 140, 0.02, 1e-4, ("norm:mul#0",))]
    prof = _profile(roots)
    allowed = int(prof.baseline_bytes * share)
    feasible = [
        (r.seconds + sum(n * s.seconds for n, s in zip(ns, prof.options["k"])), r.codec)
        for r in roots
        for ns in itertools.product(range(5), repeat=len(GRID))
        if sum(ns) == 4
        and r.bytes + sum(n * s.bytes for n, s in zip(ns, prof.options["k"])) <= allowed
    ]
    if not feasible:
        with pytest.raises(ValueError, match="raise the budget"):
            solve_compiled(prof, f"{share * 100:g}%")
        return
    plan = solve_compiled(prof, f"{share * 100:g}%", time_tolerance=0.0)  # the fastest plan
    assert plan.predicted_bytes <= allowed
    assert plan.predicted_seconds == pytest.approx(min(feasible)[0])
    assert plan.rows()[-1]["block"] == "(root)"
    assert (plan.root.codec if plan.root else "none") in {
        c for t, c in feasible if t == min(feasible)[0]
    }


def test_root_option_over_the_gradient_cap_is_not_a_candidate():
    roots = [RootOption("none", 500), RootOption("int8", 140, 0.0, 1e-2, ("norm:mul#0",))]
    prof = _profile(roots)
    assert solve_compiled(prof, "30%", max_grad_err=None).root is not None
    assert solve_compiled(prof, "30%").root is None


def test_root_reforms_on_a_hugging_face_causal_lm(tiny_causal_lm):
    """HF Llama: ``labels`` (shifted inside, as its loss does), the head found by
    get_output_embeddings, the final norm by what it computes; the reformulated root keeps
    fewer bytes and gives the model's loss and gradients."""
    model = tiny_causal_lm("llama", vocab=512, layers=2, max_pos=64)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    found = dict(root_reforms(model, ids.device))
    assert found == {"lm_head": "chunked-ce", "model.norm": "invnorm:rms"}
    with slimact.measure(model) as m:
        model(ids, labels=labels)
    raw = m.report.per_block["(outside blocks)"]
    options = profile_root(model, ids, labels, raw, ("none",), repeats=1)
    (reformed,) = options[1:]
    assert dict(reformed.reform) == found and reformed.bytes < raw
    assert reformed.grad_err < 1e-9

    def loss_and_grads(mdl):
        mdl.zero_grad(set_to_none=True)
        loss = mdl(ids, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in mdl.parameters()]

    ref = loss_and_grads(model)
    twin = copy.deepcopy(model)
    install_root(twin, reformed)
    with warnings.catch_warnings():  # a plan that recomputes nothing leaves use_cache alone
        warnings.simplefilter("error", UserWarning)
        got = loss_and_grads(twin)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for g, r in zip(got[1], ref[1]):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
