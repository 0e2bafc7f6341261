"""Checkpoints: bitwise-exact resume, atomic layout, pruning, RNG and weights-only state."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal

import numpy as np
import pytest
import torch

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
    MODEL_FILE,
    STATE_FILE,
    prune_checkpoints,
    rng_state,
    set_rng_state,
)

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


@pytest.mark.parametrize(
    "extra",
    [{}, {"grad_accum": 2, "strategy": "recompute", "warmup": 2}, {"strategy": "prac"}],
    ids=["plain", "accum-recompute", "prac-state"],
)
def test_resume_is_bitwise_exact(tmp_path, data, extra):
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
    assert {p.name for p in ckpt.iterdir()} == {MODEL_FILE, STATE_FILE, CONFIG_FILE}
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


def test_resume_without_checkpoint_starts_fresh(tmp_path, data):
    a = train(cfg(data, tmp_path / "a", steps=3))
    b = train(cfg(data, tmp_path / "b", steps=3, resume=True))
    assert b.resumed_from is None and losses(b.run_dir) == losses(a.run_dir)


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
