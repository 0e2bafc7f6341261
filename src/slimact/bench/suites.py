"""Benchmark suites: which (model, strategy-or-anchor) points ``slimact bench`` measures, and how.

A :class:`Suite` is a list of :class:`ModelCase` (a model, its batch shape, timing and training
steps, and its :class:`BenchPoint` list). Every config is a frozen dataclass validated in
``__post_init__``; errors name the bad value and the valid ones. Four suites are registered:

* ``quick``: a few minutes on a 2-core CPU (llama-20m with every point, the other models with a
  subset, llama-20m at a real 32,000-token vocabulary with a few points; 2 x 128 tokens, ~20
  training steps);
* ``full``: about an hour on the same CPU (every model x every point, more steps);
* ``gpu``: for a lent GPU (cuda, bf16 autocast, larger batches, longer training);
* ``compiled``: torch.compile's budgets 0.5 / 0.25 / 0.1 beside slimact's compiled points.

Points: a strategy spec as ``slimact.apply`` takes it (``"invact+int4"``, ``"auto@25%"``), or an
anchor (plain PyTorch, see :mod:`slimact.bench.anchors`) written ``"anchor:<name>"``.

A case normally runs on the byte corpus (257-token vocabulary). With ``vocab_size`` set it runs at
that vocabulary on random token ids (memory and speed do not depend on the ids; the loss curve
then only checks that every point trains alike), and is labelled ``"<model> (V=<vocab>)"``: the
label is what tables, results and ``--only-models`` use to tell it from the byte-vocabulary case.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slimact.models import get_spec, model_names
from slimact.strategies import resolve

ANCHORS = ("torch-checkpoint", "compile-budget", "save-on-cpu")
HF_MODELS = ("hf-bert-base",)  # transformers.BertForMaskedLM(BertConfig()), random weights
DEVICES = ("cpu", "cuda")
MASK_TOKEN_ID = 103  # BERT's [MASK]
ANCHOR_PREFIX = "anchor:"


@dataclass(frozen=True)
class BenchPoint:
    """One point of a model case: a strategy spec, or ``anchor:<name>``."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a bench point needs a non-empty name, got {self.name!r}")
        if self.is_anchor:
            base, at, arg = self.anchor.partition("@")
            if base not in ANCHORS:
                raise ValueError(
                    f"unknown anchor {self.anchor!r}; valid anchors: "
                    + ", ".join(ANCHOR_PREFIX + a for a in ANCHORS)
                )
            if at and (base != "compile-budget" or not _fraction(arg)):
                raise ValueError(
                    f"anchor {self.anchor!r}: only compile-budget takes '@<budget>', a number "
                    "in (0, 1] (e.g. anchor:compile-budget@0.25)"
                )
        else:
            resolve(self.name)  # unknown strategy names fail here, listing the valid ones

    @property
    def is_anchor(self) -> bool:
        return self.name.startswith(ANCHOR_PREFIX)

    @property
    def anchor(self) -> str:
        return self.name[len(ANCHOR_PREFIX) :] if self.is_anchor else ""

    @property
    def kind(self) -> str:
        return "anchor" if self.is_anchor else "strategy"


def _fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def _max_seq(model: str) -> int:
    if model in HF_MODELS:
        return 512  # BertConfig().max_position_embeddings
    return int(get_spec(model).config.max_seq_len)


