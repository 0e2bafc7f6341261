"""Compiled blocks: each block's forward under torch.compile with a recompute budget and a codec.

A compiled block has two knobs, one per action it can take on what it saves (a
:class:`BlockChoice`):

* **recompute**: ``budget``, compile's ``activation_memory_budget`` for the block's graph: its
  min-cut partitioner solves a 0-1 knapsack to recompute in backward whatever keeps the block's
  saved bytes at ``budget`` x what its default partition saves (1.0: the default, speed first;
  0.0: everything but the block's inputs is recomputed, i.e. per-block checkpointing done by
  the compiler, which fuses the recomputation with the backward). It is set around the block's
  compiled call, which is where dynamo compiles; torch 2.13's per-region annotation
  (``torch.autograd.graph.region_activation_memory_budget``) would do the same but rejects
  graphs with dropout (inductor's RNG seeds op falls outside the region);
* **codec**: a traced codec (``slimact.compiled.codec``) applied to what the partition still
  saves, inlined into the compiled graphs;
* **offload** (with budget 0 and no codec): the block keeps nothing but its input, and that
  input in pinned host memory, by an eager wrapper around the compiled call
  (``slimact.compiled.offload``; CUDA, or CPU with the streams stubbed in tests).

The two compose: the partitioner first decides what to keep, the pack hook then encodes each
kept tensor, so ``BlockChoice(0.25, "int8")`` keeps about a quarter of the block's tensors, each
at a quarter of its bytes. Every block is its own graph (the root stays eager: embedding, final
norm, head, loss), so blocks can take different choices; one code object per budget keeps
dynamo from reusing a graph partitioned under another budget (its cache is per code object and
does not guard on the budget: the measurement trap of compiling one function at several budgets),
and blocks with equal choices share one compiled graph.

``slimact.planner.compiled`` picks a choice per block under a memory budget from measured
bytes and times. Saved bytes inside compiled graphs are invisible to saved-tensor hooks (the
region runs with hooks disabled), so :func:`forward_live_bytes` measures them from the
profiler's memory events, and :func:`compiled_saved_tensors` lists what the compiled regions
of a loss's graph hold.

The compiler is inductor unless ``SLIMACT_COMPILE_BACKEND`` names another torch.compile backend
(or ``backend=`` is passed): ``aot_eager_decomp_partition`` runs the same AOTAutograd trace,
decompositions, min-cut partition and inlined codec hooks without inductor's code generation,
which the fast test suite uses (seconds per graph instead of tens on a cold cache); the slow
suite and users compile with inductor.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch._functorch.config as functorch_config
import torch.nn as nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.profiler import ProfilerActivity, profile

from slimact import actions, sites
from slimact.checkpointing import checkpointed_modules
from slimact.compiled.codec import canonical_codec, codec_hooks, codec_names
from slimact.compiled.devices import check_device
from slimact.compiled.offload import OffloadedCall
from slimact.patching import NotCopyable
from slimact.registry import AppliedChange, FilterFn


@dataclass(frozen=True)
class BlockChoice:
    """``budget`` in [0, 1]: compile's activation-memory budget for the block's region (1.0:
    compile's default partition); ``codec``: a traced codec name of ``slimact.compiled.CODECS``
    (``none``: store what is kept as it is), ``-sr`` appended for stochastic rounding
    (``int4-sr``: ``slimact.compiled.codec.resolve_codec``); ``offload``: the block's input
    kept in pinned host memory and everything else recomputed (budget 0, codec ``none`` only:
    ``slimact.compiled.offload``)."""

    budget: float = 1.0
    codec: str = "none"
    offload: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise ValueError(f"BlockChoice.budget must be a number in [0, 1], got {self.budget!r}")
        if not 0.0 <= float(self.budget) <= 1.0:
            raise ValueError(f"BlockChoice.budget must be in [0, 1], got {self.budget!r}")
        object.__setattr__(self, "budget", float(self.budget))
        if isinstance(self.codec, str):  # an earlier name (a saved plan's) as today's
            object.__setattr__(self, "codec", canonical_codec(self.codec))
        if self.codec not in codec_names():
            raise ValueError(
                f"BlockChoice.codec must be one of {', '.join(codec_names())}, got {self.codec!r}"
            )
        if not isinstance(self.offload, bool):
            raise ValueError(f"BlockChoice.offload must be a bool, got {self.offload!r}")
        if self.offload and (self.budget != 0.0 or self.codec != "none"):
            raise ValueError(
                f"BlockChoice(offload=True) keeps only the block's input (in host memory) and "
                f"recomputes the rest: it takes budget 0 and codec 'none', not budget "
                f"{self.budget:g} with codec {self.codec!r}; valid: BlockChoice(0, 'none', "
                "offload=True), or BlockChoice(budget, codec) without offload"
            )

    @property
    def label(self) -> str:
        """The block's actions in slimact's words: ``recompute/budget=<b>`` where compile
        recomputes (budget < 1), ``codec:compiled-<codec>`` for what it encodes, else ``keep``."""
        parts = [f"{actions.RECOMPUTE}/budget={self.budget:g}"] if self.budget < 1.0 else []
        if self.codec != "none":
            parts.append(actions.codec(f"compiled-{self.codec}"))
        if self.offload:
            parts.append(actions.OFFLOAD)
        return "+".join(parts) or actions.KEEP

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"budget": self.budget, "codec": self.codec}
        if self.offload:  # (absent: older plans and profiles read back as they were)
            d["offload"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockChoice:
        return cls(d["budget"], d["codec"], bool(d.get("offload", False)))


class CompileFallbackWarning(UserWarning):
    """A compiled block ran eagerly: its budget and codec did not apply to that call."""


def _block_call(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.compiler.is_compiling() and torch.is_grad_enabled():
        warnings.warn(
            "a slimact compiled block is running eagerly: dynamo gave up compiling it (see its "
            "warnings, e.g. torch._dynamo.config.recompile_limit), so its recompute budget and "
            "codec do not apply and it saves more than its plan says",
            CompileFallbackWarning,
            stacklevel=2,
        )
        # the traced codec does not apply eagerly either (its hooks would run per tensor and
        # hide the saves from the router): raw saves, seen by the router and a meter if active,
        # so that measuring the block does not change what it stores
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity), sites.rerouted():
            return forward(*args, **kwargs)
    return forward(*args, **kwargs)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # not t: a pack hook holding its tensor closes a cycle (sites._pack)


def own_code(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own, named ``<fn>_<tag>``: dynamo caches compiled frames
    per code object and does not guard on ``activation_memory_budget``, so compiling one
    function under several budgets in one process keeps the first one's partition unless each
    budget calls its own code object."""
    tag = re.sub(r"\W", "_", tag)
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


# Blocks of one class under one choice share a code object, and so dynamo's cache entries and
# its recompile limit (8 by default). Identical blocks share one graph, but a block whose
# submodules carry instance patches (``invact``'s norms: one ``ForwardOverride`` object per
# module, which dynamo guards by id) needs a graph of its own, as does each grad / torch-function
# mode state it runs under (a meter adds one): past 8 such entries dynamo ran the block eagerly
# (a 12-block ``invact`` model did). The limit is raised for these calls only.
RECOMPILE_LIMIT = 256
BACKEND_VARIABLE = "SLIMACT_COMPILE_BACKEND"  # another torch.compile backend (module docstring)


@functools.cache
def _block_fn(budget: float, codec: str, owner: type) -> Callable[..., Any]:
    """:func:`_block_call` with a code object of its own per (budget, codec, block class), so
    options never share, nor evict, each other's graphs (module docstring)."""
    return own_code(_block_call, f"{owner.__name__}_{budget:.6f}_{codec}")


# Entered eagerly around each compiled call: an outer torch.compile (a root the user compiled
# whole) skips it and calls the block's own compiled function, instead of tracing the codec's
# hook setup (``hook_pair`` is cached with functools.cache, which dynamo would trace through
# with a warning) and compiling the block a second time around its compiled graph.
@torch.compiler.disable
def _compiled_forward(
    compiled: Callable[..., Any],
    choice: BlockChoice,
    forward: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    check_device(choice.codec, _device_types(args, kwargs))
    if isinstance(compiled, OffloadedCall):  # its compiled calls come back through _run_compiled
        return compiled(forward, args, kwargs)
    return _run_compiled(compiled, choice, forward, *args, **kwargs)


def _run_compiled(
    compiled: Callable[..., Any],
    choice: BlockChoice,
    forward: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    with (
        codec_hooks(choice.codec),
        functorch_config.patch(activation_memory_budget=choice.budget),
        dynamo_config.patch(recompile_limit=max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)),
    ):
        out = compiled(forward, *args, **kwargs)
    _watch_compiles(compiled, args, kwargs)
    return out


class RecompileWarning(UserWarning):
    """A compiled block keeps being compiled again for new input shapes."""


# Compiles of one block function for distinct input shapes past which it warns (once per
# process). Under automatic dynamic shapes a new sequence length or batch size compiles once
# more with symbolic sizes, and a codec's shape rule (a tensor below ``min_numel`` stays exact)
# may add one where lengths cross it; more than this means every new shape compiles.
SHAPE_COMPILES_WARN = 6
_shapes_compiled: dict[Any, dict[str, Any]] = {}
_warned_recompiles: list[str] = []


def _shape_key(args: tuple, kwargs: dict) -> tuple:
    vals = (*args, *kwargs.values())
    return tuple(tuple(a.shape) for a in vals if isinstance(a, torch.Tensor))


def _watch_compiles(compiled: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Count the compiles of the block function ``compiled`` wraps that a new input shape made
    (dynamo's cache entries for its code object grew on a call with shapes not seen before;
    entries for a block's own guards, grad mode or a meter's mode reuse seen shapes), and warn
    once when they pass ``SHAPE_COMPILES_WARN``."""
    fn = getattr(compiled, "_torchdynamo_orig_callable", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    seen = _shapes_compiled.setdefault(code, {"entries": 0, "shapes": set()})
    entries = len(_debug_get_cache_entry_list(code))
    grew, seen["entries"] = entries > seen["entries"], entries
    key = _shape_key(args, kwargs)
    if not grew or key in seen["shapes"]:
        return
    seen["shapes"].add(key)
    if len(seen["shapes"]) > SHAPE_COMPILES_WARN and not _warned_recompiles:
        _warned_recompiles.append(code.co_name)
        warnings.warn(
            f"slimact: compiled block function {code.co_name} has been compiled for "
            f"{len(seen['shapes'])} input shapes (the latest {key}); each compile costs seconds "
            "and every new shape costs another. Shapes are compiled dynamic after the first "
            "change unless torch.compile was given dynamic=False; pad or bucket sequence "
            "lengths to a few sizes (this warning is shown once)",
            RecompileWarning,
            stacklevel=3,
        )


def _device_types(args: tuple, kwargs: dict) -> set[str]:
    return {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}


def compile_block(
    block: nn.Module, choice: BlockChoice, forward: Callable[..., Any] | None = None, **kw: Any
) -> Callable[..., Any]:
    """The compiled forward of ``block`` under ``choice`` (not installed): the codec's hook pair
    around a compiled call of the block's forward inside its region budget."""
    # automatic dynamic shapes: the first call compiles for its shapes, a call with another
    # sequence length (or batch size) compiles once more with those sizes symbolic, and later
    # lengths reuse that graph (the codecs' shape rules hold for symbolic sizes)
    kw.setdefault("dynamic", None)
    kw.setdefault("backend", os.environ.get(BACKEND_VARIABLE) or "inductor")
    if choice.offload:
        # the replay in backward consumes its saves at once: compile's default partition
        # (budget 1), whose code object compiled-none blocks of this class share
        inner = BlockChoice()
        fn = torch.compile(_block_fn(inner.budget, inner.codec, type(block)), **kw)
        run = functools.partial(_run_compiled, fn, inner)
        return functools.partial(
            _compiled_forward, OffloadedCall(run, block), choice, forward or block.forward
        )
    compiled = torch.compile(_block_fn(choice.budget, choice.codec, type(block)), **kw)
    return functools.partial(_compiled_forward, compiled, choice, forward or block.forward)


def without_copies(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` (from :func:`compile_block`) with an offload choice's input kept on the device
    instead of copied to the host: the compiled planner times the option without the link,
    whose cost it models (``slimact.planner.compiled``). Other choices: ``forward`` as is."""
    if isinstance(forward, functools.partial) and isinstance(forward.args[0], OffloadedCall):
        forward.args[0].copies = False
    return forward


def compiled_choice(block: nn.Module) -> BlockChoice | None:
    """The choice ``block``'s installed compiled forward runs under (None: not compiled here)."""
    fwd = block.__dict__.get("forward")
    fn = getattr(fwd, "fn", None) if isinstance(fwd, NotCopyable) else None
    if isinstance(fn, functools.partial) and fn.func is _compiled_forward:
        return fn.args[1]
    return None


def compile_blocks_with(
    model: nn.Module,
    choices: BlockChoice | Mapping[str, BlockChoice],
    filter_fn: FilterFn | None = None,
    **compile_kwargs: Any,
) -> list[AppliedChange]:
    """``torch.compile`` each block's forward under its :class:`BlockChoice` (one for all, or
    one per block path); the root stays eager. Returns one change per block, whose undo
    restores the eager forward (``slimact.revert``); a block missing from a mapping is left
    eager and reported as skipped; a block already compiled under the same choice is skipped
    (a repeat), under another one is an error (one compile layer per block).
    ``compile_kwargs`` go to ``torch.compile``."""
    modules = dict(model.named_modules())
    changes: list[AppliedChange] = []
    try:  # all or nothing: a block that fails leaves none of this call's blocks compiled
        for path in sites.block_paths(model):
            block = modules[path]
            choice = choices if isinstance(choices, BlockChoice) else choices.get(path)
            if choice is None:
                changes.append(AppliedChange(path, "compile", "no choice for this block", True))
                continue
            if filter_fn is not None and not filter_fn(block, path):
                changes.append(AppliedChange(path, "compile", "filtered out", skipped=True))
                continue
            prev = block.__dict__.get("forward")
            done = compiled_choice(block)
            if done == choice:
                changes.append(
                    AppliedChange(path, "compile", f"already compiled ({done.label})", True)
                )
                continue
            if done is not None:
                raise ValueError(
                    f"block {path!r} is already compiled by slimact ({done.label}); a block is "
                    f"compiled once, not under {choice.label} around it: slimact.revert(model) first"
                )
            if ckpt := checkpointed_modules(block):  # compile's partitioner recomputes instead
                inner = ".".join(p for p in (path, ckpt[0]) if p)
                raise ValueError(
                    f"block {path!r} is recomputed by the model's plan ({inner} runs under a "
                    f"checkpoint), so it is not compiled under {choice.label}: slimact.revert("
                    "model) first (a compiled block recomputes at region budget 0, e.g. "
                    "'compiled-int8@0')"
                )
            fwd = compile_block(block, choice, prev or block.forward, **compile_kwargs)
            block.forward = NotCopyable(fwd, f"compiled block ({choice.label})")
            sites.seal(block)
            undo = functools.partial(_eager_again, block, prev, sealed=True)
            changes.append(AppliedChange(path, "compile", choice.label, undo=undo))
    except BaseException:
        for c in reversed(changes):
            if c.undo is not None:
                c.undo()
        raise
    if not changes:
        changes.append(AppliedChange("", "compile", "model has no repeated blocks", skipped=True))
    return changes


def compile_as_is(
    model: nn.Module,
    filter_fn: FilterFn | None = None,
    eager_reason: str | None = None,
    **compile_kwargs: Any,
) -> list[AppliedChange]:
    """``torch.compile`` each block's forward as it is, with no region budget and no codec
    (``slimact.hf.compile_blocks``): a checkpoint wrapper or a reformulated forward a strategy
    put there compiles along. The forward, not ``_call_impl``: the block's own hooks (the
    router's module stack) run eagerly, so the compiled graph's saves are attributed to the
    block. ``eager_reason``: leave every block eager and say why (a codec policy's sites,
    which a compiled graph hides). One change per block, its undo the eager forward back;
    inductor unless ``backend=`` or ``SLIMACT_COMPILE_BACKEND`` names another backend."""
    modules = dict(model.named_modules())
    changes: list[AppliedChange] = []
    compile_kwargs.setdefault("backend", os.environ.get(BACKEND_VARIABLE) or "inductor")
    for path in sites.block_paths(model):
        block = modules[path]
        if filter_fn is not None and not filter_fn(block, path):
            changes.append(AppliedChange(path, "compile", "filtered out", skipped=True))
        elif eager_reason is not None:
            changes.append(AppliedChange(path, "compile", eager_reason, skipped=True))
        else:
            prev = block.__dict__.get("forward")
            block.forward = torch.compile(block.forward, **compile_kwargs)
            undo = functools.partial(_eager_again, block, prev)
            changes.append(AppliedChange(path, "compile", str(compile_kwargs), undo=undo))
    if not changes:
        changes.append(AppliedChange("", "compile", "model has no repeated blocks", skipped=True))
    return changes


def _eager_again(block: nn.Module, prev: Any, sealed: bool = False) -> None:
    """A compiled block's undo: its eager forward back (``prev``: an instance forward it had),
    unsealed for the router where it was sealed."""
    if sealed:
        sites.seal(block, compiled=False)
    if prev is None:
        block.__dict__.pop("forward", None)
    else:
        block.forward = prev


# ----------------------------------------------------------------------------- measuring
def compiled_saved_tensors(loss: torch.Tensor) -> list[torch.Tensor]:
    """What the compiled regions of ``loss``'s graph keep for backward: the saved tensors of
    every ``CompiledFunctionBackward`` node reachable from ``loss.grad_fn`` (packed payloads
    where the codec hooks were inlined)."""
    out: list[torch.Tensor] = []
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            out.extend(node.saved_tensors)
        stack.extend(f for f, _ in node.next_functions)
    return out


def forward_live_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``fn()`` (a forward returning the loss) under the CPU profiler; return the bytes it
    left alive (allocations minus frees, the returned loss included) and its result.

    What a forward leaves alive is what autograd saved for backward (plus the loss), also where
    the saves are hidden from hooks inside compiled graphs. Drop other outputs (logits) inside
    ``fn``. CPU only. Garbage is collected first: the profiler reports the free of a block
    allocated under an *earlier* profile as negative bytes, so garbage freed during ``fn``
    would be subtracted from its count."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = sum(
        e.nbytes()
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    return int(live), out
