"""Hugging Face transformers and torch.compile integration.

``slimact.apply(hf_model, "invact")`` already works on any ``transformers`` model: every strategy
finds its targets by structure, not by class name, because it works on *sites* (what autograd
saves) and on module shapes:

* ``recompute``: the children of a ``ModuleList`` (``model.layers.i``, ``transformer.h.i``,
  ``bert.encoder.layer.i``) are the blocks;
* ``invact``: parameterless leaf activations whose output matches GELU / tanh-GELU / SiLU on a
  probe grid, norms whose forward matches LayerNorm / RMSNorm, and only where a dummy forward
  shows the next op saves their output;
* ``int4`` / ``prac`` / ``auto``: a ``saved_tensors_hooks`` policy sees the tensors ``linear``,
  ``scaled_dot_product_attention``, the activations and norms save, whatever module runs them;
* ``cola``: ``slimact.cola.convert(hf_llama_config)`` builds the CoLA model of a Llama config.

Any architecture: the strategies never read ``input_ids`` themselves, so vision and audio
models (``pixel_values``, ``input_features``, ``input_values``), encoder-only and encoder-decoder
models work alike (tests/test_hf_archs.py: eighteen of them); the probes that need one forward
build the model's own main input (:func:`dummy_inputs`). Training forwards of models that take
``use_cache`` run without a KV cache under recompute, as HF gradient checkpointing does
(``slimact.checkpointing``). What cannot work refuses in one line naming the class: ``auto``
profiles ``model(input_ids)``, so it takes decoder-only and encoder-only token models only;
``chunked-ce`` skips (with the reason in :func:`skipped`) models without a causal-LM loss.

This module adds what a user of that stack needs around it: :func:`lm_loss` (one loss call for
causal and masked LMs, ours and HF's), :func:`structure` (what slimact recognizes in a model),
:func:`unhandled` (saved bytes a strategy left untouched, per op: the sites it could not handle),
:func:`patched_modules` (empty after ``slimact.revert``), :class:`SlimactCallback` for
``transformers.Trainer``, and :func:`compile_blocks`.

torch.compile decision (measured: BENCHMARKS.md §7): compile the *blocks*, not
the root. The site router enters ``saved_tensors_hooks`` + a ``TorchFunctionMode`` around the
root forward and names saves by module path and op. Dynamo cannot inline those Python hooks (they
are not graph modules), so they stay active *around* a compiled block and see the saves
AOTAutograd chose for the whole graph, unnamed (``layers.0:saved#k``). That is exact for the
meter and harmless for ``none`` / ``recompute`` / ``invact`` (which act inside the op, and whose
custom ops are opaque to the compiler), but a codec policy (``int4``, ``prac``, ``auto``) chooses
codecs by site name and would silently store everything raw. So :func:`compile_blocks` leaves
the blocks of a model with a codec policy eager and reports why (the ``compiled-int8`` /
``compiled-int4`` strategies, ``slimact.compiled``, put codecs inside compiled blocks); the root
(embedding, loss) stays eager in every case, which keeps the router's entry and the norm checks
outside the graphs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from slimact import sites
from slimact.compiled.blocks import compile_as_is
from slimact.hf_inputs import dummy_inputs, is_hf_model, lm_loss, main_input, mlm_batch
from slimact.meter import MemoryReport, measure
from slimact.registry import AppliedChange, StrategyConfig, applied, apply, revert
from slimact.state import peek, state_of

_ACT_NAME = re.compile(r"gelu|silu|swish|act|relu|tanh|mish", re.IGNORECASE)
_NORM_NAME = re.compile(r"norm", re.IGNORECASE)
_ATTN_NAME = re.compile(r"attn|attention", re.IGNORECASE)


# ----------------------------------------------------------------------------- structure
def _is_linear(m: nn.Module) -> bool:
    # nn.Linear, and HF's GPT-2 ``Conv1D`` (a Linear with a transposed weight): weight + matmul
    if isinstance(m, nn.Linear):
        return True
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


def _is_leaf_act(m: nn.Module) -> bool:
    return (
        not list(m.children())
        and not list(m.parameters(recurse=False))
        and bool(_ACT_NAME.search(type(m).__name__))
    )


def _is_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    named = isinstance(m, (nn.LayerNorm, nn.GroupNorm)) or _NORM_NAME.search(type(m).__name__)
    return bool(named) and isinstance(w, torch.Tensor) and w.dim() == 1


@dataclass
class Structure:
    """What slimact recognizes in a model, by structure (module paths per kind)."""

    blocks: list[str] = field(default_factory=list)
    linears: list[str] = field(default_factory=list)
    attention_projections: list[str] = field(default_factory=list)
    activations: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.__dict__.items()}


def structure(model: nn.Module) -> Structure:
    """Blocks (ModuleList children), Linear-like layers (attention projections among them:
    Linear-likes inside a module named ``*attn*``/``*Attention*``), leaf activations, norms."""
    out = Structure(blocks=sites.block_paths(model))
    attn_scopes = [
        p for p, m in model.named_modules() if p and _ATTN_NAME.search(type(m).__name__ + p)
    ]
    for path, m in model.named_modules():
        if not path:
            continue
        if _is_linear(m):
            out.linears.append(path)
            if any(path.startswith(s + ".") for s in attn_scopes):
                out.attention_projections.append(path)
        elif _is_leaf_act(m):
            out.activations.append(path)
        elif _is_norm(m):
            out.norms.append(path)
    return out


def unhandled(report: MemoryReport, min_bytes: int = 1) -> dict[str, int]:
    """Bytes kept as they are (action 'keep'), per ``op`` and per kind of module: what a strategy
    left untouched on this model. Parameters never appear (the router skips them)."""
    out: dict[str, int] = {}
    for s in report.sites:
        if s.action == "keep" and s.bytes >= min_bytes:
            out[s.op] = out.get(s.op, 0) + s.bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def skipped(model: nn.Module) -> list[tuple[str, str, str]]:
    """(path, action, why) of every target a strategy could not handle on ``model``."""
    return [(c.path, c.action, c.detail) for c in applied(model) if c.skipped]


def patched_modules(model: nn.Module) -> list[str]:
    """Modules still carrying slimact's instance patches or state (empty after ``revert``)."""
    out = []
    for path, m in model.named_modules():
        keys = [k for k, v in m.__dict__.items() if k.startswith("_slimact") and v]
        if "forward" in m.__dict__ or keys or m.__dict__.get("_compiled_call_impl") is not None:
            out.append(path or "(root)")
    return out