@dataclass(frozen=True)
class ModelCase:
    """One model, its batch shape, and the points measured on it (``none`` first, always)."""

    model: str
    points: tuple[BenchPoint, ...]
    batch: int = 2
    seq: int = 128
    timing_steps: int = 3
    warmup: int = 1
    train_steps: int = 20
    eval_batches: int = 4
    lr: float = 3e-3
    vocab_size: int | None = None  # None: the byte tokenizer's 257 tokens and the corpus

    def __post_init__(self) -> None:
        valid = [*model_names(), *HF_MODELS]
        if self.model not in valid:
            raise ValueError(f"unknown model {self.model!r}; valid models: {', '.join(valid)}")
        pts = tuple(p if isinstance(p, BenchPoint) else BenchPoint(p) for p in self.points)
        object.__setattr__(self, "points", pts)
        names = [p.name for p in pts]
        if not names or names[0] != "none":
            raise ValueError(
                f"model case {self.model!r}: the first point must be 'none' (the baseline every "
                f"ratio is taken against), got {names[:1]}"
            )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model case {self.model!r}: duplicate points {dup}")
        for name in ("batch", "timing_steps", "train_steps", "eval_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        max_seq = _max_seq(self.model)
        if not isinstance(self.seq, int) or not 2 <= self.seq <= max_seq:
            raise ValueError(f"seq must be in [2, {max_seq}] for {self.model!r}, got {self.seq!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        v = self.vocab_size
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 2):
            raise ValueError(
                f"vocab_size must be an int >= 2 (or None for the byte vocabulary), got {v!r}"
            )
        if v is not None and self.model in HF_MODELS and v <= MASK_TOKEN_ID:
            raise ValueError(
                f"vocab_size of {self.model!r} must exceed its [MASK] id {MASK_TOKEN_ID}, got {v}"
            )

    @property
    def label(self) -> str:
        """The case's name in results and tables: the model, with ``(V=...)`` when set."""
        return self.model if self.vocab_size is None else f"{self.model} (V={self.vocab_size})"

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


@dataclass(frozen=True)
class Suite:
    """A named list of model cases run in one process on one device."""

    name: str
    description: str
    cases: tuple[ModelCase, ...]
    device: str = "cpu"
    bf16: bool = False  # autocast to bfloat16 (CUDA only)
    seed: int = 0
    compile_budget: float = 0.5  # torch._functorch.config.activation_memory_budget
    expected_minutes: float | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"suite name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "cases", tuple(self.cases))
        if not self.cases:
            raise ValueError(f"suite {self.name!r} has no model cases")
        labels = [c.label for c in self.cases]
        dup = sorted({m for m in labels if labels.count(m) > 1})
        if dup:
            raise ValueError(f"suite {self.name!r}: model cases listed twice: {dup}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.bf16 and self.device != "cuda":
            raise ValueError("bf16=True needs device 'cuda' (CPU runs are fp32)")
        if not 0 < self.compile_budget <= 1:
            raise ValueError(f"compile_budget must be in (0, 1], got {self.compile_budget!r}")

    def config(self) -> dict:
        """A JSON-able description of the suite (what the results file records)."""
        return {
            "name": self.name,
            "description": self.description,
            "device": self.device,
            "bf16": self.bf16,
            "seed": self.seed,
            "compile_budget": self.compile_budget,
            "expected_minutes": self.expected_minutes,
            "cases": [
                {
                    "case": c.label,
                    "model": c.model,
                    "vocab_size": c.vocab_size,
                    "points": [p.name for p in c.points],
                    "batch": c.batch,
                    "seq": c.seq,
                    "timing_steps": c.timing_steps,
                    "warmup": c.warmup,
                    "train_steps": c.train_steps,
                    "eval_batches": c.eval_batches,
                    "lr": c.lr,
                }
                for c in self.cases
            ],
        }

    def select(self, models: list[str] | None = None, points: list[str] | None = None) -> Suite:
        """This suite restricted to some models and/or points (``none`` is always kept).

        A model name selects all its cases; a case label (``"llama-20m (V=32000)"``) just that
        one."""
        cases = list(self.cases)
        if models:
            known = list(dict.fromkeys(k for c in cases for k in (c.model, c.label)))
            bad = [m for m in models if m not in known]
            if bad:
                raise ValueError(
                    f"--only-models {bad} not in suite {self.name!r}; its models: "
                    f"{', '.join(known)}"
                )
            cases = [c for c in cases if c.model in models or c.label in models]
        if points:
            known_pts = sorted({p.name for c in cases for p in c.points})
            bad = [p for p in points if p not in known_pts]
            if bad:
                raise ValueError(
                    f"--only-strategies {bad} not in suite {self.name!r}; its points: "
                    f"{', '.join(known_pts)}"
                )
            keep = {"none", *points}
            cases = [replace(c, points=tuple(p for p in c.points if p.name in keep)) for c in cases]
            cases = [c for c in cases if len(c.points) > 1]
            if not cases:
                raise ValueError(f"no model of suite {self.name!r} has the points {points}")
        return replace(self, cases=tuple(cases))


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
    "invact+compiled-none",
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
