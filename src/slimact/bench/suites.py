"""Benchmark suites: which (model, strategy-or-anchor) points ``slimact bench`` measures, and how.

Four suites are registered (their building blocks, :class:`~slimact.bench.cases.Suite`,
:class:`~slimact.bench.cases.ModelCase` and :class:`~slimact.bench.cases.BenchPoint`, live in
:mod:`slimact.bench.cases`):

* ``quick``: a few minutes on a 2-core CPU (llama-20m with every point, the other models with a
  subset, llama-20m at a real 32,000-token vocabulary with a few points; 2 x 128 tokens, ~20
  training steps);
* ``full``: about an hour on the same CPU (every model x every point, more steps);
* ``gpu``: one lent GPU in one call of at most 8 minutes: llama-350m with bf16 weights, 8 x 1024
  tokens, V = 32,000; eager ``none``, ``torch.utils.checkpoint``, per-block and whole-model
  torch.compile at several ``activation_memory_budget`` values, slimact's eager and
  ``compile=True`` points, each timed against ``none`` right after it is measured (no training
  run), then the max batch of the best points under 40 GiB; a time budget and a per-point
  limit keep it in its call, the points in priority order;
* ``compiled``: torch.compile's budgets 0.5 / 0.25 / 0.1 beside slimact's compiled points.
"""

from __future__ import annotations

from slimact.bench.cases import (
    ANCHOR_PREFIX,
    ANCHORS,
    BenchPoint,
    MaxBatchSpec,
    ModelCase,
    Suite,
)
from slimact.registry import compiled_spec

STRATEGIES = (
    "none",
    "recompute",
    "invact",
    "int4",
    "prac",
    "cola-m",
    "auto@10%",
    "auto@25%",
    "auto@50%",
    "invact+int4",
    "invact+recompute",
)
ANCHOR_POINTS = tuple(ANCHOR_PREFIX + a for a in ANCHORS)
ALL_POINTS = STRATEGIES + ANCHOR_POINTS


def _case(model: str, points: tuple[str, ...], **kw) -> ModelCase:
    return ModelCase(model=model, points=tuple(BenchPoint(p) for p in points), **kw)


VOCAB = 32_000  # a real tokenizer's vocabulary (LLaMA's): the loss head's true weight
VOCAB_LARGE = 128_256  # Llama 3's: the head holds two thirds of none's saved bytes
VOCAB_QUICK_POINTS = (
    "none",
    "recompute",
    "invact",
    "int4",
    "auto@25%",
    "anchor:torch-checkpoint",
    "anchor:compile-budget",
)


def _quick() -> Suite:
    return Suite(
        name="quick",
        description="a few minutes on a 2-core CPU: llama-20m with every point, the other "
        "models with a subset, llama-20m at a 32,000-token vocabulary; 2 x 128 tokens",
        cases=(
            _case("llama-20m", ALL_POINTS, batch=2, seq=128, timing_steps=5, train_steps=20),
            _case(
                "llama-20m",
                VOCAB_QUICK_POINTS,
                batch=2,
                seq=128,
                timing_steps=3,
                train_steps=4,
                eval_batches=1,
                vocab_size=VOCAB,
            ),
            _case(
                "cola-20m",
                (
                    "none",
                    "recompute",
                    "invact",
                    "int4",
                    "cola-m",
                    "auto@25%",
                    "anchor:torch-checkpoint",
                ),
                batch=2,
                seq=128,
                timing_steps=5,
                train_steps=20,
            ),
            _case(
                "gpt2-124m",
                ("none", "recompute", "invact", "int4"),
                batch=2,
                seq=128,
                timing_steps=3,
                train_steps=5,
                eval_batches=2,
                lr=6e-4,
            ),
            _case(
                "hf-bert-base",
                ("none", "recompute", "invact", "anchor:torch-checkpoint"),
                batch=2,
                seq=128,
                timing_steps=3,
                train_steps=5,
                eval_batches=2,
                lr=3e-4,
            ),
        ),
        expected_minutes=10,
    )


def _full() -> Suite:
    return Suite(
        name="full",
        description="about an hour on a 2-core CPU: every model x every point",
        cases=(
            _case("llama-20m", ALL_POINTS, batch=4, seq=128, timing_steps=5, train_steps=60),
            _case(
                "llama-20m",
                ALL_POINTS,
                batch=4,
                seq=128,
                timing_steps=5,
                train_steps=10,
                eval_batches=2,
                vocab_size=VOCAB,
            ),
            _case(
                "llama-20m",
                ("none", "recompute", "int4", "chunked-ce", "auto@10%", "anchor:torch-checkpoint"),
                batch=2,
                seq=128,
                timing_steps=3,
                train_steps=4,
                eval_batches=1,
                vocab_size=VOCAB_LARGE,
            ),
            _case("cola-20m", ALL_POINTS, batch=4, seq=128, timing_steps=5, train_steps=60),
            _case(
                "gpt2-124m",
                ALL_POINTS,
                batch=2,
                seq=128,
                timing_steps=3,
                train_steps=10,
                eval_batches=2,
                lr=6e-4,
            ),
            _case(
                "hf-bert-base",
                ALL_POINTS,
                batch=2,
                seq=128,
                timing_steps=3,
                train_steps=10,
                eval_batches=2,
                lr=3e-4,
            ),
        ),
        expected_minutes=60,
    )


