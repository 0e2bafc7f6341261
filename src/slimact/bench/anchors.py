"""The anchors: what plain PyTorch offers, measured in the same run as slimact's strategies.

Each anchor turns a model and a loss function into a :class:`Prepared` point (the model to run,
the ``forward(model, x, y) -> loss`` to call, a note, and a ``restore`` to call when done):

* ``torch-checkpoint``: every block (``sites.block_paths``: ModuleList children) wrapped in
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, nothing else, through the same
  wrapper as slimact's ``recompute`` (``slimact.checkpointing.checkpoint_module``: the block inputs the
  checkpoint saves are named ``<block>:checkpoint_input#k``), so the two are measured alike.
* ``compile-budget`` (``compile-budget@0.25``: that budget): ``torch.compile`` (inductor) of the
  whole loss function with ``torch._functorch.config.activation_memory_budget`` set (the suite's
  ``compile_budget``, 0.5 by default; one code object per budget, see
  ``slimact.compiled.own_code``, so anchors at several budgets coexist): AOTAutograd's min-cut partitioner recomputes what it must to keep the saved bytes under
  that fraction. The meter sees the compiled graph's saves (the router's hooks wrap the compiled
  autograd function; BENCHMARKS.md §7), unnamed and attributed outside blocks,
  so its per-site chart is empty and its loss-head share unknown (``compiled=True``). The
  compiling call is the measured first step; the runner runs one more step before the peak (a
  call without the meter's hooks may recompile), and the timing rounds start after warm-up. With
  dropout in the model (HF BERT) the masks
  come from inductor's RNG, so gradients differ from eager by the masks; the note says so.
* ``compile-block@<b>``: ``torch.compile`` of each block's forward (the root stays eager), with
  ``activation_memory_budget`` = ``b`` in [0, 1] patched around every call: what a user writes
  to compile per block, with no slimact hook inside (the plain-PyTorch twin of
  ``compiled-none@b``). All blocks share one code object per budget, so identical blocks share
  one compiled graph and anchors at several budgets coexist. The blocks are marked compiled for
  the meter (``sites.seal``: no router hooks inside them, which dynamo would trace and guard on),
  which reads their graphs' saves off the autograd graph (``<block>:compiled#k``).
* ``save-on-cpu``: ``torch.autograd.graph.save_on_cpu`` around the forward. Its hooks are the
  innermost, so the meter sees no saves: on CUDA that is the truth for GPU-resident saved bytes
  (they live in host memory; the peak shows what is left); on a CPU machine the "device" *is* the
  host, so it moves nothing and the runner reports the baseline's bytes with a note saying so.

Nothing here imports CUDA state at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn

from slimact import sites, spec
from slimact.bench.cases import ANCHORS
from slimact.checkpointing import checkpoint_module
from slimact.compiled import compiled_saved_tensors, own_code
from slimact.patching import override_forward, run_all

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Prepared:
    """A model ready to measure under one anchor.

    ``meter_sees_saves``: False when the meter sees none of the saves (``save-on-cpu``);
    ``compiled``: the forward is compiled, so saves reach the meter unnamed (no per-site or
    loss-head attribution) and its first call without the meter may recompile. ``restore`` undoes
    the anchor; the runner calls it once the case's timing rounds are done."""

    model: nn.Module
    forward: Forward
    note: str = ""
    meter_sees_saves: bool = True
    compiled: bool = False
    restore: Callable[[], None] = field(default=lambda: None)
    whole_graph: bool = False  # the loss is one compiled graph: bytes by graph_saved_bytes


def graph_saved_bytes(loss: torch.Tensor, model: nn.Module) -> int:
    """Bytes of the unique storages the compiled functions behind ``loss`` saved for backward,
    the model's parameters and buffers excluded (what the meter counts, for a loss compiled
    whole). Saves of eager code between compiled graphs (after a graph break) are not seen."""
    params = {sites.storage_key(t) for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}
    for t in compiled_saved_tensors(loss):
        key = sites.storage_key(t)
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def torch_checkpoint(model: nn.Module, forward: Forward) -> Prepared:
    modules = dict(model.named_modules())
    blocks = sites.block_paths(model)
    if not blocks:
        raise ValueError("anchor torch-checkpoint: the model has no repeated blocks")
    undos = [checkpoint_module(modules[path]) for path in blocks]
    return Prepared(
        model,
        forward,
        note=f"torch.utils.checkpoint (non-reentrant) on each of {len(blocks)} blocks",
        restore=functools.partial(run_all, *undos),
    )


