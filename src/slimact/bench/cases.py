"""What a benchmark suite is made of: points, model cases, suites (``slimact.bench.suites``
registers the suites themselves).

A :class:`Suite` is a list of :class:`ModelCase` (a model, its batch shape, timing and training
steps, and its :class:`BenchPoint` list). Every config is a frozen dataclass validated in
``__post_init__``; errors name the bad value and the valid ones.

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
from slimact.registry import compiled_spec
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

    def compiled(self) -> Suite:
        """``slimact bench SUITE --compile``: every strategy point in its compiled form
        (``registry.compiled_spec``: ``auto@25%`` -> ``compiled-auto@25%``, ``int8`` ->
        ``compiled-int8``, ``invact`` -> ``invact@ops=none+compiled-none``), beside eager ``none`` (the
        baseline every ratio is taken against), ``compiled-none`` and the anchors. A strategy
        with no compiled form (e.g. ``pac``) is left out, and the description says so."""
        cases, dropped = [], set()
        for c in self.cases:
            names = ["none", "compiled-none"]
            for p in c.points[1:]:
                try:
                    name = p.name if p.is_anchor else compiled_spec(p.name)
                except ValueError:
                    dropped.add(p.name)
                    continue
                if name not in names:
                    names.append(name)
            cases.append(replace(c, points=tuple(names)))
        note = "; compiled forms (--compile)"
        if dropped:
            note += f"; left out (no compiled form): {', '.join(sorted(dropped))}"
        return replace(
            self, name=f"{self.name}-compiled", description=self.description + note, cases=cases
        )
