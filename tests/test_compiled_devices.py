"""Traced codecs not verified on CUDA are refused there (``slimact.compiled.devices``)."""

from __future__ import annotations

import pytest
import torch

from slimact import compiled as C
from slimact.compiled import blocks as compiled_blocks
from slimact.compiled.blocks import BlockChoice, compile_block
from slimact.models import build_model


@pytest.fixture
def no_opt_in(monkeypatch):
    monkeypatch.delenv(C.CUDA_OPT_IN, raising=False)


def test_verified_codecs_run_on_cuda_the_others_only_with_the_opt_in(no_opt_in, monkeypatch):
    for dev in ("cpu", "cuda", "mps"):
        assert C.usable_on("none", dev)
    for codec in ("int8", "int6", "int4", "int4-outlier", C.CODECS["int8"]):  # checked on an H200
        assert C.usable_on(codec, "cpu") and C.usable_on(codec, "cuda")
    for codec in ("prac", "int4-sr", "int8-sr"):  # noisier by design: not verified there
        assert C.usable_on(codec, "cpu") and not C.usable_on(codec, "cuda")
    monkeypatch.setenv(C.CUDA_OPT_IN, "1")
    assert C.usable_on("prac", "cuda")
    monkeypatch.setenv(C.CUDA_OPT_IN, "yes")  # only "1" opts in
    assert not C.usable_on("int4-sr", "cuda")


def test_check_device_names_the_codec_the_evidence_and_the_ways_out(no_opt_in):
    C.check_device("int8", {"cpu", "cuda"})
    C.check_device("none", {"cpu", "cuda"})
    C.check_device("prac", {"cpu"})
    with pytest.raises(
        C.UnverifiedOnDevice, match=r"traced codec 'int4-sr' is not verified on cuda"
    ):
        C.check_device("int4-sr", ["cpu", "cuda"])
    with pytest.raises(C.UnverifiedOnDevice, match=C.CUDA_OPT_IN + "=1 runs it anyway"):
        C.check_device("prac", ["cuda"])


def test_usable_codecs_drops_and_warns(no_opt_in):
    with pytest.warns(UserWarning, match="traced codec.s. prac, int4-sr are not verified on cuda"):
        assert C.usable_codecs(("none", "int8", "prac", "int4-sr"), "cuda") == ("none", "int8")
    assert C.usable_codecs(("none", "prac"), "cpu") == ("none", "prac")


def test_a_compiled_block_refuses_a_lossy_codec_on_cuda_before_compiling(no_opt_in, monkeypatch):
    """The check runs at the block's call, on its inputs' devices (CUDA faked: this machine may
    have none), before dynamo sees the call: nothing is compiled or run."""
    assert compiled_blocks._device_types((torch.ones(1), 3), {"m": torch.ones(1)}) == {"cpu"}
    block = build_model("llama-tiny").layers[0]
    calls = []
    monkeypatch.setattr(compiled_blocks, "_device_types", lambda a, k: {"cuda"})
    fwd = compile_block(block, BlockChoice(1.0, "prac"), lambda *a, **k: calls.append(a))
    with pytest.raises(C.UnverifiedOnDevice, match="'prac' is not verified on cuda"):
        fwd(torch.randn(1, 4, 64))
    assert calls == []
