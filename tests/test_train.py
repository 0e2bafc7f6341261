"""Training: config validation, schedule, CLI, smoke training on llama-tiny."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from slimact.train import TrainConfig, WarmupCosine, read_metrics, train
from slimact.train.cli import add_train_arguments, config_from_args, main, run_train
from slimact.train.config import DEFAULT_STRATEGY

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))


pytestmark = pytest.mark.usefixtures("isolated_cache", "one_thread")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "code.txt"
    path.write_text(TEXT)
    return path


def tiny(tmp_path, text_file, **kw) -> TrainConfig:
    base = dict(
        model="llama-tiny",
        strategy="none",
        steps=6,
        batch=4,
        seq=32,
        eval_every=0,
        eval_batches=2,
        data=str(text_file),
        out=str(tmp_path / "run"),
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, pattern",
    [
        ({"steps": 0}, r"steps must be >= 1, got 0"),
        ({"steps": -5}, r"steps must be >= 1, got -5"),
        ({"batch": 0}, r"batch must be >= 1, got 0"),
        ({"seq": 1}, r"seq must be in \[2, 256\].*got 1"),
        (
            {"seq": 512},
            r"seq must be in \[2, 256\] \(model 'llama-tiny' has max_seq_len 256\), got 512",
        ),
        ({"grad_accum": 0}, r"grad_accum must be >= 1, got 0"),
        ({"lr": 0.0}, r"lr must be > 0, got 0.0"),
        ({"lr": float("nan")}, r"lr must be a finite number"),
        ({"min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\], got 1.5"),
        ({"warmup": 2.5}, r"warmup must be a fraction in \[0, 1\) or a whole number"),
        ({"warmup": 20}, r"warmup of 20 steps exceeds steps=10"),
        ({"clip": -1.0}, r"clip must be >= 0"),
        ({"eval_batches": 0}, r"eval_batches must be >= 1, got 0"),
        ({"keep_last": 0}, r"keep_last must be >= 1, got 0"),
        ({"device": "tpu"}, r"device must be one of auto, cpu, cuda or cuda:N, got 'tpu'"),
        ({"stop_at": 11}, r"stop_at must be in \[1, steps=10\]"),
        ({"model": "llama-nope"}, r"unknown model 'llama-nope'; valid models: .*llama-tiny"),
        ({"strategy": "zip-it"}, r"unknown strategy 'zip-it'; valid strategies: .*none"),
        ({"steps": 2.5}, r"steps must be an int, got 2.5"),
    ],
)
def test_config_rejects_bad_values(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        TrainConfig(**{"model": "llama-tiny", "steps": 10, "seq": 32, **kw})


def test_config_defaults_and_round_trip():
    cfg = TrainConfig(model="llama-tiny", strategy="none", seq=128, steps=50)
    assert (cfg.lr, cfg.warmup, cfg.weight_decay, cfg.clip) == (3e-3, 0.1, 0.01, 0.5)
    assert (
        cfg.warmup_steps == 5 and TrainConfig(model="llama-tiny", seq=8, warmup=7).warmup_steps == 7
    )
    assert cfg.run_dir.as_posix() == "runs/llama-tiny-none-0"
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    assert TrainConfig().model == "llama-20m" and TrainConfig().strategy == DEFAULT_STRATEGY
    assert DEFAULT_STRATEGY != "none"  # the main job shows a saving
    assert TrainConfig().resolved_baseline() == "train"
    assert TrainConfig(strategy="none").resolved_baseline() == "off"
    assert TrainConfig(resume=True).resolved_baseline() == "first-batch"


# --- schedule ----------------------------------------------------------------------------------


def test_warmup_cosine_schedule():
    s = WarmupCosine(lr=1.0, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert [s(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert s(9) == pytest.approx(1.0) and s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(109) == pytest.approx(0.1, abs=1e-3) and s(500) == pytest.approx(0.1)
    lrs = [s(i) for i in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert WarmupCosine(1.0, 5, 0)(0) == 1.0
    assert WarmupCosine.from_state_dict(s.state_dict()) == s
    with pytest.raises(ValueError, match="warmup_steps must be in \\[0, 5\\], got 6"):
        WarmupCosine(1.0, 5, 6)


# --- CLI ---------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--steps", "-3"], "steps must be >= 1, got -3"),
        (["--batch", "0"], "batch must be >= 1, got 0"),
        (
            ["--seq", "4096"],
            "seq must be in [2, 256] (model 'llama-tiny' has max_seq_len 256), got 4096",
        ),
        (["--lr", "-1"], "lr must be > 0, got -1.0"),
        (["--strategy", "bogus"], "unknown strategy 'bogus'"),
    ],
)
def test_cli_bad_args(argv, fragment, capsys):
    rc = run_train(parse(["--model", "llama-tiny", "--seq", "32", *argv]))
    assert rc == 2
    assert fragment in capsys.readouterr().err


def test_cli_bad_data_path(tmp_path, capsys):
    rc = main(["--model", "llama-tiny", "--seq", "16", "--data", str(tmp_path / "missing.jsonl")])
    assert rc == 2 and "missing.jsonl" in capsys.readouterr().err


def test_cli_parses_every_flag(tmp_path):
    args = parse(
        "--model llama-tiny --strategy recompute --steps 9 --batch 2 --seq 16 --grad-accum 3 "
        "--lr 1e-3 --min-lr-ratio 0.2 --warmup 3 --weight-decay 0 --clip 0 --eval-every 4 "
        "--eval-batches 2 --seed 5 --keep-last 3 --ckpt-every 2 --stop-at 4 --threads 1 "
        f"--device cpu --no-progress --resume --data {tmp_path} --out {tmp_path / 'o'}".split()
    )
    cfg = config_from_args(args)
    assert (cfg.grad_accum, cfg.warmup_steps, cfg.min_lr_ratio, cfg.stop_at) == (3, 3, 0.2, 4)
    assert (cfg.resume, cfg.progress, cfg.threads, cfg.keep_last, cfg.ckpt_every) == (
        True, False, 1, 3, 2,
    )  # fmt: skip
    assert cfg.data == str(tmp_path) and cfg.out == str(tmp_path / "o")


@pytest.mark.parametrize(
    "argv, resume",
    [([], False), (["--resume"], True), (["--resume", "latest-valid"], "latest-valid")],
)
def test_cli_resume_modes(argv, resume):
    assert config_from_args(parse(["--model", "llama-tiny", "--seq", "16", *argv])).resume == resume


def test_cli_resume_bad_mode(capsys):
    with pytest.raises(SystemExit):
        parse(["--resume", "newest"])
    assert "newest" in capsys.readouterr().err


def test_cli_train_run(tmp_path, text_file, capsys):
    out = tmp_path / "cli-run"
    rc = main(
        f"--model llama-tiny --steps 4 --batch 2 --seq 16 --eval-every 2 --eval-batches 2 "
        f"--data {text_file} --out {out} --no-progress".split()
    )
    assert rc == 0
    printed = capsys.readouterr().out
    for word in ("llama-tiny", "final val loss", "tokens/s", "saved activations", "peak"):
        assert word in printed
    assert f"{DEFAULT_STRATEGY} vs baseline (none)" in printed  # the default shows the product
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "saved_bytes"):
        assert key in records[0]
    assert "eval_loss" in records[1] and "eval_ppl" in records[3] and "eval_loss" not in records[0]
    assert (out / "ckpt-4" / "model.safetensors").is_file()


# --- training ----------------------------------------------------------------------------------


def test_loss_decreases_on_llama_tiny(tmp_path, text_file):
    cfg = tiny(tmp_path, text_file, steps=30, batch=8, seq=64, lr=1e-2, eval_every=10)
    result = train(cfg)
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert result.final_val_loss < result.history[9]["eval_loss"]
    assert result.final_val_ppl == pytest.approx(math.exp(result.final_val_loss))
    assert result.saved_bytes and result.saved_bytes > 0
    assert result.tokens_per_s > 0 and result.params > 0 and result.steps == 30
    assert [r["step"] for r in result.history if "eval_loss" in r] == [10, 20, 30]


def test_stdlib_default_corpus_trains(tmp_path):
    cfg = TrainConfig(
        model="llama-tiny", steps=3, batch=2, seq=32, eval_batches=1, out=str(tmp_path / "r"),
        progress=False,
    )  # fmt: skip
    result = train(cfg)
    assert len(result.history) == 3 and math.isfinite(result.final_val_loss)


def test_grad_accum_and_lr_schedule_in_log(tmp_path, text_file):
    cfg = tiny(tmp_path, text_file, steps=5, grad_accum=2, warmup=2, min_lr_ratio=0.0, lr=1e-3)
    result = train(cfg)
    lrs = [r["lr"] for r in result.history]
    sched = WarmupCosine(1e-3, 5, 2, 0.0)
    assert lrs == [sched(i) for i in range(5)]
    assert [r["tokens"] for r in result.history] == [i * 4 * 32 * 2 for i in range(1, 6)]


def test_strategy_changes_saved_bytes(tmp_path, text_file):
    base = train(tiny(tmp_path, text_file, steps=1, out=str(tmp_path / "a")))
    rec = train(tiny(tmp_path, text_file, steps=1, strategy="recompute", out=str(tmp_path / "b")))
    assert 0 < rec.saved_bytes < base.saved_bytes
    assert rec.history[0]["loss"] == pytest.approx(base.history[0]["loss"], rel=1e-5)


def test_fresh_run_refuses_a_dir_with_checkpoints(tmp_path, text_file):
    train(tiny(tmp_path, text_file, steps=2))
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        train(tiny(tmp_path, text_file, steps=2))
    with pytest.raises(ValueError, match="batch: checkpoint has 4, this run has 2"):
        train(tiny(tmp_path, text_file, steps=2, batch=2, resume=True))


# --- the baseline twin (slimact.train.baseline) -------------------------------------------------


def test_baseline_twin_trains_alongside_without_changing_the_run(tmp_path, text_file):
    kw = dict(strategy="recompute", steps=4, eval_every=2)
    alone = train(tiny(tmp_path, text_file, baseline="off", out=str(tmp_path / "a"), **kw))
    paired = train(tiny(tmp_path, text_file, baseline="train", out=str(tmp_path / "b"), **kw))
    assert alone.baseline is None
    # the twin replays the strategy's RNG and never draws from it: the same trajectory, bitwise
    assert [r["loss"] for r in paired.history] == [r["loss"] for r in alone.history]
    side = paired.baseline
    assert side is not None and side.mode == "train"
    assert 0 < paired.saved_bytes < side.saved_bytes  # recompute keeps less than none
    assert 0 < paired.peak_bytes and 0 < side.peak_bytes
    # recompute is exact: the twin (strategy none) follows the same losses to rounding
    assert side.final_train_loss == pytest.approx(paired.final_train_loss, rel=1e-4)
    assert side.final_val_loss == pytest.approx(paired.final_val_loss, rel=1e-4)
    assert side.first_loss == pytest.approx(paired.first_loss, rel=1e-6)
    assert side.step_time_ratio is not None and side.step_time_ratio.n == side.rounds >= 1
    assert side.step_time_ratio.min <= side.step_time_ratio.median <= side.step_time_ratio.max
    assert "baseline_loss" in paired.history[1] and "step_time_ratio" in paired.history[2]
    assert "baseline_eval_loss" in paired.history[1]


def test_first_batch_twin_measures_then_frees_itself(tmp_path, text_file):
    from slimact.train.baseline import FIRST_BATCH_ROUNDS, WARMUP_ROUNDS

    steps = FIRST_BATCH_ROUNDS + WARMUP_ROUNDS + 3
    res = train(
        tiny(tmp_path, text_file, strategy="recompute", steps=steps, baseline="first-batch")
    )
    side = res.baseline
    assert side is not None and side.mode == "first-batch"
    assert side.final_train_loss is None and side.final_val_loss is None  # never trained
    assert side.rounds == FIRST_BATCH_ROUNDS and side.saved_bytes > res.saved_bytes


def test_baseline_train_refuses_resume_and_dist():
    with pytest.raises(ValueError, match="baseline 'train' needs a fresh single-process run"):
        TrainConfig(model="llama-tiny", resume=True, baseline="train")
    with pytest.raises(ValueError, match="baseline must be one of .*got 'twin'"):
        TrainConfig(model="llama-tiny", baseline="twin")