# ----------------------------------------------------------------------------- Trainer
def _callback_base() -> type:
    try:  # optional dependency (slimact[hf])
        from transformers import TrainerCallback
    except ImportError:  # transformers is optional: the callback is then a plain object
        return object
    return TrainerCallback


class SlimactCallback(_callback_base()):
    """``Trainer(..., callbacks=[SlimactCallback("invact")])``: apply at train begin, revert at
    train end (``revert_at_end``), and record the first step's saved activation bytes.

    Plain ``slimact.apply(model, ...)`` before building the Trainer does the same; the callback
    only adds the measurement (``saved_bytes``, ``report``) and the revert. It works alike on a
    peft model and under TRL's trainers (whose fused LM head ``chunked-ce`` leaves as it is);
    with ``TrainingArguments(torch_compile=True)`` the first step raises (a model compiled whole
    runs past slimact's hooks): ``slimact.apply(model, spec, compile=True)`` instead.
    """

    def __init__(
        self, strategy: str | StrategyConfig, filter_fn=None, revert_at_end: bool = True
    ) -> None:
        self.strategy = strategy
        self.filter_fn = filter_fn
        self.revert_at_end = revert_at_end
        self.report: MemoryReport | None = None
        self.saved_bytes: int | None = None
        self._stack: ExitStack | None = None
        self._meter = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("SlimactCallback needs the Trainer to pass `model`")
        if not applied(model):
            apply(model, self.strategy, self.filter_fn)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.report is None and model is not None and self._stack is None:
            self._stack = ExitStack()
            self._meter = self._stack.enter_context(measure(model))

    def _close(self) -> None:
        if self._stack is not None:
            self.report = self._meter.report
            self.saved_bytes = int(self.report.total_bytes)
            self._stack.close()
            self._stack = None

    def on_substep_end(self, args, state, control, **kwargs):
        self._close()  # grad accumulation: the first micro-batch only

    def on_step_end(self, args, state, control, **kwargs):
        self._close()

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._close()
        if self.revert_at_end and model is not None:
            revert(model)


# ----------------------------------------------------------------------------- torch.compile
def codec_policy_installed(model: nn.Module) -> bool:
    """True when saves are routed through a codec policy (int4, prac, auto/plan)."""
    d = model.__dict__
    fwd = d.get("forward")
    st = peek(model)
    rt = st.runtime if st is not None else None
    # a plan runtime's own state ("codec-sites") counts only where it routes saves (a preset
    # that recomputes and reformulates alone does not)
    own = set(st.stateful) - {"codec-sites"} if st is not None else set()
    coded = bool(own) or (rt is not None and rt.routes_saves())
    return coded or (fwd is not None and hasattr(fwd, "__wrapped__"))


def compile_blocks(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    **compile_kwargs: Any,
) -> list[AppliedChange]:
    """``torch.compile`` every block (ModuleList child) in place; the root stays eager.

    Apply strategies first. Returns (and records, so ``slimact.revert`` undoes it) one change per
    block; blocks are left eager, with the reason, where a codec policy is installed (see the
    module docstring). ``compile_kwargs`` go to ``torch.compile`` (backend, mode, ...). The
    blocks compile where every compiled block does, ``compiled.blocks.compile_as_is``.
    """
    eager = (
        "left eager: a codec policy names sites by module and op, which a compiled graph hides "
        "(its saves would all be kept raw); for codecs inside compiled blocks use strategy "
        "compiled-int8 or compiled-int4 instead"
        if codec_policy_installed(model)
        else None
    )
    changes = compile_as_is(model, filter_fn, eager, **compile_kwargs)
    state_of(model).applied.extend(changes)
    return changes


def graph_breaks() -> dict[str, int]:
    """dynamo's graph-break counter (reason -> count) since the last ``torch._dynamo.reset()``."""
    return dict(counters["graph_break"])


__all__ = [
    "SlimactCallback",
    "Structure",
    "codec_policy_installed",
    "compile_blocks",
    "dummy_inputs",
    "graph_breaks",
    "is_hf_model",
    "lm_loss",
    "main_input",
    "mlm_batch",
    "patched_modules",
    "skipped",
    "structure",
    "unhandled",
]
