"""torch.distributed for slimact: process groups, data sharding, DDP / FSDP2 wrapping, PRAC sync.

slimact runs on PyTorch's own engine: ``torchrun --nproc_per_node N -m slimact train --dist ddp``
(or ``fsdp``). :func:`init` reads torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and opens a process group: ``nccl`` when CUDA is
available, ``gloo`` on CPU.

Why strategies survive wrapping: they are applied to the bare model *before* :func:`wrap`. They
patch instance forwards and install the site router around the root forward; DDP and FSDP2 call
that same root ``__call__`` (DDP as ``module``, FSDP2 in place), so every save still goes through
the router and the policy. Gradients are reduced after backward, where slimact does nothing.

Data sharding: ``batch`` is the *global* batch. Every rank draws the same global batch (same
loader, same seed, same position) and keeps its rows ``[r·B/W, (r+1)·B/W)`` (:func:`shard`).
DDP averages the ranks' gradients of their mean losses, which equals the gradient of the global
batch's mean loss, so one DDP step is the single-process step on the same batch (tested). The
loader state is identical on every rank, so checkpoints need it once.

Seeding: every rank seeds with the run's seed, so models start identical (DDP broadcasts rank
0's weights anyway) and random strategies agree. PRAC's random subspace Q2 comes from a generator
seeded per site with the run's seed, but its principal subspace Q1 is the SVD of the *local*
activations, and Q2 is drawn in Q1's complement, so ranks would drift apart; :func:`sync_prac`
makes every rank use rank 0's (Q1, Q2): after each subspace update (all ranks update at the same
clock ticks), the codec broadcasts them from rank 0 before encoding with them.

Plans (strategy ``auto``): each rank plans lazily on its own rows, so the first plans may
differ; ``slimact.planner.evolve.PlanEvolver`` tracks from step 1 on every rank, gathers every
rank's tracked figures on rank 0, which re-solves and broadcasts its plan, so every rank runs
the same plan from step 2 on, and installs each later plan at the same step; ``BudgetCheck``
judges the largest measured bytes over ranks, so ranks re-plan together or not at all.

Logging and checkpoints: only rank 0 writes metrics and files (:func:`is_main`); checkpoints are
rank-0 ``model.safetensors`` (full, unsharded weights: DDP's are replicated; FSDP2's are gathered
with ``torch.distributed.checkpoint.state_dict``), so a checkpoint loads into a plain model.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from slimact import sites
from slimact.state import peek

MODES = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_torchrun_env(mode: str = "ddp") -> None:
    """``ValueError`` naming ``--dist mode`` and the missing variables when not under torchrun
    (a usage error, reported by the CLI as one line; checked before any process group opens)."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(
            f"--dist {mode} needs torchrun's environment ({', '.join(missing)} not set): launch "
            f"with `torchrun --nproc_per_node N -m slimact train --dist {mode} ...`, or use "
            "--dist none for one process"
        )


