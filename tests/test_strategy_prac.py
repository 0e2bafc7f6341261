"""The ``prac`` / ``pac`` / ``rac`` strategies on the reference models: which sites are compressed,
sharing, memory, gradients, clock, checkpoints, composition and bad input."""

from __future__ import annotations

import io

import pytest
import torch

import slimact
from slimact.models import build_model
from slimact.strategies import applied, revert, strategy_names
from slimact.strategies.prac import (
    PacConfig,
    PracConfig,
    RacConfig,
    load_prac_state_dict,
    prac_report,
    prac_state,
    prac_state_dict,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: 1 thread is faster


def model_and_batch(name="llama-tiny", strategy=None, b=4, s=64, seed=0, dtype=None):
    torch.manual_seed(seed)
    model = build_model(name, dtype=dtype)
    if strategy is not None:
        slimact.apply(model, strategy)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (b, s), generator=g)
    return model, x


def step(model, x):
    model.zero_grad(set_to_none=True)
    with slimact.measure(model, n_tokens=x.numel()) as m:
        out = model(x, targets=x)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return m.report, out.loss.detach(), grads


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_strategies_are_registered():
    assert {"prac", "pac", "rac"} <= set(strategy_names())


def test_which_sites_are_compressed_and_shared_on_llama():
    model, x = model_and_batch(strategy="prac")
    report, _, _ = step(model, x)
    by = {s.site: s for s in report.sites}
    for site in (
        "layers.0.input_layernorm:rms_norm#0",  # norm input x (the fused norm saves x, rstd)
        "layers.0.self_attn.q_proj:linear#0",
        "layers.0.mlp.gate_proj:linear#0",
        "layers.0.mlp.act_fn:silu#0",
        "layers.0.mlp:mul#0",
        "layers.0.mlp.down_proj:linear#0",
        "lm_head:linear#0",
    ):
        assert by[site].action.startswith("codec:prac"), site
    for site in by:  # attention internals and per-row statistics are never compressed
        if "scaled_dot_product_attention" in site:
            assert by[site].action == "keep", site
        elif "rms_norm#1" in site:  # rstd, saved as is by the reformulated (fused) norm
            assert by[site].action == "reformulate:rms_norm", site
    rep = prac_report(model)
    assert rep["compressed"]["layers.0.self_attn.q_proj:linear#0"]["sites"] == [
        "layers.0.self_attn.q_proj:linear#0",
        "layers.0.self_attn.k_proj:linear#0",
        "layers.0.self_attn.v_proj:linear#0",
    ]
    assert (
        "layers.0.mlp.up_proj:linear#0"
        in (rep["compressed"]["layers.0.mlp.gate_proj:linear#0"]["sites"])
    )
    assert "layers.0.self_attn.k_proj:linear#0" not in rep["compressed"]  # one state per group
    assert "scaled_dot_product_attention#4" in rep["skipped"]["layers.0.self_attn.o_proj:linear#0"]
    assert "too small" in rep["skipped"]["layers.0.input_layernorm:rms_norm#1"]  # rstd
    g = rep["compressed"]["layers.0.self_attn.q_proj:linear#0"]
    assert g["ranks"] == (19, 19) and g["k"] == pytest.approx((64 - 19) / 19)  # ⌊0.3·64⌋
    assert rep["compressed"]["layers.0.mlp.act_fn:silu#0"]["ranks"] == (34, 34)  # ⌊0.2·172⌋


def test_unfused_norms_compress_both_x_and_xhat():
    """fuse_norms=False keeps the op-by-op RMSNorm, whose x and x̂ are two compressed saves."""
    fused, x = model_and_batch(strategy="prac")
    plain, _ = model_and_batch(strategy=PracConfig(fuse_norms=False))
    r_fused, _, g_fused = step(fused, x)
    r_plain, _, _ = step(plain, x)
    by = {s.site: s.action for s in r_plain.sites}
    assert by["layers.0.input_layernorm:pow#0"].startswith("codec:prac")  # x
    assert by["layers.0.input_layernorm:mul#2"].startswith("codec:prac")  # x̂
    assert not any(":rms_norm#" in s for s in by)
    assert r_fused.total_bytes < r_plain.total_bytes
    assert all(torch.isfinite(g).all() for g in g_fused.values())
    revert(fused)
    assert "forward" not in fused.layers[0].input_layernorm.__dict__


@pytest.fixture(scope="module")
def runs():
    """Baseline and the three strategies on one batch: (report, loss, grads) each."""
    torch.set_num_threads(1)
    out = {}
    for strategy in (None, "prac", "pac", "rac"):
        model, x = model_and_batch(strategy=strategy)
        out[strategy or "none"] = step(model, x)
    return out


def flat(grads):
    return torch.cat([v.flatten() for v in grads.values()])


