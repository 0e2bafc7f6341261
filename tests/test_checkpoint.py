"""Checkpoints: bitwise-exact resume, atomic layout, pruning, RNG and weights-only state."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal

import numpy as np
import pytest
import torch

from slimact.planner.evolve import EvolveConfig, PlanEvolver
from slimact.train import (
    TrainConfig,
    latest_checkpoint,
    list_checkpoints,
    loop,
    read_metrics,
    train,
)
from slimact.train.checkpoint import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    prune_checkpoints,
    rng_state,
    set_rng_state,
    verify_checkpoint,
)
from slimact.train.resume import PLAN_FILE, PLANNER_FILE

TEXT = "".join(f"class Thing{i}:\n    value = {i * 31 % 97}\n\n" for i in range(400))


pytestmark = pytest.mark.usefixtures("isolated_cache", "one_thread")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text(TEXT)
    return str(path)


def cfg(data: str, out, **kw) -> TrainConfig:
    base = dict(
        model="llama-tiny", strategy="none", steps=6, batch=4, seq=32, eval_every=2, eval_batches=2,
        data=data,
        out=str(out), progress=False, ckpt_every=0,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


AUTO = "auto@25%,codecs=int4/int8/int4-outlier,repeats=1,reform=0"


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"grad_accum": 2, "strategy": "recompute", "warmup": 2},
        {"strategy": "prac"},
        {"strategy": AUTO, "baseline": "off"},
        {"strategy": "int4", "baseline": "off"},
    ],
    ids=["plain", "accum-recompute", "prac-state", "auto-plan", "int4-rules"],
)
def test_resume_is_bitwise_exact(tmp_path, data, extra, monkeypatch):
    monkeypatch.setenv("SLIMACT_CACHE_DIR", str(tmp_path / "profiles"))
    # re-plans driven by tracked codec times differ between two runs; bytes and outliers do not
    monkeypatch.setattr(PlanEvolver, "default_config", EvolveConfig(time_codecs=False))
    straight = train(cfg(data, tmp_path / "straight", **extra))
    first = train(cfg(data, tmp_path / "split", stop_at=3, **extra))
    assert first.steps == 3 and latest_checkpoint(tmp_path / "split").name == "ckpt-3"
    resumed = train(cfg(data, tmp_path / "split", resume=True, **extra))
    assert resumed.resumed_from == 3 and resumed.steps == 6
    assert len(losses(tmp_path / "straight")) == 6
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")  # bitwise, not approx
    assert [r["grad_norm"] for r in resumed.history] == [r["grad_norm"] for r in straight.history]
    assert resumed.final_val_loss == straight.final_val_loss
    a = torch.load(tmp_path / "straight" / "ckpt-6" / STATE_FILE, weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt-6" / STATE_FILE, weights_only=True)
    assert a["loader"] == b["loader"]
    x = (tmp_path / "straight" / "ckpt-6" / MODEL_FILE).read_bytes()
    assert x == (tmp_path / "split" / "ckpt-6" / MODEL_FILE).read_bytes()
    if (tmp_path / "straight" / "ckpt-6" / PLAN_FILE).exists():  # the plan in force at the end
        plans = [
            json.loads((tmp_path / run / "ckpt-6" / PLAN_FILE).read_text())
            for run in ("straight", "split")
        ]
        for p in plans:  # the solver's wall time is no part of the plan's decisions
            p.pop("solve_s", None)
        assert plans[0] == plans[1]
    if extra.get("strategy") == "int4":  # a plan of lazy rules, checkpointed like any plan
        saved = json.loads((tmp_path / "split" / "ckpt-3" / PLAN_FILE).read_text())
        assert saved["rules"] and not saved["layers"]
    if extra.get("strategy") == AUTO:  # resumed with the checkpoint's plan: nothing re-profiled
        assert len(list((tmp_path / "profiles").rglob("*.json"))) == 1
        saved = json.loads((tmp_path / "split" / "ckpt-3" / PLAN_FILE).read_text())
        state = json.loads((tmp_path / "split" / "ckpt-3" / PLANNER_FILE).read_text())
        assert saved["layers"] and state["profile"] and state["evolver"]["cap"] == 64
        assert [r.get("budget_check") for r in read_metrics(tmp_path / "split")][0][0][
            "action"
        ] == "ok"


def test_resume_after_crash_redoes_logged_steps(tmp_path, data):
    straight = losses(train(cfg(data, tmp_path / "a")).run_dir)
    train(cfg(data, tmp_path / "b", ckpt_every=3, keep_last=5))
    shutil.rmtree(tmp_path / "b" / "ckpt-6")  # as if the run died after logging step 6
    resumed = train(cfg(data, tmp_path / "b", ckpt_every=3, keep_last=5, resume=True))
    assert resumed.resumed_from == 3
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path / "b") == straight
    assert [r["loss"] for r in resumed.history] == straight


def test_checkpoint_layout_and_weights_only_state(tmp_path, data):
    result = train(cfg(data, tmp_path / "r", steps=2))
    ckpt = tmp_path / "r" / "ckpt-2"
    assert {p.name for p in ckpt.iterdir()} == {MODEL_FILE, STATE_FILE, CONFIG_FILE, MANIFEST_FILE}
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {MODEL_FILE, STATE_FILE, CONFIG_FILE}
    for name, rec in manifest["files"].items():
        assert rec["sha256"] == hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    state = torch.load(ckpt / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and set(state["rng"]) >= {"python", "numpy", "torch"}
    assert state["loader"]["position"] >= 0 and state["schedule"]["total_steps"] == 2
    assert TrainConfig.from_dict(json.loads((ckpt / CONFIG_FILE).read_text())) == result.config
    assert not [p for p in (tmp_path / "r").iterdir() if p.name.startswith(".tmp")]


def test_keep_last_and_incomplete_checkpoints(tmp_path, data):
    run = tmp_path / "r"
    train(cfg(data, run, ckpt_every=1, keep_last=2))
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-5", "ckpt-6"]
    (run / "ckpt-9").mkdir()  # a directory without files is not a checkpoint
    (run / "ckpt-9" / MODEL_FILE).write_bytes(b"")
    (run / ".tmp-ckpt-7-123").mkdir()
    assert latest_checkpoint(run).name == "ckpt-6"
    deleted = prune_checkpoints(run, keep_last=1)
    assert {p.name for p in deleted} == {"ckpt-5", ".tmp-ckpt-7-123"}
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        prune_checkpoints(run, 0)


def test_resume_without_checkpoint_is_an_error_and_overwrites_nothing(tmp_path, data):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        train(cfg(data, tmp_path / "empty", steps=3, resume=True))
    run = tmp_path / "r"
    train(cfg(data, run, steps=3, ckpt_every=0))
    metrics = (run / "metrics.jsonl").read_text()
    shutil.rmtree(run / "ckpt-3")  # the run's metrics remain, its checkpoint is gone
    with pytest.raises(CheckpointError, match=f"{run}.*no checkpoint"):
        train(cfg(data, run, steps=3, resume=True))
    assert (run / "metrics.jsonl").read_text() == metrics and not list_checkpoints(run)
    with pytest.raises(ValueError, match="resume must be False, True"):
        train(cfg(data, run, steps=3, resume="newest"))


def _damage(ckpt, how):
    if how == "missing":
        (ckpt / STATE_FILE).unlink()
        return STATE_FILE
    blob = bytearray((ckpt / MODEL_FILE).read_bytes())
    blob[-1] ^= 0xFF  # one flipped bit pattern in the weights: same size, other checksum
    (ckpt / MODEL_FILE).write_bytes(bytes(blob))
    return MODEL_FILE


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_damaged_checkpoint_stops_resume_unless_latest_valid(tmp_path, data, how):
    straight = losses(train(cfg(data, tmp_path / "a")).run_dir)
    run = tmp_path / "b"
    train(cfg(data, run, ckpt_every=3, keep_last=5))
    name = _damage(run / "ckpt-6", how)
    metrics = (run / "metrics.jsonl").read_text()
    word = "missing" if how == "missing" else "corrupt"
    with pytest.raises(
        CheckpointError, match=f"{run / 'ckpt-6'} is .*{word}.*{name}.*latest-valid"
    ):
        train(cfg(data, run, ckpt_every=3, keep_last=5, resume=True))
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing overwritten
    with pytest.raises(CheckpointError, match=str(run / "ckpt-6")):
        verify_checkpoint(run / "ckpt-6")
    with pytest.warns(UserWarning, match=f"skipping checkpoint {run / 'ckpt-6'}"):
        resumed = train(cfg(data, run, ckpt_every=3, keep_last=5, resume="latest-valid"))
    assert resumed.resumed_from == 3 and losses(run) == straight
    assert (run / "ckpt-6.invalid").is_dir() and latest_checkpoint(run).name == "ckpt-6"


def test_resume_of_finished_run_is_a_no_op(tmp_path, data):
    first = train(cfg(data, tmp_path / "r", steps=3))
    again = train(cfg(data, tmp_path / "r", steps=3, resume=True))
    assert again.steps == 3 and again.resumed_from == 3
    assert again.final_val_loss == first.final_val_loss
    assert losses(tmp_path / "r") == losses(first.run_dir) and len(again.history) == 3


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    draws = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path, data, monkeypatch):
    straight = losses(train(cfg(data, tmp_path / "a")).run_dir)
    original = loop._Trainer.train_step

    def step_then_interrupt(self, *args):
        out = original(self, *args)
        if self.step == 1:  # during the 2nd step: the user presses Ctrl-C once
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(loop._Trainer, "train_step", step_then_interrupt)
    stopped = train(cfg(data, tmp_path / "b"))
    assert stopped.interrupted and stopped.steps == 2
    assert latest_checkpoint(tmp_path / "b").name == "ckpt-2"
    monkeypatch.setattr(loop._Trainer, "train_step", original)
    resumed = train(cfg(data, tmp_path / "b", resume=True))
    assert not resumed.interrupted and losses(tmp_path / "b") == straight
