"""slimact.actions: one vocabulary (keep / recompute / codec:<name> / reformulate:<op>) everywhere."""

from __future__ import annotations

import pytest
import torch

import slimact
from slimact import actions
from slimact.codecs.base import codec_label
from slimact.codecs.outlier import OutlierConfig
from slimact.codecs.prac import PracCodecConfig
from slimact.codecs.quant import ChannelQuantConfig, QuantConfig
from slimact.planner.plan import LayerPlan

WORDS = {"keep", "recompute", "codec", "reformulate"}


@pytest.mark.parametrize(
    "text",
    ["keep", "recompute", "codec:int4", "codec:prac/r1=12,r2=7", "codec:int4:exact",
     "reformulate:inv_silu"],
)  # fmt: skip
def test_parse_round_trips(text):
    assert str(actions.parse(text)) == text


def test_parse_rejects_unknown_words_naming_the_value():
    for bad in ("dropped-ish", "codec:", "reform", "reformulate:", "CODEC:int4"):
        with pytest.raises(ValueError, match="unknown action"):
            actions.parse(bad)


def test_legacy_plan_words_are_normalized():
    assert actions.normalize("dropped") == "recompute"
    assert actions.normalize("checkpoint input") == "keep"
    assert actions.normalize("int4-outlier-g16") == "codec:int4-outlier-g16"  # a bare codec name
    lp = LayerPlan("layers.0", "Block", storages=(("a", "int8", 8, 2), ("b", "dropped", 8, 0)))
    assert [r[1] for r in lp.storages] == ["codec:int8", "recompute"]


def test_reform_ops_are_the_names_their_saves_carry():
    assert actions.reform_op("invact:silu") == "inv_silu"
    assert actions.reform_op("invnorm:rms") == "inv_rms_norm"
    assert actions.reform_op("invnorm:layer") == "inv_layer_norm"
    assert actions.reform_op("chunked-ce") == "chunked_ce"


def test_codec_labels_carry_the_parameters_that_differ():
    assert codec_label(QuantConfig()) == "int4"
    assert codec_label(OutlierConfig(group_size=16)) == "int4-outlier-g16"  # registered
    assert codec_label(OutlierConfig(group_size=32)) == "int4-outlier/g32"
    assert codec_label(ChannelQuantConfig(bits=8, channels=172)) == "int8-channel"  # sizing only
    assert codec_label(PracCodecConfig(r1=12, r2=7)) == "prac/r1=12,r2=7"


def _meter_actions(spec):
    torch.manual_seed(0)
    model = slimact.apply(slimact.build_model("llama-tiny"), spec)
    ids = torch.randint(0, 256, (2, 32))
    with slimact.measure(model) as meter:
        model(ids, targets=ids).loss.backward()
    return {s.site: s.action for s in meter.report.sites}


@pytest.mark.parametrize("spec", ["none", "recompute", "invact", "int4", "prac"])
def test_the_meter_speaks_the_vocabulary(spec):
    acts = _meter_actions(spec)
    assert {actions.parse(a).kind for a in acts.values()} <= WORDS
    if spec == "recompute":
        assert acts["layers.0:checkpoint_input#0"] == "keep"
    if spec == "invact":
        assert acts["layers.0.mlp.act_fn:inv_silu#0"] == "reformulate:inv_silu"
    if spec in ("int4", "prac"):
        assert any(a.startswith(f"codec:{spec}") for a in acts.values())
