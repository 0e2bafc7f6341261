"""Checkpoint and resume wiring of the trainer: which checkpoint to resume, what goes in one.

**Which checkpoint** (``TrainConfig.resume``):

- ``False``: a fresh run; a run directory that already holds checkpoints is refused;
- ``True`` (or ``"latest"``): the newest ``ckpt-<step>``. No checkpoint, one with a file
  missing, or one whose files do not match the checksums of its manifest is an error naming
  its path; nothing is overwritten;
- ``"latest-valid"``: the newest checkpoint that verifies, an explicit choice to fall back past
  damaged ones (each skipped one is warned about, and renamed ``<name>.invalid`` when the run
  writes its next checkpoint, so later runs do not trip over it).

**What goes in one**, beyond weights, optimizer, schedule, loader and RNG states: the state of
stateful strategies (PRAC's subspaces), and under a plan runtime (``auto``, ``plan``) the plan
itself (``plan.json``) with the planner's state (``planner.json``: the profile the plan was
solved from, which the evolver updates, the evolver's state and the budget check's), so a
resumed run carries on with the plan it had instead of re-solving it from the checkpoint's
weights, and repeats the uninterrupted run bit for bit. Under ``compiled-auto`` (``auto`` with
``--compile``) the plan it solved on its first step is ``compiled_plan.json``; a resumed run
installs it on its blocks and root instead of profiling and solving again.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.nn as nn

from slimact import dist as sdist
from slimact.data import ByteTokenizer
from slimact.models import build_model
from slimact.planner.adaptive import PlanEvolver, budget_check_of
from slimact.planner.apply import runtime_of
from slimact.planner.compiled import CompiledPlan
from slimact.planner.plan import Plan, Profile
from slimact.state import peek
from slimact.strategies.compiled_auto import install_plan
from slimact.train.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    load_checkpoint,
    load_config_dict,
    prune_checkpoints,
    read_json,
    save_checkpoint,
    verify_checkpoint,
)
from slimact.train.config import TrainConfig

PLAN_FILE = "plan.json"
PLANNER_FILE = "planner.json"
PLAN_LOG = "plan_changes.jsonl"
COMPILED_PLAN_FILE = "compiled_plan.json"
RESUME_MODES = ("latest", "latest-valid")


def resume_mode(value: Any) -> str | None:
    """``TrainConfig.resume`` -> None (fresh run), ``"latest"`` or ``"latest-valid"``."""
    if value is False or value is None:
        return None
    if value is True:
        return "latest"
    if isinstance(value, str) and value in RESUME_MODES:
        return value
    raise ValueError(
        f"resume must be False, True (the latest checkpoint) or one of {RESUME_MODES}, "
        f"got {value!r}"
    )


def find_resume(config: TrainConfig) -> tuple[Path | None, list[Path]]:
    """The checkpoint to resume from (None: a fresh run) and the damaged ones skipped."""
    run_dir, mode = config.run_dir, resume_mode(config.resume)
    found = checkpoint_dirs(run_dir)
    if mode is None:
        if found:
            raise ValueError(
                f"run dir {run_dir} already holds checkpoints (latest {found[-1].name}); "
                f"pass --resume to continue that run or choose another --out"
            )
        return None, []
    if not found:
        raise CheckpointError(
            f"--resume: {run_dir} holds no checkpoint (ckpt-<step>/) to resume from; "
            f"drop --resume to start a new run there"
        )
    skipped: list[Path] = []
    for path in reversed(found):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            if mode != "latest-valid":
                raise CheckpointError(
                    f"{e}; resume='latest-valid' (--resume latest-valid) falls back to the "
                    f"newest valid checkpoint"
                ) from None
            warnings.warn(f"resume: skipping {e}", stacklevel=2)
            skipped.append(path)
            continue
        diffs = config.mismatches(TrainConfig.from_dict(load_config_dict(path)))
        if diffs:
            raise ValueError(f"cannot resume from {path}: " + "; ".join(diffs))
        return path, skipped
    raise CheckpointError(f"--resume latest-valid: no checkpoint in {run_dir} is valid")


class _OptimState:
    """Stands in for an optimizer in ``save_checkpoint`` (FSDP2: the gathered full state)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state


def _plain_model(config: TrainConfig) -> nn.Module:
    return build_model(config.model, vocab_size=ByteTokenizer().vocab_size)


