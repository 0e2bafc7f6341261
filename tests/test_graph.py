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
    """compile=True takes none, invact and chunked-ce into the one graph by itself; recompute
    and the codecs keep the per-block path (their one graph peaks higher: planner.graph.DEFAULT)
    and lower as one graph when ``+graph`` is written."""
    assert graph_form("none") == "graph"
    assert graph_form("invact+chunked-ce") == "invact+chunked-ce+graph"
    assert graph_form("chunked-ce@256") == "chunked-ce@256+graph"
    for spec in (
        "recompute", "invact+recompute", "int8", "int8+recompute", "int4", "int8@sr",
        "int8+int4", "auto@25%", "prac", "compiled-none", "offload",
    ):  # fmt: skip
        assert graph_form(spec) is None, spec  # the per-block path
    assert compile_form("int8") == "compiled-int8"
    assert compile_form("recompute") == "compiled-recompute"
    assert compile_form("invact") == "invact+graph"


def _one_graph(base, spec: str):
    """``spec`` as the one graph: by compile=True where it takes it, else written ``+graph``."""
    if graph_form(spec) is not None:
        return slimact.apply(copy.deepcopy(base), spec, compile=True)
    return slimact.apply(copy.deepcopy(base), f"{spec}+graph")


def test_count_per_block_path():
    """Today's per-block path: the root runs eager between two compiled blocks."""
    ids, tgt = _batch()
    for spec in ("compiled-none", "compiled-int8"):
        model = slimact.apply(slimact.build_model("llama-tiny"), spec)
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
    model = _one_graph(base, spec)
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
        model = _one_graph(base, spec)
        with slimact.measure(model) as m:
            model(ids, targets=tgt).loss.backward()
        saved[spec] = m.report.total_bytes
    assert 0 < saved["recompute"] < saved["none"] / 2, saved


@pytest.mark.parametrize(
    "spec, cos", [("int8+graph", 0.999), ("int8+recompute+graph", 0.999), ("int4+graph", 0.985)]
)
def test_one_graph_with_a_traced_codec(spec, cos):
    """A codec spec written ``+graph`` runs as the one graph (compile=True keeps it per block):
    every save through the traced pack/unpack pair, recompute as selective-checkpoint regions.
    Lossy: INT8 >= 0.999 here; INT4 (groups of 32, SDPA's q/k exact, its v and output INT8) as
    the per-block compiled-int4 on this model."""
    ids, tgt = _batch()
    base = slimact.build_model("llama-tiny")
    ref = _grads(copy.deepcopy(base), ids, tgt)
    model = slimact.apply(copy.deepcopy(base), spec)
    assert applied_strategies(model) == [*spec.removesuffix("+graph").split("+"), "graph"]
    n = count_step(model, ids, tgt)
    assert (n.forward_graphs, n.backward_graphs) == (1, 1), n
    assert n.eager_ops <= 5, n
    assert _min_cos(_grads(model, ids, tgt), ref) >= cos
    saved = {}
    for s, m in (("none", slimact.apply(copy.deepcopy(base), "none", compile=True)), (spec, model)):
        with slimact.measure(m) as meter:
            m(ids, targets=tgt).loss.backward()
        saved[s] = meter.report.total_bytes
    assert 0 < saved[spec] < saved["none"] / 2, saved
    slimact.revert(model)
    assert "forward" not in model.__dict__


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
    model = slimact.apply(slimact.build_model("llama-tiny"), "invact", compile=True)
    fwd = model.__dict__["forward"]
    slimact.apply(model, "invact", compile=True)
    assert model.__dict__["forward"] is fwd
    with pytest.raises(ValueError, match="already one graph"):
        slimact.apply(model, "chunked-ce", compile=True)


def test_site_codecs_pick_each_save_by_its_modules():
    """A saved node's codec: the widest of its own module's and its readers' (``compiled.
    site_codecs``); a forward override's ``.forward.module`` is no part of the path."""
    from slimact.compiled.site_codecs import SiteCodecs, traced_label
    from slimact.planner.graph import site_table
    from slimact.planner.plan import LayerPlan, Plan

    model = slimact.build_model("llama-tiny")
    codecs = SiteCodecs.of(model, {"layers.0.mlp.up_proj": "int4", "layers.0.mlp": "int8"})
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    b = g.call_function(torch.neg, (a,))
    c = g.call_function(torch.neg, (x,))
    g.output((b, c))
    stack = "L['inner'].args[0].layers.0.forward.module.mlp{}"
    a.meta["nn_module_stack"] = {"k": (stack.format(".up_proj"), None)}
    b.meta["nn_module_stack"] = {"k": (stack.format(""), None)}
    c.meta["nn_module_stack"] = {"k": ("L['inner'].args[0].norm", None)}
    assert codecs.module_of(a) == "layers.0.mlp.up_proj"
    assert codecs.codec_for(a).bits == 8  # up_proj INT4, read in mlp (INT8): the wider
    assert codecs.codec_for(b).bits == 8
    assert codecs.codec_for(c).identity and codecs.codec_for(None).identity
    assert [traced_label(x) for x in ("int8-asym", "bits", "int4-outlier-g16", "prac")] == [
        "int8", "int8", "int4-outlier", None,
    ]  # fmt: skip
    plan = Plan(
        layers=(
            LayerPlan("layers.1", "block", codecs=(("int4", ("mlp.act_fn:silu#0",)),
                                                   ("int8", ("mlp:mul#0",)), ("offload", ("mlp:mul#1",)))),
        )
    )  # fmt: skip
    assert site_table(plan) == (
        {"layers.1.mlp.act_fn": "int4", "layers.1.mlp": "int8"},
        ["offload"],
    )


@pytest.mark.slow  # ~40 s: auto profiles and solves on the first batch, then one compile
def test_one_graph_auto_lowers_its_site_codecs():
    """``auto@25%+graph`` (compile=True keeps ``compiled-auto``): solved on the first training
    batch, lowered as one graph with its recompute regions and its per-site codecs per module."""
    ids, tgt = _batch()
    base = slimact.build_model("llama-tiny")
    ref = _grads(copy.deepcopy(base), ids, tgt)
    none = slimact.apply(copy.deepcopy(base), "none", compile=True)
    model = slimact.apply(copy.deepcopy(base), "auto@25%,cache=none+graph")
    assert applied_strategies(model)[-1] == "graph"
    n = count_step(model, ids, tgt)
    assert (n.forward_graphs, n.backward_graphs) == (1, 1), n
    assert n.eager_ops <= 5, n
    assert any(c.action in ("codec", "recompute") for c in slimact.applied(model))
    assert _min_cos(_grads(model, ids, tgt), ref) >= 0.99
    saved = []
    for m in (none, model):
        with slimact.measure(m) as meter:
            m(ids, targets=tgt).loss.backward()
        saved.append(meter.report.total_bytes)
    assert 0 < saved[1] < saved[0], saved
    slimact.revert(model)
    assert "forward" not in model.__dict__
