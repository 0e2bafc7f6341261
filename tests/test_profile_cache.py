"""The profile cache serves a model only what was measured on a model that saves as it does: the
key covers the forwards other changes put on its modules (a recomputed block's checkpoint), and
a cached entry whose baseline is not what the model saves on the batch is profiled again."""

from __future__ import annotations

import json

import pytest
import torch

import slimact
from slimact.models import build_model
from slimact.planner.profile import cached_profile, profile_key, saved_bytes

IDS = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
FAST = {"codecs": ("int8",), "grads": False, "reform": False, "repeats": 1}


def fresh():
    """A new "process"'s model: built again from the same seed."""
    torch.manual_seed(0)
    return build_model("llama-tiny")


def test_a_profile_of_a_recomputing_model_is_not_served_to_the_plain_one(tmp_path):
    first = fresh()
    slimact.apply(first, "recompute")
    small = cached_profile(first, IDS, IDS, cache_dir=tmp_path, **FAST)
    assert small.meta["cache_hit"] is False
    plain = fresh()
    want = saved_bytes(plain, IDS, IDS)
    assert small.baseline_bytes < want  # recompute's checkpoints save only the blocks' inputs
    prof = cached_profile(plain, IDS, IDS, cache_dir=tmp_path, **FAST)
    assert prof.meta["cache_hit"] is False and prof.baseline_bytes == want
    again = cached_profile(fresh(), IDS, IDS, cache_dir=tmp_path, **FAST)  # a third process
    assert again.meta["cache_hit"] is True and again.baseline_bytes == want
    assert len(list(tmp_path.glob("*.json"))) == 2  # one entry per kind of model
    key, key_rc = profile_key(fresh(), IDS, IDS), profile_key(first, IDS, IDS)
    assert key["patches"] == [] and key_rc["patches"] and key != key_rc


def test_a_cached_entry_that_does_not_match_the_model_is_profiled_again(tmp_path):
    prof = cached_profile(fresh(), IDS, IDS, cache_dir=tmp_path, **FAST)
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    entry["baseline_bytes"] = prof.baseline_bytes // 4  # measured on some other model
    path.write_text(json.dumps(entry))
    with pytest.warns(RuntimeWarning, match="profiling again"):
        again = cached_profile(fresh(), IDS, IDS, cache_dir=tmp_path, **FAST)
    assert again.meta["cache_hit"] is False and again.baseline_bytes == prof.baseline_bytes
    assert json.loads(path.read_text())["baseline_bytes"] == prof.baseline_bytes  # rewritten
    hit = cached_profile(fresh(), IDS, IDS, cache_dir=tmp_path, **FAST)
    assert hit.meta["cache_hit"] is True


@pytest.mark.slow  # the tests above cover the key and the check; this is the reported sequence
def test_auto_plans_after_auto_with_recompute_on_the_same_cache(tmp_path):
    """The reported sequence: ``auto@<b>+recompute``, then plain ``auto@<b>`` on the same model
    and batch and cache: the second plans on its own profile (its budget is a share of the
    plain model's baseline) and its plan fits that budget."""
    from slimact.planner.auto import AutoConfig, plan_model

    cfg = AutoConfig(budget="50%", cache=str(tmp_path), codecs=("int8",))
    first = fresh()
    slimact.apply(first, "recompute")
    plan_model(first, cfg, IDS, IDS)
    plain = fresh()
    plan = plan_model(plain, cfg, IDS, IDS)
    base = saved_bytes(plain, IDS, IDS)
    assert plan.budget_bytes == pytest.approx(0.5 * base)
    assert plan.predicted_bytes <= plan.budget_bytes