class RunCheckpoints:
    """Reads and writes one run's checkpoints, single-process, DDP (rank 0 writes) or FSDP2
    (full weights and optimizer state gathered on every rank, written by rank 0)."""

    def __init__(self, config: TrainConfig, info: sdist.DistInfo, model: nn.Module, optimizer):  # type: ignore[no-untyped-def]
        self.config, self.info = config, info
        self.model, self.optimizer = model, optimizer
        self.skipped: list[Path] = []  # damaged checkpoints to move aside on the next save

    @property
    def sharded(self) -> bool:
        return self.config.dist == "fsdp"

    def load(self, path: Path) -> dict[str, Any]:
        """Weights and optimizer state in place; the rest of the state dict is returned."""
        if not self.sharded:  # DDP shares the bare model's parameters: load in place
            return load_checkpoint(path, self.model, self.optimizer)
        # FSDP2 only: torch.distributed.checkpoint needs a torch built with distributed
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        plain = _plain_model(self.config)
        state = load_checkpoint(path, plain)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, plain.state_dict(), options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        return state

    def save(self, step: int, state: dict[str, Any], extra_files: dict[str, str]) -> None:
        model, optimizer = self.model, self.optimizer
        if self.sharded:  # gather full weights and optimizer state (collectives: every rank)
            # (torch.distributed.checkpoint: optional, as in load above)
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(self.model, options=opts)
            optimizer = _OptimState(
                get_optimizer_state_dict(self.model, self.optimizer, options=opts)
            )
            if self.info.is_main:
                model = _plain_model(self.config)
                model.load_state_dict(weights)
        if self.info.is_main:
            for path in self.skipped:  # damaged checkpoints resume='latest-valid' passed over
                if path.is_dir():
                    os.replace(path, path.with_name(path.name + ".invalid"))
            self.skipped = []
            run_dir = self.config.run_dir
            save_checkpoint(
                run_dir, step, model=model, optimizer=optimizer, state=state,
                config=self.config.to_dict(), extra_files=extra_files,
            )  # fmt: skip
            prune_checkpoints(run_dir, self.config.keep_last)
        sdist.barrier()


# ---------------------------------------------------------------------------------------------
# the plan runtime's state


def planner_files(model: nn.Module, evolver: PlanEvolver | None) -> dict[str, str]:
    """``plan.json`` and ``planner.json`` for a model under a plan runtime, ``compiled_plan.json``
    for one under ``compiled-auto`` once it has planned, else nothing."""
    compiled = getattr(peek(model), "compiled_plan", None)
    if compiled is not None:  # its root plan is on a runtime too: the compiled plan carries it
        return {COMPILED_PLAN_FILE: compiled.to_json()}
    rt = runtime_of(model)
    if rt is None or rt.plan is None:
        return {}
    check = budget_check_of(model)
    state = {
        "profile": rt.profile.to_dict() if rt.profile is not None else None,
        "evolver": evolver.state_dict() if evolver is not None else None,
        "budget_check": check.state_dict() if check is not None else None,
    }
    return {PLAN_FILE: rt.plan.to_json(), PLANNER_FILE: json.dumps(state)}


@contextlib.contextmanager
def _naming(path: Path, name: str) -> Iterator[None]:
    """A plan file of checkpoint ``path`` that does not read or install (a codec unknown, a
    field of the wrong shape, another model's blocks) is a ``CheckpointError`` naming the file,
    not the reader's error alone."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            f"cannot resume from {path}: its {name} ({Path(path) / name}) is not a plan this "
            f"model takes: {type(e).__name__}: {e}"
        ) from e


def restore_planner(
    model: nn.Module, path: Path, step: int, run_dir: Path, evolve: bool
) -> PlanEvolver | None:
    """Put the checkpoint's plan back on ``model`` (no re-solve) with its profile, budget-check
    and (``evolve``) evolver state; returns the evolver, if the run has one."""
    compiled = read_json(path, COMPILED_PLAN_FILE)
    if compiled is not None:
        with _naming(path, COMPILED_PLAN_FILE):
            install_plan(model, CompiledPlan.from_dict(compiled))
        return None
    rt = runtime_of(model)
    saved = read_json(path, PLAN_FILE)
    if rt is None or saved is None:
        return None
    state = read_json(path, PLANNER_FILE) or {}
    with _naming(path, PLAN_FILE):
        rt.set_plan(Plan.from_dict(saved))
    if state.get("profile") is not None:
        rt.profile = Profile.from_dict(state["profile"])
    check = budget_check_of(model)
    if check is not None and state.get("budget_check") is not None:
        check.load_state_dict(state["budget_check"])
    log = run_dir / PLAN_LOG
    if log.is_file():  # drop what the interrupted run logged after this checkpoint
        keep = [ln for ln in log.read_text().splitlines() if json.loads(ln)["step"] <= step]
        log.write_text("".join(ln + "\n" for ln in keep))
    if not evolve:
        return None
    evolver = PlanEvolver.for_model(model, log_path=log)
    if evolver is not None:
        evolver.load_state_dict(state.get("evolver") or {**evolver.state_dict()}, step)
    return evolver
