"""The training loop behind ``slimact train`` and ``slimact.train.train(config)``.

One step = ``grad_accum`` micro-batches (forward, ``loss / grad_accum`` backward), gradient
clipping, one AdamW step (betas 0.9/0.95; weight decay on matrices only, not on norms/biases) at
the rate ``WarmupCosine`` gives that step. bf16 autocast on CUDA, plain fp32 on CPU. The first
forward of each invocation runs inside ``slimact.measure`` to record the activation bytes saved
for backward (the meter only observes, so numerics are unchanged). Validation loss/perplexity is
computed every ``eval_every`` steps and at the end on a fixed set of val windows.

Distributed (``--dist ddp|fsdp`` under ``torchrun``, see ``slimact.dist``): ``batch`` is the
global batch; every rank draws it and keeps its rows; the strategy is applied to the bare model
before DDP / FSDP2 wraps it; losses are averaged over ranks for the log; only rank 0 writes
metrics and checkpoints (full, unsharded ``model.safetensors``: a checkpoint loads into a plain
single-process model and resumes under any world size that divides the batch).

Everything that decides the trajectory (weights, optimizer, schedule step, loader position, RNG
states, the plan under ``auto`` and its evolver's state) goes into checkpoints, so on CPU a
resumed run repeats the uninterrupted run's losses bit-for-bit (under ``auto``, as long as the
evolver's re-plans do not hang on its tracked codec *times*, which differ between runs:
``PlanEvolver.default_config = EvolveConfig(time_codecs=False)`` makes them deterministic);
which checkpoint ``resume`` picks, and what a damaged one does, is ``slimact.train.resume``'s.
Ctrl-C finishes the current step, writes a checkpoint and stops (a second Ctrl-C aborts at once).
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from tqdm.auto import tqdm

import slimact
from slimact import dist as sdist
from slimact.data import BatchLoader, ByteTokenizer, fixed_batches, load_data
from slimact.models import build_model, count_params
from slimact.planner.adaptive import PlanEvolver, budget_check_of
from slimact.state import state_of
from slimact.timing import load_average
from slimact.train.baseline import (
    WARMUP_ROUNDS,
    BaselineTwin,
    FirstStep,
    measured_forward_backward,
    ratio_over_rounds,
    rng_snapshot,
)
from slimact.train.checkpoint import set_rng_state
from slimact.train.config import TrainConfig
from slimact.train.logger import MetricsLog
from slimact.train.result import SideBySide, TrainResult
from slimact.train.resume import (
    PLAN_LOG,
    RunCheckpoints,
    find_resume,
    planner_files,
    restore_planner,
)
from slimact.train.schedule import WarmupCosine
from slimact.train.steps import (
    Batch,
    autocast_for,
    clip_and_step,
    evaluate,
    forward_backward,
    make_optimizer,
    perplexity,
)
from slimact.utils import fmt_bytes, seed_everything

__all__ = ["TrainResult", "autocast_for", "evaluate", "make_optimizer", "perplexity", "train"]


@contextmanager
def graceful_interrupt() -> Iterator[threading.Event]:
    """First Ctrl-C sets the event (stop after this step); the second one raises as usual."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        stop.set()
        tqdm.write("interrupt: stopping after this step and writing a checkpoint (Ctrl-C aborts)")

    signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _build_model(config: TrainConfig, device: str) -> tuple[nn.Module, nn.Module | None]:
    """The model with the strategy applied, and (if a baseline twin is wanted) an untouched copy
    of its initial weights; building the copy does not move the RNG the run draws from."""
    model = build_model(config.model, vocab_size=ByteTokenizer().vocab_size)
    twin = None
    if config.resolved_baseline() != "off":
        with torch.random.fork_rng(devices=[]):
            twin = build_model(config.model, vocab_size=ByteTokenizer().vocab_size)
        twin.load_state_dict(model.state_dict())
    slimact.apply(model, config.strategy)
    return model.to(device), twin


