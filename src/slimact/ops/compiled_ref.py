"""The CPU path of slimact's ops: their plain-PyTorch ``*_ref`` functions, compiled by inductor.

Eager, a ref is a chain of small ops, each a full pass over memory: the inverted activations'
Newton backward is ~150 of them per call, and INT4 quantize+pack plus the codecs' range checks
about two dozen per saved tensor (what that costs a step: BENCHMARKS.md §7, the CPU path).
``call(fn, *tensors,
**static)`` runs ``fn`` compiled by inductor instead: a few fused, vectorized loops per call.
Users: ``ops.inv_act`` and ``ops.inv_act_traced`` (the inverted activations), ``ops.quant``
(quantize/dequantize), ``codecs.quant`` and ``codecs.outlier`` (the range check's row norms, the
outlier channels' sums) through :func:`run`, which decides where compiling pays.

* compiled once per key, lazily at first use, never at import; the key is the function, its
  static arguments (kind, mode, variant) and what dynamo would otherwise recompile for: the
  tensors' dtypes, ``requires_grad`` and storage layout (contiguous, or a view), grad mode,
  autocast state and the active TorchFunctionModes' types (without ``requires_grad`` in it, a codec's saved tensors, some requiring
  grad and some not, made one key recompile past dynamo's limit).
  ``dynamic=True`` (callers pass flat tensors, so one symbolic size serves every shape) with
  ``specialize_int`` (the static arguments, closure cells of the bound function, stay constants:
  a symbolic group size turned a dequantize's index math into divisions) and
  ``fullgraph=True`` (the refs are written without graph breaks: ``dense=True`` selects the
  pointwise Newton form).
* each key gets its own copy of the function's code object, since dynamo keeps its cache (and
  its recompile limit of 8) per code object: a process mixing dtypes, eval and training,
  autocast on and off, never hits the limit and falls back to eager behind our back (a test
  suite did, at the 9th variant of one function).
* if compiling fails before any compiled call has succeeded (no C++ compiler, an unsupported
  platform...), one warning, and from then on every call runs the eager reference. A failure
  after that (dynamo's recompile limit, an op it cannot trace) is that key's alone: it runs
  eagerly from then on, with one warning naming it, and every other key stays compiled (a
  recompile-limit hit in one codec had turned the whole process's CPU path eager: a benchmark
  suite's later cases ran ``invact`` at 2-3x ``none``).

On CUDA, :func:`run` calls the refs eagerly by default: the quantize/dequantize have Triton
kernels there, but the codecs' range checks and outlier statistics then run as a chain of small
kernels each (BENCHMARKS.md §8). :func:`compiled_refs_on_cuda` (or ``SLIMACT_COMPILED_REFS_ON_CUDA=1``
in the environment, read at import) routes CUDA tensors through :func:`call` as well, where
inductor generates a few fused Triton kernels per ref instead; it is an A/B switch until a GPU run
measures which is faster (``slimact bench gpu --profile int4,compiled-refs:int4``). The keys
include the device type, and a compile failure on CUDA is always its key's alone (the CPU path
stays compiled).

The refs themselves stay the reference: tests compare this path against them.
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch._dynamo.config as dynamo_config
from torch.overrides import _get_current_function_mode_stack

from slimact.ops import device_path

MIN_NUMEL = 1 << 14  # below this the eager ref is as fast as a compiled call's dispatch

_COMPILED: dict[tuple, Callable] = {}
_BROKEN: list[str] = []  # why compiling was given up (at most one entry)
_WORKED: list[bool] = []  # non-empty once a compiled call has succeeded in this process
_EAGER_KEYS: dict[tuple, str] = {}  # keys whose compiled call failed after _WORKED: why
_EAGER: list[bool] = []  # non-empty inside eager_refs()
CUDA_ENV = "SLIMACT_COMPILED_REFS_ON_CUDA"


def env_on_cuda() -> bool:
    """Whether ``SLIMACT_COMPILED_REFS_ON_CUDA`` asks for the compiled refs on CUDA (set, not 0)."""
    return os.environ.get(CUDA_ENV, "") not in ("", "0")


# the last entry says whether run() compiles the refs of CUDA tensors (module docstring)
_ON_CUDA: list[bool] = [env_on_cuda()]


@contextmanager
def eager_refs():
    """Inside, every :func:`call` runs its ref eagerly (to compare the two CPU paths in one
    process: BENCHMARKS.md §7)."""
    _EAGER.append(True)
    try:
        yield
    finally:
        _EAGER.pop()


@contextmanager
def compiled_refs_on_cuda(enabled: bool = True):
    """Inside, :func:`run` compiles the refs of CUDA tensors too (``enabled=False``: calls them
    eagerly, the default outside); nests, and restores the previous choice on exit."""
    _ON_CUDA.append(bool(enabled))
    try:
        yield
    finally:
        _ON_CUDA.pop()


def on_cuda() -> bool:
    """Whether :func:`run` compiles the refs of CUDA tensors now."""
    return _ON_CUDA[-1]


def available() -> bool:
    """False once a compile has failed (every later call runs eagerly)."""
    return not _BROKEN


def _bind(fn: Callable, static: dict) -> Callable:
    """``fn`` with ``static`` bound, as a function with its own code object: dynamo keeps its
    cache per code object of the frame it enters (a ``functools.partial`` would share one
    wrapper's code among all keys)."""

    def bound(*tensors):
        return fn(*tensors, **static)

    code = bound.__code__.replace(co_name=f"{fn.__name__}_compiled")
    return types.FunctionType(code, bound.__globals__, code.co_name, None, bound.__closure__)


def _state(tensors: tuple[torch.Tensor | None, ...]) -> tuple:
    """What dynamo guards on besides sizes (module docstring): one code object per value."""
    layout = tuple(
        (t.device.type, t.dtype, t.requires_grad, t.is_contiguous(), t._base is not None)
        if isinstance(t, torch.Tensor)
        else t
        for t in tensors
    )
    amp = tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    # dynamo also guards on the types of the active TorchFunctionModes (the site router's
    # op tracker is one: a ref called inside and outside the router is two states)
    modes = tuple(type(m) for m in _get_current_function_mode_stack())
    return (layout, torch.is_grad_enabled(), amp, modes)


def _key(fn: Callable, tensors: tuple, static: dict) -> tuple:
    return (fn, tuple(sorted(static.items())), _state(tensors))


def compiled(key: tuple, fn: Callable, static: dict) -> Callable:
    """``fn`` with ``static`` bound, compiled by inductor, cached under ``key`` (:func:`_key`:
    fn, static, the state of the tensors and of grad mode and autocast)."""
    c = _COMPILED.get(key)
    if c is None:
        c = _COMPILED[key] = torch.compile(_bind(fn, static), dynamic=True, fullgraph=True)
    return c


def call(fn: Callable, *tensors: torch.Tensor, **static):
    """``fn(*tensors, **static)``, compiled; the eager ``fn`` if compiling is unavailable (or
    failed for this key), and ``fn`` itself while dynamo traces (an outer ``torch.compile``
    then fuses it there)."""
    if _BROKEN or _EAGER or torch.compiler.is_compiling():
        return fn(*tensors, **static)
    key = _key(fn, tensors, static)
    if key in _EAGER_KEYS:
        return fn(*tensors, **static)
    c = compiled(key, fn, static)
    try:
        with dynamo_config.patch(specialize_int=True):
            out = c(*tensors)
    except Exception as e:  # the compiler is optional: any failure of it means eager
        why = f"{type(e).__name__}: {e}"
        # the compiler works (or the failure is a CUDA key's, beside the CPU path): this key
        # alone runs eagerly from now on
        if _WORKED or any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
            _EAGER_KEYS[key] = why
            warnings.warn(
                f"slimact: torch.compile of {fn.__name__} failed for one input state "
                f"({why[:300]}); that state runs the eager PyTorch reference from now on "
                "(correct, slower), the others stay compiled",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            _BROKEN.append(why)
            warnings.warn(
                f"slimact: torch.compile of {fn.__name__} failed ({why[:300]}); slimact's "
                "ops run their eager PyTorch references on CPU from now on (correct, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
        return fn(*tensors, **static)
    if not _WORKED:
        _WORKED.append(True)
    return out


def run(fn: Callable, *tensors: torch.Tensor, **static):
    """``fn(*tensors, **static)`` where it pays: :func:`call` (compiled) when the first tensor
    holds at least ``MIN_NUMEL`` values and is not on CUDA (or is, inside
    :func:`compiled_refs_on_cuda`), ``fn`` eagerly otherwise (CUDA has the Triton kernels or its
    own eager ops; small tensors do not repay a compiled call)."""
    t = tensors[0]
    if t.numel() < MIN_NUMEL or (device_path.takes_cuda_path(t) and not _ON_CUDA[-1]):
        return fn(*tensors, **static)
    return call(fn, *tensors, **static)


def run_cuda(fn: Callable, *tensors: torch.Tensor, **static):
    """:func:`run` for CUDA tensors, ``fn`` eagerly on other devices: for refs whose eager ops
    are cheap there (statistics of small tensors) but one kernel launch each on CUDA."""
    if not device_path.takes_cuda_path(tensors[0]):
        return fn(*tensors, **static)
    return run(fn, *tensors, **static)


def eager(fn: Callable, *tensors: torch.Tensor, **static):
    """``fn(*tensors, **static)`` as written: the reference path, same signature as :func:`run`."""
    return fn(*tensors, **static)