@pytest.mark.parametrize("strategy", ["prac", "pac", "rac"])
def test_forward_is_exact_and_gradients_are_close(runs, strategy):
    rb, lb, gb = runs["none"]
    r, loss, g = runs[strategy]
    assert torch.equal(loss, lb)  # PRAC changes only what backward sees
    assert all(torch.isfinite(v).all() for v in g.values())
    assert any(s.action.startswith(f"codec:{strategy}") for s in r.sites)
    # one draw on llama-tiny, 256 tokens: pac 0.97 (biased, no noise), prac 0.87, rac 0.84
    assert cosine(flat(g), flat(gb)) > 0.75
    assert r.total_bytes < rb.total_bytes


def test_prac_gradient_is_closer_than_rac_at_equal_rank(runs):
    """The principal part removes the large singular values from RAC's variance (Thm 15 vs 16)."""
    gb = flat(runs["none"][2])
    assert cosine(flat(runs["prac"][2]), gb) > cosine(flat(runs["rac"][2]), gb)


def test_memory_ratio_at_many_tokens_and_projection_overhead_at_few():
    """Z costs tokens·(r1+r2), P costs n·(r1+r2): PRAC pays off when tokens ≫ n."""
    ratios = {}
    for b, s in ((1, 32), (16, 256)):
        base, x = model_and_batch(b=b, s=s)
        model, _ = model_and_batch(strategy="prac", b=b, s=s)
        with torch.no_grad():
            pass
        with slimact.measure(base) as mb:
            base(x, targets=x)
        with slimact.measure(model) as m:
            model(x, targets=x)
        ratios[b * s] = m.report.total_bytes / mb.report.total_bytes
    assert ratios[4096] < 0.7 < ratios[32]


def test_bfloat16_and_gpt2_run_with_finite_gradients():
    model, x = model_and_batch(strategy="prac", dtype=torch.bfloat16)
    _, loss, g = step(model, x)
    assert torch.isfinite(loss) and all(torch.isfinite(v.float()).all() for v in g.values())
    gpt, x = model_and_batch("gpt2-tiny", strategy=PracConfig(only_if_smaller=False))
    r, _, g = step(gpt, x)
    by = {s.site: s.action for s in r.sites}
    assert by["h.0.ln_1:layer_norm#0"].startswith("codec:prac") and by[
        "h.0.mlp.act:gelu#0"
    ].startswith("codec:prac")
    assert by["h.0.attn.c_attn:linear#0"].startswith("codec:prac") and by[
        "h.0.mlp.c_proj:linear#0"
    ].startswith("codec:prac")
    assert all(torch.isfinite(v).all() for v in g.values())


def test_clock_counts_training_forwards_and_lazy_updates_follow_it():
    model, x = model_and_batch(strategy=PracConfig(t1=2, t2=2, only_if_smaller=False), b=2, s=16)
    for _ in range(5):
        model(x, targets=x).loss.backward()
        with torch.no_grad():
            model(x)  # evaluation: no saves, the clock does not move
    state = prac_state(model)
    assert state.forwards == 5
    c = state.codecs["layers.0.self_attn.q_proj:linear#0"]
    assert c.updates["q1"] == 3 and c.updates["q2"] == 3  # steps 0, 2, 4


def test_state_dict_round_trip_reproduces_gradients():
    cfg = PracConfig(t1=3, t2=1, seed=7)
    a, x = model_and_batch(strategy=cfg, b=2, s=32)
    for _ in range(2):
        step(a, x)
    buf = io.BytesIO()
    torch.save(prac_state_dict(a), buf)
    buf.seek(0)
    b, _ = model_and_batch(strategy=cfg, b=2, s=32)
    b.load_state_dict(a.state_dict())
    load_prac_state_dict(b, torch.load(buf, weights_only=True))
    for _ in range(3):
        _, _, ga = step(a, x)
        _, _, gb = step(b, x)
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n


def test_apply_reports_small_sites_and_revert_restores():
    model, x = model_and_batch(
        strategy=PracConfig(min_features=100, only_if_smaller=False), b=2, s=16
    )
    changes = applied(model)
    assert any(c.skipped and "too small" in c.detail for c in changes)
    r, _, _ = step(model, x)
    acts = {s.site: s.action for s in r.sites}
    assert acts["layers.0.self_attn.q_proj:linear#0"] == "keep"  # n = 64 < 100
    assert acts["layers.0.mlp.down_proj:linear#0"].startswith("codec:prac")  # n = 172
    assert "too small" in prac_report(model)["skipped"]["layers.0.self_attn.q_proj:linear#0"]
    with pytest.raises(ValueError, match=r"\(prac\) is already .* sites of every module"):
        slimact.apply(model, "rac")
    revert(model)
    r, _, _ = step(model, x)
    assert {s.action for s in r.sites} == {"keep"}
    with pytest.raises(ValueError, match="no PRAC-family strategy"):
        prac_report(model)


