"""The profiler: storages add up to the meter's total, codec figures are real, nothing leaks."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import slimact
from slimact.codecs import get_codec
from slimact.planner.plan import ROOT, Profile
from slimact.planner.profile import (
    cache_path,
    cached_profile,
    profile_key,
    profile_model,
    static_memory,
)

CODECS = ("int4", "int8", "int4-outlier", "bits")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, x, profile_model(model, x, codecs=CODECS, repeats=1)


def test_storages_add_up_to_the_meter(tiny):
    model, x, prof = tiny
    with slimact.measure(model) as m:
        model(x, targets=x)
    assert prof.baseline_bytes == m.report.total_bytes
    total = sum(s.bytes * len(k.blocks) for k in prof.kinds for s in k.storages if s.sites)
    assert total == m.report.total_bytes
    block = next(k for k in prof.kinds if k.kind != ROOT)
    assert block.blocks == ["layers.0", "layers.1"]
    names = {s.name for s in block.storages}
    assert "self_attn.q_proj:linear#0" in names and "mlp.act_fn:silu#0" in names
    qkv = next(s for s in block.storages if s.name == "self_attn.q_proj:linear#0")
    assert {"self_attn.k_proj:linear#0", "self_attn.v_proj:linear#0"} <= set(qkv.sites)


def test_modules_reforms_and_codecs_are_measured(tiny):
    model, x, prof = tiny
    block = next(k for k in prof.kinds if k.kind != ROOT)
    mods = {m.path: m for m in block.modules}
    assert {"", "self_attn", "mlp", "input_layernorm"} <= set(mods)
    assert "mlp.act_fn" not in mods  # recomputing SiLU alone frees nothing: its input is held
    assert all(m.recompute_s > 0 for m in mods.values())
    assert mods["mlp"].flops == 3 * 2 * 64 * 64 * 172  # three GEMMs of B*S x d x d_ff
    gate = next(s.id for s in block.storages if s.name == "mlp.gate_proj:linear#0")
    assert mods["mlp"].inputs == [gate]
    ref = {r.path: r for r in block.reforms}
    silu = ref["mlp.act_fn"]
    assert silu.silenced == ["mlp.act_fn:silu#0"]
    assert silu.extra_bytes == 2 * 32 * 172 // 8  # the 1-bit mask, measured
    norm = ref["input_layernorm"]
    q = next(s.id for s in block.storages if s.name == "self_attn.q_proj:linear#0")
    assert norm.added == [q] and norm.extra_bytes == 2 * 32 * 4  # saves y (shared) + rstd
    s = next(s for s in block.storages if s.name == "mlp:mul#0")
    t = torch.randn(s.shape)
    for c in ("int4", "int8"):
        st = s.codecs[c]
        assert st.bytes == get_codec(c).nbytes(get_codec(c).encode(t))
        assert 0 < st.rel_err < (0.3 if c == "int4" else 0.02)
        assert st.encode_s > 0 and st.decode_s >= 0
    assert "bits" not in s.codecs  # floats are not {0, 1}: the codec does not apply
    lse = next(s for s in block.storages if s.name.endswith("attention#3"))
    assert lse.lossy_ok is False and not lse.codecs  # logsumexp: exact only, and tiny


def test_per_block_rows_and_outliers(tiny):
    _, _, prof = tiny
    block = next(k for k in prof.kinds if k.kind != ROOT)
    assert set(block.per_block) == {"layers.0", "layers.1"}
    for b in block.blocks:
        for sid, row in block.per_block[b].items():
            s = block.storages[int(sid)]
            assert row["raw"] == s.bytes
            if "int4-outlier" in s.codecs:
                assert row["int4-outlier"] >= row["int4"] - 8 * 4  # outliers only add
                assert row["outliers"] >= 0


def test_static_memory_and_side_effects(tiny):
    model, x, prof = tiny
    n = sum(p.numel() for p in model.parameters())
    assert prof.static["params"] == prof.static["grads"] == 4 * n
    assert prof.static["optimizer"] == 2 * 4 * n + 4 * len(list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    state = torch.get_rng_state()
    profile_model(model, x, codecs=("int8",), repeats=1, reform=False, per_block=False)
    assert torch.equal(state, torch.get_rng_state())
    assert all("forward" not in m.__dict__ for m in model.modules())  # invact probes undone
    assert static_memory(model)["total"] == prof.static["total"]


def test_cache_roundtrip(tmp_path, tiny):
    model, x, _ = tiny
    kw = dict(codecs=("int8",), repeats=1, reform=False, per_block=False)
    a = cached_profile(model, x, cache_dir=tmp_path, name="tiny", **kw)
    b = cached_profile(model, x, cache_dir=tmp_path, name="tiny", **kw)
    assert a.meta["cache_hit"] is False and b.meta["cache_hit"] is True
    assert Profile.load(a.meta["cache"]).baseline_bytes == a.baseline_bytes
    assert b.kinds[0].storages[3].codecs["int8"] == a.kinds[0].storages[3].codecs["int8"]
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.mul_(1.0001)  # other weights: another cache entry
    c = cached_profile(model, x, cache_dir=tmp_path, name="tiny", **kw)
    assert c.meta["cache_hit"] is False


def _key(model, x, targets=None, **kw):
    return json.dumps(profile_key(model, x, targets, name="m", **kw), sort_keys=True)


def test_cache_key_covers_everything_that_changes_the_saves(monkeypatch):
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 32))
    kw = dict(codecs=("int8",), repeats=1, reform=False)
    base = _key(model, x, **kw)
    assert _key(model, x, **kw) == base  # deterministic
    variants = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        variants["autocast bf16"] = _key(model, x, **kw)
    with torch.autocast("cpu", dtype=torch.float16):
        variants["autocast fp16"] = _key(model, x, **kw)
    variants["batch"] = _key(model, x[:1], **kw)
    variants["seq"] = _key(model, x[:, :16], **kw)
    variants["targets"] = _key(model, x, x[:, :16], **kw)
    variants["codecs"] = _key(model, x, **{**kw, "codecs": ("int4",)})
    variants["reform (actions)"] = _key(model, x, **{**kw, "reform": True})
    variants["eval mode"] = _key(model.eval(), x, **kw)
    model.train()
    other = slimact.build_model("gpt2-tiny")
    variants["structure"] = _key(other, x, **kw)
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    variants["weights"] = _key(model, x, **kw)
    variants["dtype"] = _key(model.to(torch.bfloat16), x, **kw)
    model.float()
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    variants["torch version"] = _key(model, x, **kw)
    for what, key in variants.items():
        assert key != base, f"changing the {what} keeps the cache key"
    assert len(set(variants.values())) == len(variants)


def test_unwritable_cache_falls_back_with_one_warning(tmp_path):
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (1, 8))
    kw = dict(codecs=("int8",), repeats=1, reform=False, per_block=False)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where the cache directory should be: even root cannot write
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        for cache in (blocker / "profiles", ro):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                a = cached_profile(model, x, cache_dir=cache, name="t", **kw)
                b = cached_profile(model, x[:, :4], cache_dir=cache, name="t", **kw)
            msgs = [str(w.message) for w in caught if "not writable" in str(w.message)]
            if cache == ro and os.access(ro, os.W_OK):  # root ignores the mode bits
                continue
            assert len(msgs) == 1 and str(cache) in msgs[0]
            assert a.meta["cache"] is None and b.meta["cache_hit"] is False
            assert a.baseline_bytes > b.baseline_bytes > 0
    finally:
        ro.chmod(0o700)


def test_corrupt_cache_entry_is_profiled_again(tmp_path):
    torch.manual_seed(0)
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (1, 8))
    kw = dict(codecs=("int8",), repeats=1, reform=False, per_block=False)
    path = cache_path(tmp_path, profile_key(model, x, name="t", **kw))
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable profile cache"):
        prof = cached_profile(model, x, cache_dir=tmp_path, name="t", **kw)
    assert prof.meta["cache_hit"] is False and Profile.load(path).baseline_bytes > 0


def test_gpt2_profile():
    torch.manual_seed(0)
    model = slimact.build_model("gpt2-tiny")
    x = torch.randint(0, 257, (2, 32))
    prof = profile_model(model, x, codecs=("int4",), repeats=1, per_block=False)
    block = next(k for k in prof.kinds if k.kind != ROOT)
    assert {r.kind for r in block.reforms} == {"invact:gelu_tanh", "invnorm:layer"}
    assert sum(s.bytes * len(k.blocks) for k in prof.kinds for s in k.storages if s.sites) == (
        prof.baseline_bytes
    )


def test_bad_arguments():
    model = slimact.build_model("llama-tiny")
    x = torch.randint(0, 257, (1, 8))
    with pytest.raises(ValueError, match="unknown codec"):
        profile_model(model, x, codecs=("int3",))
    with pytest.raises(ValueError, match="repeats"):
        profile_model(model, x, repeats=0)


def test_inputs_of_modules_with_extreme_weights_stay_exact():
    """A recomputation from a lossy copy multiplies the copy's error by the module's weights
    (issue 14.4: a 1e20 weight gave gradient cosine 0.13), so such inputs are lossless."""
    torch.manual_seed(0)
    x = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(0))

    def mlp_input_lossy(model) -> bool:
        prof = profile_model(model, x[:, :-1], x[:, 1:], codecs=["int8"], repeats=1, reform=False)
        kind = prof.kinds[0]
        (mlp,) = [m for m in kind.modules if m.path == "mlp"]
        return all(kind.storages[sid].lossy_ok for sid in mlp.inputs)

    model = slimact.build_model("llama-tiny")
    assert mlp_input_lossy(model)
    with torch.no_grad():
        model.layers[0].mlp.gate_proj.weight[3, 5] = 1e20
    assert not mlp_input_lossy(model)