def compile_budget(
    model: nn.Module, forward: Forward, budget: float = 0.5, backend: str = "inductor"
) -> Prepared:
    """The whole loss compiled under ``budget``: a code object of its own per budget, the budget
    patched around every call, so several of these anchors coexist in one process."""
    compiled = torch.compile(own_code(forward, f"budget_{budget:g}"), backend=backend)

    def fwd(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled(m, x, y)

    note = (
        f"torch.compile({backend}) of the whole loss, activation_memory_budget={budget}; "
        "saves read off the autograd graph (unnamed, outside blocks)"
    )
    return Prepared(model, fwd, note=note + _dropout_note(model), compiled=True, whole_graph=True)


def _dropout_note(model: nn.Module) -> str:
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return (
            "; the model has dropout, whose masks inductor draws from its own RNG, so grad_cos "
            "and the loss curve differ from eager by the masks, not by the saving"
        )
    return ""


def _call(fn: Callable[..., object], *args: object, **kwargs: object) -> object:
    return fn(*args, **kwargs)


def _compiled_block(
    inner: Callable[..., object], compiled: Callable[..., object], budget: float, *args, **kwargs
) -> object:
    with functorch_config.patch(activation_memory_budget=budget):
        return compiled(inner, *args, **kwargs)


def _unseal(module: nn.Module) -> None:
    sites.seal(module, compiled=False)


def compile_block(
    model: nn.Module, forward: Forward, budget: float, backend: str = "inductor"
) -> Prepared:
    """Each block's forward compiled under ``budget`` (module docstring), the root eager."""
    modules = dict(model.named_modules())
    blocks = sites.block_paths(model)
    if not blocks:
        raise ValueError("anchor compile-block: the model has no repeated blocks")
    compiled = torch.compile(own_code(_call, f"block_budget_{budget:g}"), backend=backend)
    undos = []
    for path in blocks:
        undos.append(override_forward(modules[path], _compiled_block, compiled, budget)[1])
        sites.seal(modules[path])
        undos.append(functools.partial(_unseal, modules[path]))
    note = (
        f"torch.compile({backend}) of each of {len(blocks)} blocks' forward, "
        f"activation_memory_budget={budget:g}, root eager, no slimact hooks"
    )
    return Prepared(
        model,
        forward,
        note=note + _dropout_note(model),
        compiled=True,
        restore=functools.partial(run_all, *undos),
    )


def save_on_cpu(model: nn.Module, forward: Forward, device: torch.device) -> Prepared:
    pin = device.type == "cuda"

    def fwd(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return forward(m, x, y)

    if device.type == "cuda":
        note = "save_on_cpu(pin_memory=True): saved tensors live in host memory; GPU-side saved bytes ~0, see peak"
    else:
        note = (
            "save_on_cpu on a CPU machine moves nothing (device = host): saved bytes are the "
            "baseline's; only its overhead is measured"
        )
    return Prepared(model, fwd, note=note, meter_sees_saves=False)


def prepare(
    name: str,
    model: nn.Module,
    forward: Forward,
    device: torch.device,
    compile_budget_fraction: float = 0.5,
    backend: str = "inductor",
) -> Prepared:
    """The anchor ``name`` (see module docstring) applied to ``model``; ``compile-budget@0.25``
    and ``compile-block@0.25`` name their budget (else the suite's ``compile_budget_fraction``);
    ``backend``: torch.compile's backend for the compiling anchors."""
    part = spec.parse_part(name)
    name, arg = part.name, part.get("region")
    budget = float(arg) if arg else compile_budget_fraction
    if name == "torch-checkpoint":
        return torch_checkpoint(model, forward)
    if name == "compile-budget":
        return compile_budget(model, forward, budget, backend)
    if name == "compile-block":
        return compile_block(model, forward, budget, backend)
    if name == "save-on-cpu":
        return save_on_cpu(model, forward, device)
    raise ValueError(f"unknown anchor {name!r}; valid anchors: {', '.join(ANCHORS)}")
