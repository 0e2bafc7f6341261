"""Benchmark suites: which (model, strategy-or-anchor) points ``slimact bench`` measures, and how.

Four suites are registered (their building blocks, :class:`~slimact.bench.cases.Suite`,
:class:`~slimact.bench.cases.ModelCase` and :class:`~slimact.bench.cases.BenchPoint`, live in
:mod:`slimact.bench.cases`):

* ``quick``: a few minutes on a 2-core CPU (llama-20m with every point, the other models with a
  subset, llama-20m at a real 32,000-token vocabulary with a few points; 2 x 128 tokens, ~20
  training steps);
* ``full``: about an hour on the same CPU (every model x every point, more steps);
* ``gpu``: for a lent GPU (cuda, bf16 autocast, larger batches, longer training);
* ``compiled``: torch.compile's budgets 0.5 / 0.25 / 0.1 beside slimact's compiled points.
"""

from __future__ import annotations

from slimact.bench.cases import ANCHOR_PREFIX, ANCHORS, BenchPoint, ModelCase, Suite

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


def _gpu() -> Suite:
    return Suite(
        name="gpu",
        description="one lent GPU: cuda, bf16 autocast, every model x every point, larger "
        "batches and longer training",
        cases=(
            _case("llama-20m", ALL_POINTS, batch=16, seq=512, timing_steps=10, train_steps=200),
            _case("cola-20m", ALL_POINTS, batch=16, seq=512, timing_steps=10, train_steps=200),
            _case(
                "gpt2-124m",
                ALL_POINTS,
                batch=8,
                seq=1024,
                timing_steps=10,
                train_steps=100,
                lr=6e-4,
            ),
            _case(
                "hf-bert-base",
                ALL_POINTS,
                batch=16,
                seq=512,
                timing_steps=10,
                train_steps=100,
                lr=3e-4,
            ),
        ),
        device="cuda",
        bf16=True,
        expected_minutes=25,
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