def init(backend: str | None = None, timeout_s: float = 300.0) -> DistInfo:
    """Open the default process group from torchrun's environment (no-op if already open)."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        check_torchrun_env()
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return info()


def info() -> DistInfo:
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    return DistInfo(
        dist.get_rank(),
        dist.get_world_size(),
        int(os.environ.get("LOCAL_RANK", "0")),
        dist.get_backend(),
    )


def teardown() -> None:
    """Destroy the default group, once what no longer references it is freed: a DDP wrapper
    left in a reference cycle would otherwise drop the group's last reference later, and the
    group's destructor then joins gloo's threads while holding the GIL, which a thread freeing
    a finished work's Python state waits for (a deadlock at exit)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def is_main() -> bool:
    return info().is_main


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shard(x: torch.Tensor, rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    """Rows ``[r·B/W, (r+1)·B/W)`` of a global batch ``x`` (B must divide by W)."""
    di = info()
    rank = di.rank if rank is None else rank
    world_size = di.world_size if world_size is None else world_size
    b = x.shape[0]
    if b % world_size:
        raise ValueError(
            f"global batch {b} is not divisible by world size {world_size}; use --batch a "
            f"multiple of {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    n = b // world_size
    return x[rank * n : (rank + 1) * n]


def mean_across(value: float, device: torch.device | str = "cpu") -> float:
    """Mean of a float over ranks (the identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def wrap(model: nn.Module, mode: str, device: torch.device | str = "cpu") -> nn.Module:
    """DDP (``mode="ddp"``) or FSDP2 (``"fsdp"``: ``fully_shard`` per block, then the root)."""
    if mode not in MODES:
        raise ValueError(f"dist mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return model
    if not dist.is_initialized():
        raise RuntimeError(f"--dist {mode} needs a process group: call slimact.dist.init() first")
    device = torch.device(device)
    if mode == "ddp":
        ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    try:  # optional: FSDP2's fully_shard is torch >= 2.6 (slimact takes torch >= 2.4)
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # torch < 2.6
        raise RuntimeError(f"--dist fsdp needs torch.distributed.fsdp.fully_shard: {e}") from e
    modules = dict(model.named_modules())
    for path in sites.block_paths(model):
        fully_shard(modules[path])
    fully_shard(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model (DDP's ``module``; FSDP2 shards in place)."""
    return getattr(model, "module", model)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU weights (a collective under FSDP2: call it on every rank)."""
    inner = unwrap(model)
    if any(type(p).__name__ == "DTensor" for p in inner.parameters()):
        # FSDP2 only: torch.distributed.checkpoint needs a torch built with distributed
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(inner, options=opts)
    return {k: v.detach().cpu() for k, v in inner.state_dict().items()}


# ----------------------------------------------------------------------------- PRAC
def _synced_update(codec, orig, x2d: torch.Tensor, t: int, *args, **kwargs):
    before = (codec.q1_step, codec.q2_step)
    out = orig(x2d, t, *args, **kwargs)
    if (codec.q1_step, codec.q2_step) == before or not dist.is_initialized():
        return out
    q1 = codec.q1.contiguous()
    dist.broadcast(q1, src=0)
    codec.q1 = q1
    if codec.regenerates:  # Q2 is rebuilt from (Q1, seed): broadcast the seed
        seed = torch.tensor([codec.q2_seed], dtype=torch.int64, device=q1.device)
        dist.broadcast(seed, src=0)
        codec._set_q2(int(seed))
    else:
        q2 = codec.q2.contiguous()
        dist.broadcast(q2, src=0)
        codec._set_q2(q2)
    return out


def _sync_codec(codec) -> None:
    # both update paths: the checked encode's and the deferred one's (``codecs.prac``)
    for name in ("_update", "_update_deferred"):
        if name not in codec.__dict__:
            setattr(codec, name, functools.partial(_synced_update, codec, getattr(codec, name)))


def sync_prac(model: nn.Module) -> bool:
    """Make every rank encode with rank 0's PRAC subspaces (see the module docstring).

    Returns False when no PRAC-family strategy is applied. Codecs are built on the first forward,
    so the state's ``codec_for`` is wrapped to sync each new codec as it is created.
    """
    st = peek(unwrap(model))
    state = st.stateful.get("prac") if st is not None else None
    if state is None:
        return False
    for codec in state.codecs.values():
        _sync_codec(codec)
    if "codec_for" not in state.__dict__:
        orig = state.codec_for

        def codec_for(*args, **kwargs):
            codec = orig(*args, **kwargs)
            if codec is not None:
                _sync_codec(codec)
            return codec

        state.codec_for = codec_for
    return True


__all__ = [
    "MODES",
    "DistInfo",
    "barrier",
    "env_world_size",
    "full_state_dict",
    "info",
    "init",
    "is_main",
    "mean_across",
    "shard",
    "sync_prac",
    "teardown",
    "unwrap",
    "wrap",
]
