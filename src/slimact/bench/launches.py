"""The launch count of a training step: Triton launches plus aten ops, views excluded.

On a GPU an eager step's host time is mostly the launches it makes (BENCHMARKS.md §8): every
aten op that computes dispatches at least one kernel, every Triton kernel is one launch. This
counts them on any machine, CPU included, for the step the device would run: the step runs
inside ``ops.device_path.cuda_path`` (CPU tensors take the CUDA path: the Triton kernels, under
Triton's interpreter, ``TRITON_INTERPRET=1``) and ``ops.compiled_ref.eager_refs`` (the refs
eager, as they run on CUDA; compiled on CPU they would hide their ops in one call).

* **aten ops**: every ``aten::`` op a ``TorchDispatchMode`` sees (what reaches the dispatcher's
  backend: a composite op's decomposition, where it has one, else the op itself), except
  :data:`VIEW_OPS`: views, aliases and metadata, which touch no data and launch no kernel, and
  :data:`ALLOC_OPS`: allocations left uninitialized (``empty``...), served by the caching
  allocator without a kernel (counted apart, ``StepCount.allocs``). Everything else counts:
  fills (``zeros``, ``full``), copies, host reads, each a kernel or a sync on a GPU.
* **Triton launches**: each ``kernel[grid](...)`` call (its interpreter's own tensor copies
  are not the step's and are not counted; on a GPU, Triton's launch hook).

:func:`count_step` counts one forward + backward of a model after warm-up steps (the codecs in
their steady state, the deferred encode), and how many saved storages the step coded and how
many modules the plan reformulated, the units of ``tests/test_launches.py``'s bounds.
``slimact bench gpu --profile`` reports the same count from the profiler's events on the device
(``launch_count``: ``slimact.bench.profile``).
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimact import sites
from slimact.models import build_model
from slimact.ops import compiled_ref, device_path
from slimact.state import peek
from slimact.strategies import apply

# aten ops that only make a view, alias or read metadata: no data touched, no kernel
VIEW_OPS: frozenset[str] = frozenset(
    f"aten::{name}"
    for name in (
        "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "alias", "detach",
        "permute", "transpose", "t", "expand", "expand_as", "unsqueeze", "squeeze", "slice",
        "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "unflatten",
        "flatten", "movedim", "diagonal", "unfold", "view_as", "view_as_real", "view_as_complex",
        "lift_fresh", "_nested_view_from_buffer", "sym_size", "sym_stride", "sym_numel",
        "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
    )
)  # fmt: skip
# allocations left uninitialized: no kernel (the caching allocator), counted apart
ALLOC_OPS: frozenset[str] = frozenset(
    f"aten::{name}"
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
)


class OpCounter(TorchDispatchMode):
    """Counts aten ops (``aten::<op>`` -> calls; :data:`VIEW_OPS` left out, :data:`ALLOC_OPS`
    apart) and, through
    :func:`counting_launches`, Triton launches (kernel name -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.launches: Counter = Counter()
        self.allocs: Counter = Counter()
        self._paused = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # a compiled graph runs as its compiled code

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and func.namespace == "aten":
            name = f"aten::{func.overloadpacket.__name__}"
            if name in ALLOC_OPS:
                self.allocs[name] += 1
            elif name not in VIEW_OPS:
                self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def launch(self, name: str) -> Iterator[None]:
        """One Triton launch of ``name``; the ops inside (the interpreter's) are its own."""
        self.launches[name] += 1
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.launches.values())


_COUNTERS: list[OpCounter] = []


@functools.cache
def _patch_interpreter() -> bool:
    """Route the interpreter's launches through the innermost counter (once per process; a
    no-op without a counter). False where triton or its interpreter is not importable."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    run = InterpretedFunction.run

    @functools.wraps(run)
    def counted_run(self, *args, grid, warmup, **kwargs):
        if warmup or not _COUNTERS:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        with _COUNTERS[-1].launch(self.__name__):
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = counted_run
    return True


def _launch_hook(metadata) -> None:
    if _COUNTERS:
        _COUNTERS[-1].launches[getattr(metadata, "name", "triton")] += 1


@contextmanager
def counting_launches(counter: OpCounter) -> Iterator[OpCounter]:
    """``counter`` counts aten ops and Triton launches inside (interpreted kernels: their
    launch; compiled ones: Triton's launch hook)."""
    hooks = None
    if device_path.interpreter_on():
        _patch_interpreter()
    else:
        try:
            from triton import knobs

            hooks = knobs.runtime.launch_enter_hook
        except ImportError:
            hooks = None
    _COUNTERS.append(counter)
    if hooks is not None:
        hooks.add(_launch_hook)
    try:
        with counter:
            yield counter
    finally:
        if hooks is not None:
            hooks.remove(_launch_hook)
        _COUNTERS.pop()


@dataclass
class StepCount:
    """One training step's count (module docstring)."""

    spec: str
    ops: Counter = field(default_factory=Counter)  # aten::<op> -> calls, views excluded
    launches: Counter = field(default_factory=Counter)  # Triton kernel -> launches
    allocs: Counter = field(default_factory=Counter)  # ALLOC_OPS -> calls (not in the total)
    coded: int = 0  # saved tensors stored through a codec (one per payload: sharers once)
    reformulated: int = 0  # modules the plan reformulates

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + sum(self.launches.values())

    def summary(self, top: int = 8) -> str:
        head = ", ".join(f"{k[6:]} {v}" for k, v in self.ops.most_common(top))
        return (
            f"{self.spec:<10} {self.total:>6} ({sum(self.launches.values())} launches), "
            f"{self.coded} coded, {self.reformulated} reformulated; top: {head}"
        )


def _reformulated(model: torch.nn.Module) -> int:
    st = peek(model)
    plan = None if st is None or st.runtime is None else st.runtime.plan
    return 0 if plan is None else sum(len(lp.reform) for lp in plan.layers)


def count_step(
    spec: str,
    *,
    model: str = "llama-tiny",
    layers: int = 2,
    shape: tuple[int, int] = (2, 64),
    warmup: int = 2,
    cuda_path: bool = True,
) -> StepCount:
    """The count of one forward + backward of ``model`` (``layers`` blocks, a batch of
    ``shape`` token ids) under ``spec``, after ``warmup`` training steps (AdamW), on the CUDA
    path (``cuda_path=False``: the CPU path, the refs still eager). The first warm-up step runs
    on the CPU path: a planner (``auto``) times its candidates there, not in the interpreter."""
    torch.manual_seed(0)
    m = build_model(model, n_layers=layers)
    if spec != "none":
        apply(m, spec)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(1))
    result = StepCount(spec)
    coded: set[int] = set()

    def listen(event: sites.SavedEvent) -> None:
        if event.action.startswith("codec:") and event.stored:  # sharers: one payload
            coded.add(sites.storage_key(event.stored[0]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(warmup):
            with device_path.cuda_path(cuda_path and i > 0):
                m(ids, targets=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        counter = OpCounter()
        with device_path.cuda_path(cuda_path), compiled_ref.eager_refs(), sites.listening(listen):
            with counting_launches(counter):
                m(ids, targets=ids).loss.backward()
    result.ops, result.launches, result.allocs = counter.ops, counter.launches, counter.allocs
    result.coded, result.reformulated = len(coded), _reformulated(m)
    return result
