"""Distributed training: 2 CPU processes (gloo) against the single-process step, and torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import slimact
from slimact import dist as sdist
from slimact.state import state_of
from slimact.train.checkpoint import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed+gloo"
)

STRATEGIES = ("none", "invact", "int4")
WORLD = 2
B, S = 4, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    tok = torch.randint(0, 257, (B, S + 1), generator=gen)
    return tok[:, :-1], tok[:, 1:]


def _model(strategy: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return slimact.apply(slimact.build_model("llama-tiny"), strategy)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    sdist.init("gloo", timeout_s=120)
    try:
        _work(rank, out)  # its DDP wrappers die with its frame, before the group does
    finally:
        sdist.teardown()


def _work(rank: int, out: str) -> None:
    """A DDP wrapper still alive at ``destroy_process_group`` drops the group's last reference
    when it dies: the group's destructor joins gloo's threads holding the GIL, which a thread
    freeing a finished work's Python state waits for (a deadlock at exit, seen under load)."""
    x, y = _batch()
    result = {}
    for strategy in STRATEGIES:
        model = _model(strategy)
        ddp = sdist.wrap(model, "ddp")
        ddp(sdist.shard(x), targets=sdist.shard(y)).loss.backward()
        result[strategy] = _grads(model)
    # PRAC: every rank must encode with the same subspaces after sync_prac
    model = _model("prac")
    sdist.sync_prac(model)
    ddp = sdist.wrap(model, "ddp")
    ddp(sdist.shard(x), targets=sdist.shard(y)).loss.backward()
    state = state_of(model).stateful["prac"]
    result["prac_p"] = {k: c.p.clone() for k, c in state.codecs.items()}
    result["prac_grads"] = _grads(model)
    # the meter on an FSDP2 model: its sharded parameters are DTensors (no storage of their
    # own: reading one crashed `slimact train --dist fsdp` before)
    fsdp = sdist.wrap(_model("invact"), "fsdp")
    with slimact.measure(fsdp) as m:
        fsdp(sdist.shard(x), targets=sdist.shard(y)).loss.backward()
    result["fsdp_meter_bytes"] = m.report.total_bytes
    torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _single(strategy: str, x, y) -> dict[str, torch.Tensor]:
    model = _model(strategy)
    model(x, targets=y).loss.backward()
    return _grads(model)


def _close(a: dict, b: dict, rtol=1e-5, atol=1e-6) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ddp_step_equals_single_process(ranks, strategy):
    x, y = _batch()
    _close(ranks[0][strategy], ranks[1][strategy], rtol=0, atol=0)  # all-reduced: identical
    # exact reference: the mean of the per-shard single-process gradients (what DDP computes)
    shards = [
        _single(strategy, sdist.shard(x, r, WORLD), sdist.shard(y, r, WORLD)) for r in range(2)
    ]
    mean = {n: (shards[0][n] + shards[1][n]) / 2 for n in shards[0]}
    _close(ranks[0][strategy], mean)
    full = _single(strategy, x, y)
    if strategy in ("none", "invact"):  # per-row ops: the same as the global batch
        _close(ranks[0][strategy], full)
    else:  # int4's outlier channels / group scales see B/W rows per rank instead of B
        cos = min(
            float(torch.nn.functional.cosine_similarity(a.flatten(), full[n].flatten(), dim=0))
            for n, a in ranks[0][strategy].items()
            if float(full[n].norm()) > 1e-6
        )
        assert cos > 0.99, cos


def test_prac_ranks_share_subspaces(ranks):
    p0, p1 = ranks[0]["prac_p"], ranks[1]["prac_p"]
    assert p0 and p0.keys() == p1.keys()
    for k in p0:
        torch.testing.assert_close(p0[k], p1[k], rtol=0, atol=0)
    _close(ranks[0]["prac_grads"], ranks[1]["prac_grads"], rtol=0, atol=0)


def test_meter_reads_an_fsdp2_model(ranks):
    assert ranks[0]["fsdp_meter_bytes"] > 0 and ranks[1]["fsdp_meter_bytes"] > 0


def test_shard_rows_and_errors():
    x = torch.arange(12).view(6, 2)
    assert sdist.shard(x, 1, 3).tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="not divisible by world size 4"):
        sdist.shard(x, 0, 4)
    with pytest.raises(ValueError, match="rank must be in"):
        sdist.shard(x, 3, 3)
    with pytest.raises(ValueError, match="dist mode must be one of"):
        sdist.wrap(torch.nn.Linear(2, 2), "zero3")
    assert sdist.mean_across(2.5) == 2.5  # no process group: identity


def test_dist_mode_validated():
    from slimact.train import TrainConfig

    with pytest.raises(ValueError, match="dist must be one of none, ddp, fsdp"):
        TrainConfig(model="llama-tiny", dist="horovod")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_train_rank0_logs_and_checkpoint_loads(tmp_path, mode):
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        "-m", "slimact", "train", "--model", "llama-tiny", "--strategy", "invact",
        "--steps", "2", "--batch", "4", "--seq", "32", "--dist", mode, "--out", str(out),
        "--no-progress", "--eval-every", "0", "--eval-batches", "1", "--threads", "1",
        "--baseline", "off",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("slimact train") == 1  # the summary: rank 0 only
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in lines] == [1, 2]  # one writer
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "ckpt-2"
    plain = slimact.build_model("llama-tiny")  # full weights load into an unwrapped model
    load_checkpoint(ckpt, plain)