# The gpu suite: issue-style table of one model on one lent GPU in one device call (<= 8 min).
GPU_MODEL, GPU_BATCH, GPU_SEQ = "llama-350m", 8, 1024
GPU_BLOCK_BUDGETS = (1.0, 0.5, 0.25, 0.1, 0)
# compile=True auto's grid, reduced for the time a lent GPU gives: the full grid (7 budgets x 3
# traced codecs) compiles 21 block graphs to profile, the most expensive part of the run; these
# 4 budgets x 2 codecs (8 graphs) keep the options its 25% and 10% plans are made of (compile's
# cut at 0.25 / 0.1 / 0 and INT8 on what it keeps) and 1.0, the fastest; the profile is cached,
# so the second budget solves the first one's profile without compiling it again
GPU_AUTO_GRID = ",budgets=1/0.25/0.1/0,codecs=none/int8"
GPU_AUTO_FIRST = compiled_spec("auto@10%") + GPU_AUTO_GRID
GPU_POINTS = (
    # order = priority: a run cut short by its time budget loses the last points
    "none",
    "anchor:torch-checkpoint",
    "recompute",
    "invact",
    "chunked-ce",
    "int4",
    "auto@25%",
    *(f"anchor:compile-block@{b:g}" for b in GPU_BLOCK_BUDGETS),
    compiled_spec("recompute"),
    compiled_spec("int8"),
    GPU_AUTO_FIRST,
    "anchor:compile-budget@0.1",  # whole-model compiles: the slowest to compile
    compiled_spec("auto@25%") + GPU_AUTO_GRID,
    compiled_spec("invact"),
    "anchor:compile-budget@1",
)
GPU_MAXBATCH = (  # in priority order too: none (the ratio's base, cheap), then slimact's lead
    "none",
    GPU_AUTO_FIRST,
    "anchor:compile-block@0",
    "anchor:torch-checkpoint",
)


def _gpu() -> Suite:
    return Suite(
        name="gpu",
        description=f"one lent GPU, one call of <= 8 minutes: {GPU_MODEL} with bf16 weights, "
        f"{GPU_BATCH} x {GPU_SEQ} tokens at V = {VOCAB:,}, eager none, torch's checkpoint and "
        "compile anchors, slimact eager and compile=True, each against eager none (pairs of "
        "interleaved rounds, no training run); max batch under 40 GiB for the best points",
        cases=(
            _case(
                GPU_MODEL,
                GPU_POINTS,
                batch=GPU_BATCH,
                seq=GPU_SEQ,
                vocab_size=VOCAB,
                timing_steps=5,
                warmup=1,
                train_steps=0,
                timing="pairs",
                point_timeout_s=150,
                # the first compile=True auto profiles its grid (8 block graphs compiled): the
                # second reads the cached profile
                point_timeouts=((GPU_AUTO_FIRST, 240),),
                maxbatch=MaxBatchSpec(GPU_MAXBATCH, cap="40GiB", probes=3, reserve_s=100),
            ),
        ),
        device="cuda",
        dtype="bfloat16",
        time_budget_s=450,  # the run itself; process start and imports come on top
        summary=True,
        expected_minutes=8,
    )


COMPILED_POINTS = (  # compiled-auto at about the bytes each compile anchor keeps on llama-20m
    "none",
    "compiled-none",
    "invact@ops=none+compiled-none",  # what invact is under --compile: norms only
    "compiled-int8",
    *(f"anchor:compile-budget@{b}" for b in (0.5, 0.25, 0.1)),
    *(f"compiled-auto@{p}%" for p in (38, 19, 10, 7.5)),
)


def _compiled() -> Suite:
    return Suite(
        name="compiled",
        description="torch.compile on a 2-core CPU: compile's activation_memory_budget at 0.5, "
        "0.25, 0.1 beside slimact's compiled blocks and compiled planner (llama-20m, 4 x 256)",
        cases=(
            _case("llama-20m", COMPILED_POINTS, batch=4, seq=256, timing_steps=7, train_steps=10),
        ),
        expected_minutes=30,
    )


_FACTORIES = {"quick": _quick, "full": _full, "gpu": _gpu, "compiled": _compiled}


SUITES: dict[str, Suite] = {name: make() for name, make in _FACTORIES.items()}


def suite_names() -> list[str]:
    return list(_FACTORIES)


def get_suite(name: str) -> Suite:
    """The registered suite ``name``; an unknown name is a ValueError listing the valid ones."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(suite_names())}")
    return SUITES[name]
