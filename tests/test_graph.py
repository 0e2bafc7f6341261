"""compile=True as one graph (``planner/graph.py``, strategy ``graph``) and the count of what a
step runs outside compiled graphs (``compiled/outside.py``)."""

import copy

import pytest
import torch

import slimact
from slimact.compiled.outside import count_step
from slimact.planner.graph import graph_form
from slimact.registry import applied_strategies, compile_form

V = 256


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (2, 16), generator=g), torch.randint(0, V, (2, 16), generator=g)


def _grads(model, ids, tgt, label="targets"):
    model.zero_grad(set_to_none=True)
    model(ids, **{label: tgt}).loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _min_cos(a, b):
    return min(
        torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), 0).item()
        for x, y in zip(a, b)
    )


def test_graph_form_decides_in_one_place():
    assert graph_form("none") == "graph"
    assert graph_form("invact+recompute") == "invact+recompute+graph"
    assert graph_form("chunked-ce@256") == "chunked-ce@256+graph"
    for spec in ("int8", "int4", "auto@25%", "invact+int8", "compiled-none", "offload"):
        assert graph_form(spec) is None, spec  # the per-block fallback
    assert compile_form("int8") == "compiled-int8"
    assert compile_form("recompute") == "recompute+graph"


def test_count_per_block_path():
    """Today's per-block path: the root runs eager between two compiled blocks."""
    ids, tgt = _batch()
    for spec in ("compiled-none", "int8"):
        model = slimact.apply(slimact.build_model("llama-tiny"), spec, compile=True)
        n = count_step(model, ids, tgt)
        assert n.forward_graphs == 2 and n.backward_graphs == 2, (spec, n)
        assert n.regions == 2
        assert n.eager_ops > 5, (spec, n)  # embedding, final norm, head, loss, wrappers
    eager = count_step(slimact.build_model("llama-tiny"), ids, tgt)
    assert eager.graphs == 0 and eager.eager_ops > 100


@pytest.mark.parametrize("spec", ["none", "recompute", "invact", "chunked-ce"])
def test_one_graph_per_step(spec):
    ids, tgt = _batch()
    base = slimact.build_model("llama-tiny")
    ref = _grads(copy.deepcopy(base), ids, tgt)
    model = slimact.apply(copy.deepcopy(base), spec, compile=True)
    assert applied_strategies(model)[-1] == "graph"
    n = count_step(model, ids, tgt)
    assert (n.forward_graphs, n.backward_graphs) == (1, 1), n
    assert n.eager_ops <= 5, n
    assert _min_cos(_grads(model, ids, tgt), ref) >= 0.999
    with slimact.measure(model) as m:
        model(ids, targets=tgt).loss.backward()
    assert m.report.total_bytes > 0  # the graph's saves, at the root (its one region)
    assert {s.block for s in m.report.sites} == {""}
    slimact.revert(model)
    assert "forward" not in model.__dict__


def test_one_graph_recompute_saves_less_than_none():
    ids, tgt = _batch()
    base = slimact.build_model("llama-tiny")
    saved = {}
    for spec in ("none", "recompute"):
        model = slimact.apply(copy.deepcopy(base), spec, compile=True)
        with slimact.measure(model) as m:
            model(ids, targets=tgt).loss.backward()
        saved[spec] = m.report.total_bytes
    assert 0 < saved["recompute"] < saved["none"] / 2, saved


def test_graph_refused_part_by_part():
    model = slimact.build_model("llama-tiny")
    with pytest.raises(ValueError, match="one graph"):
        slimact.apply(model, "graph", lambda m, p: True)


@pytest.mark.slow
def test_hf_llama_keeps_the_per_block_path():
    """HF Llama graph-breaks inside the one graph's checkpoint regions (``planner.graph.
    one_graph_ok``): ``compile=True`` compiles it block by block, with exact gradients, and
    ``graph`` written by hand is refused, naming the per-block form."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = _grads(copy.deepcopy(base), ids, ids, "labels")
    model = slimact.apply(copy.deepcopy(base), "recompute", compile=True)
    assert "graph" not in applied_strategies(model)
    assert _min_cos(_grads(model, ids, ids, "labels"), ref) >= 0.999
    with pytest.raises(ValueError, match="Hugging Face model does not run as one graph"):
        slimact.apply(copy.deepcopy(base), "recompute+graph")


def test_graph_twice_is_a_repeat_and_another_is_refused():
    model = slimact.apply(slimact.build_model("llama-tiny"), "recompute", compile=True)
    fwd = model.__dict__["forward"]
    slimact.apply(model, "recompute", compile=True)
    assert model.__dict__["forward"] is fwd
    with pytest.raises(ValueError, match="already one graph"):
        slimact.apply(model, "invact", compile=True)
