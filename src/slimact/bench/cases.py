"""What a benchmark suite is made of: points, model cases, suites (``slimact.bench.suites``
registers the suites themselves).

A :class:`Suite` is a list of :class:`ModelCase` (a model, its batch shape, timing and training
steps, and its :class:`BenchPoint` list). Every config is a frozen dataclass validated in
``__post_init__``; errors name the bad value and the valid ones.

Points: a strategy spec as ``slimact.apply`` takes it (``"invact+int4"``, ``"auto@25%"``), or an
anchor (plain PyTorch, see :mod:`slimact.bench.anchors`) written ``"anchor:<name>"``.

A case times its points either all together after measuring them (``timing="rounds"``) or each
against ``none`` right after it is measured (``timing="pairs"``: a run cut short still has every
finished point's step time, and only ``none``'s model stays alive). ``point_timeout_s`` limits
each point, ``Suite.time_budget_s`` the whole run (:mod:`slimact.bench.deadline`), and
:class:`MaxBatchSpec` asks for the largest batch of some points under a memory cap after the
table (:mod:`slimact.bench.maxbatch`).

A case normally runs on the byte corpus (257-token vocabulary). With ``vocab_size`` set it runs at
that vocabulary on random token ids (memory and speed do not depend on the ids; the loss curve
then only checks that every point trains alike), and is labelled ``"<model> (V=<vocab>)"``: the
label is what tables, results and ``--only-models`` use to tell it from the byte-vocabulary case.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slimact import spec
from slimact.bench.maxbatch import parse_cap
from slimact.models import get_spec, model_names
from slimact.registry import compiled_spec
from slimact.strategies import resolve

ANCHORS = ("torch-checkpoint", "compile-budget", "compile-block", "save-on-cpu")
BUDGET_ANCHORS = {"compile-budget": (0.0, False), "compile-block": (0.0, True)}  # (low, low ok)
TIMING_MODES = ("rounds", "pairs")
DTYPES = ("float32", "bfloat16")
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
            part = spec.parse_part(self.anchor)
            base, arg = part.name, part.get("region")
            if base not in ANCHORS:
                raise ValueError(
                    f"unknown anchor {self.anchor!r}; valid anchors: "
                    + ", ".join(ANCHOR_PREFIX + a for a in ANCHORS)
                )
            given = part.settings or part.budget is not None
            if given and (
                base not in BUDGET_ANCHORS
                or arg is None
                or len(part.settings) > 1
                or not _fraction(arg, *BUDGET_ANCHORS[base])
            ):
                raise ValueError(
                    f"anchor {self.anchor!r}: only compile-budget and compile-block take "
                    "'@<budget>', a number in (0, 1] for compile-budget, [0, 1] for "
                    "compile-block (e.g. anchor:compile-budget@0.25, anchor:compile-block@0)"
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


def _fraction(text: str, low: float = 0.0, low_ok: bool = False) -> bool:
    try:
        v = float(text)
    except ValueError:
        return False
    return (low <= v if low_ok else low < v) and v <= 1


def _max_seq(model: str) -> int:
    if model in HF_MODELS:
        return 512  # BertConfig().max_position_embeddings
    return int(get_spec(model).config.max_seq_len)


@dataclass(frozen=True)
class MaxBatchSpec:
    """The largest batch of some points of a case under a memory cap, measured after its table.

    ``points``: names of the case's points; ``cap``: a memory size ('40GiB'); ``probes``: peak
    measurements per point at most (each a batch predicted from the peaks measured so far, see
    :func:`slimact.bench.maxbatch.predicted_search`); ``limit``: the largest batch tried;
    ``include_static``: the cap holds the weights and AdamW's two moments too;
    ``reserve_s``: seconds of the suite's time budget held back for this phase."""

    points: tuple[str, ...]
    cap: str | int = "40GiB"
    probes: int = 3
    limit: int = 4096
    include_static: bool = True
    reserve_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple(self.points))
        if not self.points or not all(isinstance(p, str) and p for p in self.points):
            raise ValueError(f"MaxBatchSpec.points must name points, got {self.points!r}")
        parse_cap(self.cap)  # a bad cap fails here, saying what a cap looks like
        for name in ("probes", "limit"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MaxBatchSpec.{name} must be an int >= 1, got {v!r}")
        if not self.reserve_s >= 0:
            raise ValueError(f"MaxBatchSpec.reserve_s must be >= 0, got {self.reserve_s!r}")

    @property
    def cap_bytes(self) -> int:
        return parse_cap(self.cap)

    def config(self) -> dict:
        return {
            "points": list(self.points),
            "cap": self.cap,
            "cap_bytes": self.cap_bytes,
            "probes": self.probes,
            "limit": self.limit,
            "include_static": self.include_static,
            "reserve_s": self.reserve_s,
        }


@dataclass(frozen=True)
class ModelCase:
    """One model, its batch shape, and the points measured on it (``none`` first, always).

    ``train_steps=0``: no training run (no loss curve, no ``loss@N``); ``timing``: 'rounds' or
    'pairs' (module docstring); ``point_timeout_s``: each point's limit in seconds (None: none),
    ``point_timeouts``: (point, seconds) pairs overriding it for some points;
    ``maxbatch``: a :class:`MaxBatchSpec` over some of its points (None: no max-batch phase)."""

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
    timing: str = "rounds"
    point_timeout_s: float | None = None
    point_timeouts: tuple[tuple[str, float], ...] = ()
    maxbatch: MaxBatchSpec | None = None

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
        for name in ("batch", "timing_steps", "eval_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.train_steps, int) or self.train_steps < 0:
            raise ValueError(
                f"train_steps must be an int >= 0 (0: no training run), got {self.train_steps!r}"
            )
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
        if self.timing not in TIMING_MODES:
            raise ValueError(
                f"timing must be one of {', '.join(TIMING_MODES)}, got {self.timing!r}"
            )
        object.__setattr__(self, "point_timeouts", tuple(tuple(x) for x in self.point_timeouts))
        for what, t in [("point_timeout_s", self.point_timeout_s)] + [
            (f"point_timeouts[{n!r}]", t) for n, t in self.point_timeouts
        ]:
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
                raise ValueError(f"{what} must be a number > 0 or None, got {t!r}")
        unknown = [n for n, _ in self.point_timeouts if n not in names]
        if unknown:
            raise ValueError(
                f"model case {self.model!r}: point_timeouts names points it does not have: "
                f"{unknown}"
            )
        if self.maxbatch is not None:
            if not isinstance(self.maxbatch, MaxBatchSpec):
                raise ValueError(f"maxbatch must be a MaxBatchSpec or None, got {self.maxbatch!r}")
            bad = [p for p in self.maxbatch.points if p not in names]
            if bad:
                raise ValueError(
                    f"model case {self.model!r}: max-batch points {bad} are not among its "
                    f"points ({', '.join(names)})"
                )

    def timeout_of(self, point: str) -> float | None:
        """The time limit of ``point`` (``point_timeouts``, else ``point_timeout_s``)."""
        return dict(self.point_timeouts).get(point, self.point_timeout_s)

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
    dtype: str = "float32"  # the weights' dtype ("bfloat16": the model cast, no autocast)
    compile_backend: str = "inductor"  # torch.compile's backend for the compiling anchors
    time_budget_s: float | None = None  # the whole run; later points are not started past it
    summary: bool = False  # also write <suite>.summary.md (tables.summary_table) as it goes

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
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.bf16 and self.dtype != "float32":
            raise ValueError("bf16=True (autocast) needs float32 weights; give one of the two")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(f"compile_backend must name a backend, got {self.compile_backend!r}")
        t = self.time_budget_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"time_budget_s must be a number > 0 or None, got {t!r}")

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
            "dtype": self.dtype,
            "compile_backend": self.compile_backend,
            "time_budget_s": self.time_budget_s,
            "summary": self.summary,
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
                    "timing": c.timing,
                    "point_timeout_s": c.point_timeout_s,
                    "point_timeouts": dict(c.point_timeouts),
                    "maxbatch": c.maxbatch.config() if c.maxbatch else None,
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
            cases = [
                replace(
                    c,
                    points=tuple(p for p in c.points if p.name in keep),
                    point_timeouts=tuple((n, t) for n, t in c.point_timeouts if n in keep),
                    maxbatch=_keep_maxbatch(c.maxbatch, lambda n: n if n in keep else None),
                )
                for c in cases
            ]
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
            mb = _keep_maxbatch(
                c.maxbatch, lambda n, names=names: n if n in names else _compiled_name(n, names)
            )
            timeouts = tuple((n, t) for n, t in c.point_timeouts if n in names)
            cases.append(replace(c, points=tuple(names), maxbatch=mb, point_timeouts=timeouts))
        note = "; compiled forms (--compile)"
        if dropped:
            note += f"; left out (no compiled form): {', '.join(sorted(dropped))}"
        return replace(
            self, name=f"{self.name}-compiled", description=self.description + note, cases=cases
        )

    def override(
        self,
        model: str | None = None,
        device: str | None = None,
        batch: int | None = None,
        seq: int | None = None,
        dtype: str | None = None,
        vocab_size: int | None = None,
        compile_backend: str | None = None,
        time_budget_s: float | None = None,
        timing_steps: int | None = None,
    ) -> Suite:
        """This suite with its cases' model, batch shape or timing rounds and its device, dtype,
        compile backend or time budget replaced (None: kept), e.g. the ``gpu`` suite's points on
        ``llama-tiny`` on a CPU. Moving a suite off CUDA drops its bf16 autocast. A model is
        replaced only in a one-case suite (two cases would get one label)."""
        if model is not None and len(self.cases) != 1:
            raise ValueError(
                f"a model override needs a one-case suite; suite {self.name!r} has "
                f"{len(self.cases)} cases (select one with --only-models first)"
            )
        case_kw = {
            k: v
            for k, v in dict(
                model=model, batch=batch, seq=seq, vocab_size=vocab_size, timing_steps=timing_steps
            ).items()
            if v is not None
        }
        suite_kw = {
            k: v
            for k, v in dict(
                device=device,
                dtype=dtype,
                compile_backend=compile_backend,
                time_budget_s=time_budget_s,
            ).items()
            if v is not None
        }
        if device is not None and device != "cuda":
            suite_kw["bf16"] = False
        return replace(self, cases=tuple(replace(c, **case_kw) for c in self.cases), **suite_kw)


def _keep_maxbatch(spec: MaxBatchSpec | None, rename) -> MaxBatchSpec | None:
    """``spec`` with its points renamed by ``rename`` (None: dropped); None if none is left."""
    if spec is None:
        return None
    points = tuple(dict.fromkeys(n for n in (rename(p) for p in spec.points) if n is not None))
    return replace(spec, points=points) if points else None


def _compiled_name(name: str, names: list[str]) -> str | None:
    """The compiled form of point ``name`` if the compiled suite has it (else None)."""
    if name.startswith(ANCHOR_PREFIX):
        return name if name in names else None
    try:
        spec = compiled_spec(name)
    except ValueError:
        return None
    return spec if spec in names else None