class _NullLog:
    """Metrics sink of ranks other than 0."""

    history: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class _Trainer:
    """State of one invocation; ``run`` does the steps."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.dist = sdist.DistInfo()
        if config.dist != "none":
            self.dist = sdist.init()
        elif sdist.env_world_size() > 1:
            raise ValueError(
                f"launched as {sdist.env_world_size()} processes but --dist none; "
                "pass --dist ddp or --dist fsdp"
            )
        if config.batch % self.dist.world_size:
            raise ValueError(
                f"--batch {config.batch} is the global batch and must divide by the world size "
                f"{self.dist.world_size}"
            )
        self.device = config.resolved_device()
        if self.device == "cuda" and self.dist.world_size > 1:
            self.device = f"cuda:{self.dist.local_rank}"
        self.run_dir = config.run_dir
        self.ckpt, skipped = find_resume(config)
        seed_everything(config.seed)
        self.model, twin = _build_model(config, self.device)
        self.twin = (
            BaselineTwin(
                twin, config.resolved_baseline(), self.device, config.lr, config.weight_decay
            )
            if twin is not None
            else None
        )
        self.first: FirstStep | None = None
        self.fb_times: list[float] = []  # strategy fwd+bwd seconds of the timed rounds
        self.params = count_params(self.model)
        if self.dist.world_size > 1:
            sdist.sync_prac(self.model)
        self.wrapped = sdist.wrap(self.model, config.dist, self.device)
        splits = load_data(config.data)
        self.loader = BatchLoader(splits.train, config.batch, config.seq, config.seed)
        self.val = fixed_batches(splits.val, config.batch, config.seq, config.eval_batches)
        self.optimizer = make_optimizer(self.wrapped, config.lr, config.weight_decay)
        self.schedule = WarmupCosine(
            config.lr, config.steps, config.warmup_steps, config.min_lr_ratio
        )
        self.step = 0
        self.tokens_seen = 0
        self.saved_bytes: int | None = None
        self.evolver: PlanEvolver | None = None
        self.checks_logged = 0  # budget-check events already in the metrics
        self.ckpts = RunCheckpoints(config, self.dist, self.model, self.optimizer)
        self.ckpts.skipped = skipped
        if self.ckpt is not None:
            state = self.ckpts.load(self.ckpt)
            if WarmupCosine.from_state_dict(state["schedule"]) != self.schedule:
                raise ValueError(f"checkpoint {self.ckpt} has a different lr schedule")
            self.loader.load_state_dict(state["loader"])
            self.step = int(state["step"])
            self.tokens_seen = int(state["tokens_seen"])
            stateful = state_of(self.model).stateful
            for name, sd in state.get("strategy_state", {}).items():  # e.g. PRAC's subspaces
                if name not in stateful:
                    raise ValueError(
                        f"checkpoint {self.ckpt} carries {name!r} state that this run's strategy "
                        f"({config.strategy!r}) does not have (it has: "
                        f"{', '.join(sorted(stateful)) or 'none'}); resume with the strategy "
                        "the checkpoint was trained with"
                    )
                stateful[name].load_state_dict(sd)
            self.evolver = restore_planner(self.model, self.ckpt, self.step, self.run_dir, True)
            check = budget_check_of(self.model)
            self.checks_logged = len(check.events) if check is not None else 0
            set_rng_state(state["rng"])  # last: nothing may draw random numbers after this
        else:  # built before step 1, so step 1 is tracked (adacc.txt §3.4)
            self.evolver = PlanEvolver.for_model(self.model, log_path=self.run_dir / PLAN_LOG)
        if self.evolver is not None and not self.dist.is_main:
            self.evolver.log_path = None  # rank 0 logs; every rank takes part in the decision
        self.log: MetricsLog | _NullLog = _NullLog()
        if self.dist.is_main:
            self.log = MetricsLog(self.run_dir, resume_step=self.step if self.ckpt else None)

    def _micro_batches(self) -> list[Batch]:
        out = []
        for _ in range(self.config.grad_accum):
            x, y = self.loader.next_batch()
            if self.dist.world_size > 1:
                x, y = sdist.shard(x), sdist.shard(y)
            out.append((x.to(self.device), y.to(self.device)))
        return out

    def train_step(self, lr: float) -> tuple[float, float]:
        """One optimizer step; returns (mean loss, grad norm before clipping).

        The first step of an invocation runs under the meter and the peak probe; later steps
        are timed (forward+backward). A baseline twin then runs the same round.
        """
        batches = self._micro_batches()
        rng = rng_snapshot(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        if self.first is None:
            self.first, loss = measured_forward_backward(self.wrapped, batches, self.device)
            self.saved_bytes = self.first.saved_bytes  # this rank's, B/W rows
        else:
            loss, seconds = forward_backward(self.wrapped, batches, self.device)
            self.fb_times.append(seconds)
        norm = clip_and_step(self.optimizer, self.config.clip)
        if self.twin is not None:
            self.twin.step(batches, rng, lr, self.config.clip)
        return sdist.mean_across(loss, self.device), norm

    def _evolve_plan(self) -> None:
        """Adacc §3.4 for ``auto``: at back-off tracking steps (step 1 first) re-solve on the
        tracked figures and swap plans between steps; under DDP/FSDP every rank calls it and
        rank 0 decides for all (``slimact.planner.evolve``)."""
        if self.evolver is not None:
            self.evolver.on_step(self.step, self.model)

    def new_budget_checks(self) -> list[dict[str, Any]]:
        """Budget-check verdicts (``slimact.planner.adaptive.BudgetCheck``) not yet logged."""
        check = budget_check_of(self.model)
        if check is None or len(check.events) <= self.checks_logged:
            return []
        new = check.events[self.checks_logged :]
        self.checks_logged = len(check.events)
        return new

    def checkpoint(self) -> None:
        state = {
            "schedule": self.schedule.state_dict(),
            "loader": self.loader.state_dict(),
            "tokens_seen": self.tokens_seen,
            "strategy_state": {  # stateful strategies (PRAC's subspaces, generators, counters)
                name: obj.state_dict() for name, obj in state_of(self.model).stateful.items()
            },
        }
        self.ckpts.save(self.step, state, planner_files(self.model, self.evolver))

    def run(self) -> TrainResult:
        cfg = self.config
        start = self.step
        stop_step = cfg.stop_at or cfg.steps
        self.model.train()
        bar = tqdm(
            total=cfg.steps,
            initial=start,
            disable=not (cfg.progress and self.dist.is_main),
            unit="step",
            dynamic_ncols=True,
            desc=f"{cfg.model}/{cfg.strategy}",
        )
        val_loss: float | None = None
        train_time, interrupted = 0.0, False
        load_before = load_average()
        if self.first is None:  # the first step runs under the meter and the peak probe
            who = " of the strategy and its baseline" if self.twin is not None else ""
            bar.set_postfix_str(f"measuring saved bytes and peak memory{who}")
        try:
            with graceful_interrupt() as stop_flag:
                while self.step < stop_step and not interrupted:
                    lr = self.schedule.set_lr(self.optimizer, self.step)
                    t0 = time.perf_counter()
                    loss, grad_norm = self.train_step(lr)
                    dt = time.perf_counter() - t0
                    self.step += 1
                    self._evolve_plan()
                    if not math.isfinite(loss):
                        raise FloatingPointError(
                            f"loss became {loss} at step {self.step}; lower --lr "
                            f"(now {cfg.lr}) or use a longer --warmup"
                        )
                    train_time += dt
                    self.tokens_seen += cfg.tokens_per_step
                    interrupted = stop_flag.is_set()
                    record: dict[str, Any] = {
                        "step": self.step,
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens": self.tokens_seen,
                        "tokens_per_s": cfg.tokens_per_step / dt,
                        "saved_bytes": self.saved_bytes,
                    }
                    checks = self.new_budget_checks()
                    if checks:
                        record["budget_check"] = checks
                    twin = self.twin
                    if twin is not None and twin.mode == "train" and twin.losses:
                        record["baseline_loss"] = twin.losses[-1]
                    if self.fb_times and twin is not None and len(twin.times) >= len(self.fb_times):
                        record["step_time_ratio"] = self.fb_times[-1] / twin.times[-1]
                    last = self.step == stop_step or interrupted
                    if last or (cfg.eval_every and self.step % cfg.eval_every == 0):
                        val_loss = evaluate(self.wrapped, self.val, self.device)
                        record["eval_loss"] = val_loss
                        record["eval_ppl"] = perplexity(val_loss)
                        if twin is not None and twin.mode == "train":
                            twin.evaluate(self.val)
                            record["baseline_eval_loss"] = twin.val_loss
                        if cfg.progress and self.dist.is_main:
                            bar.write(
                                f"step {self.step}: val loss {val_loss:.4f} "
                                f"ppl {perplexity(val_loss):.2f}"
                            )
                    self.log.log(record)
                    if last or (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
                        self.checkpoint()
                    bar.set_postfix(
                        loss=f"{loss:.4f}",
                        tok_s=f"{record['tokens_per_s']:.0f}",
                        act=fmt_bytes(self.saved_bytes or 0),
                        refresh=False,
                    )
                    bar.update(1)
        finally:
            bar.close()
            self.log.close()
        if val_loss is None:  # nothing left to do (resumed a finished run): still report val
            val_loss = evaluate(self.wrapped, self.val, self.device)
        history = self.log.history
        done = self.step - start
        first = self.first
        return TrainResult(
            config=cfg,
            run_dir=self.run_dir,
            device=self.device,
            params=self.params,
            steps=self.step,
            final_train_loss=history[-1]["loss"] if history else None,
            final_val_loss=val_loss,
            final_val_ppl=perplexity(val_loss),
            tokens_per_s=done * cfg.tokens_per_step / train_time if train_time > 0 else 0.0,
            saved_bytes=self.saved_bytes,
            history=list(history),
            resumed_from=start if self.ckpt is not None else None,
            interrupted=interrupted,
            peak_bytes=first.peak_bytes if first else None,
            first_loss=first.loss if first else None,
            step_time_s=_median_timed(self.fb_times),
            baseline=self._side_by_side(),
            load_avg=(load_before, load_average()),
        )

    def _side_by_side(self) -> SideBySide | None:
        twin = self.twin
        if twin is None or twin.first is None:
            return None
        n = min(len(self.fb_times), len(twin.times))
        ratio = ratio_over_rounds(self.fb_times[:n], twin.times[:n])
        return SideBySide(
            mode=twin.mode,
            saved_bytes=twin.first.saved_bytes,
            peak_bytes=twin.first.peak_bytes,
            step_time_s=_median_timed(twin.times),
            first_loss=twin.first.loss,
            final_train_loss=twin.losses[-1] if twin.mode == "train" else None,
            final_val_loss=twin.val_loss,
            step_time_ratio=ratio,
            rounds=ratio.n if ratio else 0,
        )


def _median_timed(times: list[float]) -> float | None:
    """Median of the timed rounds after the warm-up ones (``slimact.train.baseline``)."""
    counted = times[WARMUP_ROUNDS:] if len(times) > WARMUP_ROUNDS else times
    return statistics.median(counted) if counted else None


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) the training described by ``config``; see the module docstring."""
    if config.dist == "none":
        return _Trainer(config).run()
    try:
        return _Trainer(config).run()
    finally:
        sdist.teardown()
