"""Checkpoints: ``<run dir>/ckpt-<step>/`` with everything needed to resume bit-for-bit.

Each checkpoint directory holds

- ``model.safetensors``: the weights (``safetensors.torch.save_model``, which handles tied ones);
- ``state.pt``: optimizer state, schedule, step, loader position and the RNG states of Python,
  NumPy, torch CPU and (if present) CUDA. It holds only tensors and primitive containers, so it
  loads with ``torch.load(..., weights_only=True)``;
- ``config.json``: the ``TrainConfig`` that produced it;
- extra JSON files a run adds (``plan.json``, ``planner.json`` under strategy ``auto``);
- ``manifest.json``, written last: the sha256 and size of every other file.

A checkpoint is written into a hidden temporary directory which is then renamed with
``os.replace``, so ``ckpt-<step>`` either exists complete or not at all; ``latest_checkpoint``
also requires the three files. ``verify_checkpoint`` (run by ``load_checkpoint``) checks every
file against the manifest and raises ``CheckpointError`` naming the checkpoint and the file when
one is missing or corrupt. ``prune_checkpoints`` keeps the newest ``keep_last``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (MODEL_FILE, STATE_FILE, CONFIG_FILE)
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_TMP_PREFIX = ".tmp-ckpt-"


def rng_state() -> dict[str, Any]:
    """RNG states as tensors and primitives (safe for ``weights_only`` loading)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`. CUDA states are restored only when CUDA is present."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_step(path: Path) -> int | None:
    m = _CKPT_RE.match(path.name)
    return int(m.group(1)) if m else None


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt; the message names its path."""


def is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in REQUIRED_FILES)


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Every ``ckpt-<step>`` directory in ``run_dir``, complete or not, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_checkpoint(path: str | Path) -> None:
    """Raise ``CheckpointError`` unless every file of ``path`` is present and matches the
    manifest (size and sha256). A checkpoint without a manifest (written by an older slimact)
    is accepted with a warning when its three files are there and readable: the weights file's
    header and size agree, the state file is a whole zip archive, the config is JSON
    (``check_files``), so a truncated file is an error naming it, not a loader's traceback."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
        check_files(path)
        warnings.warn(
            f"checkpoint {path} has no {MANIFEST_FILE} (older slimact): its files are checked "
            "for truncation only, not against checksums",
            stacklevel=2,
        )
        return
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = f"checkpoint {path} is corrupt: unreadable {MANIFEST_FILE} ({e})"
        raise CheckpointError(msg) from None
    missing += [f for f in files if f not in missing and not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    for name, want in files.items():
        size = (path / name).stat().st_size
        if size != want["bytes"] or file_digest(path / name) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} does not match its checksum in "
                f"{MANIFEST_FILE} ({size} bytes, {want['bytes']} recorded)"
            )


def check_files(path: Path) -> None:
    """Raise ``CheckpointError`` naming the file where one of the three a checkpoint needs is
    truncated or not what it should be: ``model.safetensors`` must hold its 8-byte header
    length, a JSON header and exactly the bytes the header's offsets end at; ``state.pt`` must
    be a zip archive whose members' checksums hold (``torch.save``'s format); ``config.json``
    must be JSON."""
    weights = path / MODEL_FILE
    size = weights.stat().st_size
    try:
        with weights.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little") if size >= 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        want = 8 + n + max(ends, default=0)
        if size != want:
            raise ValueError(f"{size} bytes where its header describes {want}")
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {MODEL_FILE} is truncated or not a safetensors "
            f"file ({e})"
        ) from None
    try:
        with zipfile.ZipFile(path / STATE_FILE) as z:
            bad = z.testzip()
        if bad is not None:
            raise zipfile.BadZipFile(f"member {bad} fails its checksum")
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {STATE_FILE} is truncated or not a torch.save "
            f"archive ({e})"
        ) from None
    read_json(path, CONFIG_FILE)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if checkpoint_step(p) is not None and is_complete(p)]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    config: dict[str, Any],
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Atomically write ``run_dir/ckpt-<step>``; ``state`` is extra resumable state (schedule,
    loader, metrics) stored next to the optimizer, step and RNG states; ``extra_files`` maps
    file names to text (JSON) stored beside them. The manifest of checksums is written last."""
    extra_files = dict(extra_files or {})
    clash = sorted(set(extra_files) & {*REQUIRED_FILES, MANIFEST_FILE})
    if clash or any("/" in n or n.startswith(".") for n in extra_files):
        raise ValueError(
            f"extra checkpoint file names must be plain and new, got {sorted(extra_files)}"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"ckpt-{step}"
    tmp = run_dir / f"{_TMP_PREFIX}{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_model(model, str(tmp / MODEL_FILE))
        payload = {
            "step": int(step),
            "optimizer": optimizer.state_dict(),
            "rng": rng_state(),
            **state,
        }
        with (tmp / STATE_FILE).open("wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _write_text(tmp / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True))
        for name, text in extra_files.items():
            _write_text(tmp / name, text)
        files = {
            f.name: {"sha256": file_digest(f), "bytes": f.stat().st_size}
            for f in sorted(tmp.iterdir())
        }
        _write_text(tmp / MANIFEST_FILE, json.dumps({"step": int(step), "files": files}, indent=1))
        if final.exists():  # re-saving a step: move the old copy aside, then swap
            old = run_dir / f"{_TMP_PREFIX}old-{step}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_text(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Load weights (and optimizer state) in place; return the rest of the state dict.

    ``verify``: check every file against the manifest first (``verify_checkpoint``). RNG states
    are returned under ``"rng"``, not applied: call :func:`set_rng_state` when the run is
    otherwise ready, so that nothing consumes random numbers after the restore.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    elif not is_complete(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete: needs {MODEL_FILE}, {STATE_FILE} and {CONFIG_FILE}"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        missing, unexpected = load_model(
            model, str(path / MODEL_FILE), strict=False, device=str(device)
        )
    except SafetensorError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {MODEL_FILE}: {e}") from None
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit this model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; resume with the same --model and --strategy"
        )
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state


def load_config_dict(path: str | Path) -> dict[str, Any]:
    return read_json(path, CONFIG_FILE)


def read_json(path: str | Path, name: str) -> Any:
    """JSON file ``name`` of checkpoint ``path``; None if the checkpoint has no such file."""
    f = Path(path) / name
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {name} is not JSON ({e})") from None


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints and stale temp dirs; return deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    run_dir = Path(run_dir)
    doomed = list_checkpoints(run_dir)[:-keep_last]
    if run_dir.is_dir():
        doomed += [p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(_TMP_PREFIX)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