def test_overrides_keep_and_filter_fn():
    cfg = PracConfig(overrides=(("*down_proj*", 8, 4),), keep=("lm_head*",))
    model, x = model_and_batch(b=2, s=16)
    slimact.apply(model, cfg, filter_fn=lambda m, p: not p.startswith("layers.1"))
    r, _, _ = step(model, x)
    acts = {s.site: s.action for s in r.sites}
    rep = prac_report(model)
    assert rep["compressed"]["layers.0.mlp.down_proj:linear#0"]["ranks"] == (8, 4)
    assert (
        acts["lm_head:linear#0"] == "keep" and "keep pattern" in rep["skipped"]["lm_head:linear#0"]
    )
    assert acts["layers.1.mlp.down_proj:linear#0"] == "keep"
    assert "filter_fn" in rep["skipped"]["layers.1.mlp.down_proj:linear#0"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"linear": (0.7, 0.4)}, "must be < 1"),
        ({"linear": (-0.1, 0.3)}, "must be >= 0"),
        ({"nonlinear": (0, 0)}, "both 0"),
        ({"linear": (0.3,)}, "pair"),
        ({"svd": "power"}, "svd must be one of"),
        ({"t2": 0}, "t2"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PracConfig(**kwargs)


def test_variant_invariants_and_absolute_override_beyond_n():
    with pytest.raises(ValueError, match="r2 must be 0"):
        PacConfig(linear=(0.3, 0.3))
    with pytest.raises(ValueError, match="r1 must be 0"):
        RacConfig(overrides=(("*", 2, 2),))
    model, _ = model_and_batch(strategy=PracConfig(overrides=(("*q_proj*", 40, 30),)), b=2, s=8)
    state = prac_state(model)  # the policy asks this on the site's first save
    with pytest.raises(ValueError, match=r"q_proj.*n=64.*r1 \+ r2 <= 63"):
        state.codec_for("layers.0.self_attn.q_proj:linear#0", torch.randn(16, 64))


def test_composes_with_recompute():
    base, x = model_and_batch(b=2, s=32)
    rec, _ = model_and_batch(strategy="recompute", b=2, s=32)
    both, _ = model_and_batch(strategy="prac+recompute", b=2, s=32)
    _, _, gb = step(base, x)
    r_rec, _, _ = step(rec, x)
    r_both, _, g = step(both, x)
    assert r_both.total_bytes < r_rec.total_bytes  # final norm / lm_head input compressed too
    assert not any(
        s.action.startswith("codec:") for s in r_both.sites if s.block
    )  # checkpoint wins in blocks
    assert r_both.block_bytes == r_rec.block_bytes
    # the final norm's backward runs at X̃, so every upstream gradient sees some noise
    assert cosine(g["layers.0.mlp.up_proj.weight"], gb["layers.0.mlp.up_proj.weight"]) > 0.8
    # checkpoint block 1 only, PRAC the rest
    part, _ = model_and_batch(b=2, s=32)
    slimact.apply(part, "recompute", filter_fn=lambda m, p: p == "layers.1")
    slimact.apply(part, PracConfig(only_if_smaller=False))
    r, _, g = step(part, x)
    acts = {s.site: s.action for s in r.sites}
    assert acts["layers.0.mlp.down_proj:linear#0"].startswith("codec:prac")
    assert acts["layers.1:checkpoint_input#0"] == "keep"
    assert all(torch.isfinite(v).all() for v in g.values())


@pytest.mark.skipif("invact" not in strategy_names(), reason="invact strategy not registered")
def test_composes_with_invact_mask_kept_output_compressed():
    base, x = model_and_batch(b=8, s=128)  # tokens ≫ n, or the projections outweigh the saving
    inv, _ = model_and_batch(strategy="invact", b=8, s=128)
    model, _ = model_and_batch(strategy="invact+prac", b=8, s=128)
    _, _, gb = step(base, x)
    r_inv, _, _ = step(inv, x)
    r, loss, g = step(model, x)
    by = {s.site: s for s in r.sites}
    act_sites = [s for s in r.sites if s.module == "layers.0.mlp.act_fn"]
    assert {s.dtype for s in act_sites if s.action == "reformulate:inv_silu"} == {"uint8"}  # mask
    assert any(
        s.action.startswith("codec:prac") and s.dtype == "float32" for s in act_sites
    )  # the output y
    assert by["layers.0.self_attn.q_proj:linear#0"].action.startswith("codec:prac")
    rep = prac_report(model)["compressed"]
    norm_out = [k for k in rep if k.startswith("layers.0.input_layernorm:inv_")]
    assert norm_out and rep[norm_out[0]]["ranks"] == (19, 19)  # linear ranks for y
    assert r.total_bytes < r_inv.total_bytes
    assert all(torch.isfinite(v).all() for v in g.values())


def test_spec_strings_set_update_intervals_and_reject_unknown_keys():
    from slimact.strategies import resolve

    (cfg,) = resolve("prac@t1=20,t2=1,svd=randomized")
    assert cfg == PracConfig(t1=20, t2=1, svd="randomized")
    (pac,) = resolve("pac@t1=7,only_if_smaller=false")
    assert pac == PacConfig(t1=7, only_if_smaller=False)
    inv, prac = resolve("invact+prac@t2=1")
    assert prac == PracConfig(t2=1)
    with pytest.raises(ValueError, match="key one of t1, t2"):
        resolve("prac@r1=3")
    with pytest.raises(ValueError, match="t1 must be int, got 'x'"):
        resolve("prac@t1=x")
    with pytest.raises(ValueError, match="t1 .* >= 1"):
        resolve("prac@t1=0")
