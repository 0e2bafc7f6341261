"""Reformulated activations and norms: swap them for inverted ops that save their outputs.

``find_invact(model, InvActConfig, filter_fn)`` finds what the action would change (the probe
included) without changing the model: the ``invact`` strategies' planner
(``slimact.strategies.invact``) makes it a plan's ``reform`` rows. ``patch_invact`` is the one
implementation of the swap, used by the plan runtime (``slimact.planner.apply``) for those rows
and by the planner's measurements.

The inverted ops (invact.txt): every GELU (erf or tanh form) and SiLU — ``nn.GELU``, ``nn.SiLU``
and transformers' ``GELUActivation``, ``NewGELUActivation``, ``FastGELUActivation``,
``GELUTanh``/``PytorchGELUTanh``, ``SiLUActivation`` … — saves ``y`` + 1 bit instead of ``x``;
with ``norms`` the inverted RMSNorm / LayerNorm (``slimact.ops.inv_norm``) save ``y`` + rstd
instead of ``x`` (and ``x̂``).

Candidates are recognised by behaviour, not by class (``slimact.classify``): an activation
candidate is a parameterless leaf module whose class name mentions gelu/silu/swish/act, and its
kind is whichever of {gelu, gelu_tanh, silu} its output matches on a probe grid (QuickGELU, Mish,
ReLU² … match none and are reported as skipped). A norm candidate is an ``nn.LayerNorm`` or a
``*RMSNorm`` with one 1-D weight whose output equals ``w ⊙ x·rsqrt(mean(x²)+eps)`` (Gemma's
``1+w`` does not).

The saving exists only if the next op saves the same output tensor (paper §5). ``probe=True``
checks that on the real graph: one forward on a tiny dummy batch (slimact models: token ids;
Hugging Face models: ``hf_inputs.dummy_inputs``, the forward's own main input: token ids,
``pixel_values``, ``input_features`` or ``input_values``), in training mode, RNG state preserved,
under the site router, recording which sites save each candidate's output storage. A
candidate whose output no other op saves — e.g. a norm or activation followed by dropout in
training mode (dropout saves a mask and hands the Linear a new tensor) — is skipped with that
reason: swapping it would keep y instead of x, no saving. Where no dummy input can be made the
swap is applied and the change says "unverified".

The swap patches the instance ``forward`` with a ``patching.ForwardOverride`` (module class,
paths, state_dict unchanged; copies and pickles of the model carry their own swap);
``slimact.revert`` restores it. Norm weights are re-checked at run time (see ``inv_norm``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from slimact import sites
from slimact.classify import classify_activation, classify_norm, is_activation_leaf, rms_eps
from slimact.hf_inputs import dummy_inputs, is_hf_model
from slimact.modules.inv_act import NormInvertibility
from slimact.ops.inv_act import BACKENDS, BF16_MODES, inv_act, pick_variant
from slimact.ops.inv_act_approx import KINDS, MODES
from slimact.ops.inv_norm import inv_layer_norm, inv_rms_norm, invertible
from slimact.patching import override_forward, pop_attr, run_all
from slimact.registry import AppliedChange, FilterFn, StrategyConfig
from slimact.spec import listed
from slimact.utils import model_device


@dataclass(frozen=True)
class InvActConfig(StrategyConfig):
    """``mode``: f'(f⁻¹) evaluation ('newton' | 'paper'); ``variant``: 'bitmask' | 'lsb';
    ``bf16``: for bfloat16 / float16 inputs (autocast included), 'floor' keeps the variant (1 bit
    per element, derivative error up to ~4x torch's own near the branch point) and
    'exact-near-branch' stores x exactly near it (1 byte per element; torch's own error; see
    ``ops.inv_act``); ``ops``: activation kinds to swap; ``norms``: also invert
    RMSNorm/LayerNorm; ``probe``: verify on a dummy forward that the next op saves the output.
    Spec form: ``invact@bf16=exact-near-branch,mode=paper``."""

    mode: str = "newton"
    variant: str = "bitmask"
    ops: tuple[str, ...] = KINDS
    norms: bool = True
    max_bias_ratio: float = 4.0
    probe: bool = True
    backend: str = "auto"
    bf16: str = "floor"

    # what a spec sets (``ops``: activation kinds joined by ``/``, ``ops=none`` for norms only)
    spec_fields: ClassVar = {
        "bf16": str, "mode": str, "variant": str, "backend": str, "ops": listed(str, "none"),
    }  # fmt: skip

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.variant not in ("bitmask", "lsb"):
            raise ValueError(f"variant must be 'bitmask' or 'lsb', got {self.variant!r}")
        if self.bf16 not in BF16_MODES:
            raise ValueError(f"bf16 must be one of {BF16_MODES}, got {self.bf16!r}")
        bad = [k for k in self.ops if k not in KINDS]
        if bad or not isinstance(self.ops, tuple):
            raise ValueError(f"ops must be a tuple drawn from {KINDS}, got {self.ops!r}")
        if not self.max_bias_ratio > 0:
            raise ValueError(f"max_bias_ratio must be > 0, got {self.max_bias_ratio}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


def _dummy_call(model: nn.Module):
    """A zero-argument callable running a tiny forward, or None."""
    dev = model_device(model)
    if is_hf_model(model):  # the input its forward takes: pixel_values, input_features, ...
        inputs = dummy_inputs(model)
        return None if inputs is None else (lambda: model(**inputs))
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and dummy:
        inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in dummy.items()}
        return lambda: model(**inputs)
    cfg = getattr(model, "config", None)
    vocab, max_len = getattr(cfg, "vocab_size", None), getattr(cfg, "max_seq_len", None)
    if isinstance(vocab, int) and isinstance(max_len, int):
        ids = torch.arange(min(16, max_len), device=dev).remainder(vocab).view(1, -1)
        return lambda: model(ids)
    return None


def probe_consumers(model: nn.Module, paths: list[str]) -> dict[str, list[str]] | None:
    """For each path: the sites outside that module that save its output (None: can't probe).

    RNG state (dropout masks, random dummy inputs) and every module's training flag are restored.
    """
    with torch.random.fork_rng(devices=[]):
        return _probe(model, paths)


def _probe(model: nn.Module, paths: list[str]) -> dict[str, list[str]] | None:
    call = _dummy_call(model)
    if call is None:
        return None
    modules = dict(model.named_modules())
    outputs: dict[int, str] = {}  # storage pointer -> candidate path
    keep: list[torch.Tensor] = []
    consumers: dict[str, list[str]] = {p: [] for p in paths}

    def hook_for(path):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                keep.append(out)
                outputs[out.untyped_storage().data_ptr()] = path

        return hook

    def listen(ev: sites.SavedEvent) -> None:
        owner = outputs.get(ev.tensor.untyped_storage().data_ptr())
        if owner is not None and not (ev.module == owner or ev.module.startswith(owner + ".")):
            consumers[owner].append(ev.site)

    flags = {m: m.training for m in model.modules()}
    handles = [modules[p].register_forward_hook(hook_for(p)) for p in paths]
    try:
        model.train()
        with torch.enable_grad(), sites.probing(), sites.tracking(model), sites.listening(listen):
            call()
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags.items():
            m.training = flag
        keep.clear()
    return consumers


def _patch(module: nn.Module, wrapper, args: tuple, action: str, path: str, detail: str):
    _, undo = override_forward(module, wrapper, *args)
    undo = functools.partial(run_all, undo, functools.partial(pop_attr, module, "_slimact_inv"))
    return AppliedChange(path, action, detail, undo=undo)


def _act_forward(inner, kind, mode, variant, backend, bf16, x):
    variant = pick_variant(x.dtype, variant, bf16)
    return inv_act(x, kind, mode=mode, variant=variant, backend=backend)


def _norm_ok(module, bias, x) -> bool:
    """Eager: (re)check y / w invertibility (cached per weight version). Under torch.compile the
    check (host syncs, data_ptr keys) cannot run in the graph: the root pre-hook
    ``_refresh_norm_checks`` ran it eagerly before this forward and dynamo guards on the cached
    verdict, so a flip recompiles instead of breaking the graph."""
    inv = module._slimact_inv
    if torch.compiler.is_compiling():
        return inv.reason is None
    return inv.check(module.weight, bias, x.dtype)


def _refresh_norm_checks(norms, root, args):
    for m in norms:
        inv = m.__dict__.get("_slimact_inv")
        if inv is not None and getattr(m, "weight", None) is not None:
            calls = inv.fallbacks  # the norm's own forward counts its fallback, not this re-check
            inv.check(m.weight, getattr(m, "bias", None), inv.last_dtype or m.weight.dtype)
            inv.fallbacks = calls


def _rms_forward(inner, module, eps, x):
    ok = _norm_ok(module, None, x)
    return inv_rms_norm(x, module.weight, eps, check=not ok)


def _ln_forward(inner, module, x):
    ok = _norm_ok(module, module.bias, x)
    return inv_layer_norm(
        x,
        module.normalized_shape,
        module.weight,
        module.bias,
        module.eps,
        max_bias_ratio=module._slimact_inv.max_bias_ratio,
        check=not ok,
    )


def find_invact(
    model: nn.Module, config: InvActConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    """What ``invact`` would change, found without changing the model: per candidate module its
    row (action ``invact:<kind>`` / ``invnorm:<kind>``, or skipped with the reason: not
    GELU/SiLU, not in ``ops``, filtered out, forward already patched, output saved by no next
    op), then the ``invnorm-check`` row when a norm is inverted. With ``config.probe`` the
    consumer probe (``probe_consumers``: forward hooks, under ``sites.probing()``, the model's
    RNG and training flags restored) decides; the rows carry no undo.

    Found outside autocast, whatever the caller runs under (``SlimactCallback`` applies inside
    ``Trainer``'s autocast): the classification grids need full precision, and under autocast
    the next op saves its low-precision cast of the candidate's output, not the output, so the
    probe would turn down the norms the same strategy applied before autocast swaps (the
    inverted norm still saves less than the norm's own saves there). The sites found are the
    ones found before autocast."""
    dev = model_device(model)
    if dev.type in ("cpu", "cuda") and torch.is_autocast_enabled(dev.type):
        with torch.autocast(dev.type, enabled=False):
            return find_invact(model, config, filter_fn)
    changes: list[AppliedChange] = []
    plan: dict[str, tuple[str, str]] = {}  # path -> ("act", kind) | ("norm", "rms"/"layer")
    for path, m in model.named_modules():
        if not path:
            continue
        if is_activation_leaf(m):
            kind, err = classify_activation(m, dev)
            if kind is None:
                why = (
                    f"{type(m).__name__} is not GELU/tanh-GELU/SiLU (closest max |diff| {err:.2g})"
                )
                changes.append(AppliedChange(path, "invact", why, skipped=True))
            elif kind not in config.ops:
                changes.append(AppliedChange(path, "invact", f"{kind} not in ops", skipped=True))
            else:
                plan[path] = ("act", kind)
            continue
        if config.norms:
            norm, why = classify_norm(m, dev)
            if norm is not None:
                plan[path] = ("norm", norm)
            elif why:
                changes.append(AppliedChange(path, "invnorm", why, skipped=True))
    modules = dict(model.named_modules())
    for path in list(plan):
        m = modules[path]
        if filter_fn is not None and not filter_fn(m, path):
            changes.append(AppliedChange(path, "invact", "filtered out", skipped=True))
            del plan[path]
        elif "forward" in m.__dict__:
            changes.append(AppliedChange(path, "invact", "forward already patched", skipped=True))
            del plan[path]
    consumers = probe_consumers(model, list(plan)) if (config.probe and plan) else None
    norms = 0
    for path, (what, kind) in plan.items():
        m = modules[path]
        action = f"invact:{kind}" if what == "act" else f"invnorm:{kind}"
        if consumers is not None and not consumers[path]:
            changes.append(AppliedChange(path, action, _NOT_SAVED, skipped=True))
            continue
        detail = (
            f"saved by {consumers[path][0]}"
            if consumers is not None
            else "unverified (no dummy input to probe the consumer)"
        )
        if what == "norm":
            norms += 1
            w, b = getattr(m, "weight", None), getattr(m, "bias", None)
            dtype = w.dtype if w is not None else torch.float32
            reason = invertible(w, b if kind == "layer" else None, dtype, config.max_bias_ratio)
            if reason is not None:
                detail += f"; falls back to saving x while {reason}"
        changes.append(AppliedChange(path, action, detail))
    if norms:  # the eager re-check of y / w before each forward (see _norm_ok)
        changes.append(AppliedChange("", NORM_CHECK, f"{norms} norm(s)"))
    if not changes:
        changes.append(AppliedChange("", "invact", "no GELU/SiLU/norm modules found", True))
    return changes


_NOT_SAVED = (
    "output is not saved by the next op (e.g. dropout follows): inverting would keep y instead "
    "of x, no saving"
)
NORM_CHECK = "invnorm-check"  # the row of the root pre-hook re-checking inverted norms


def patch_invact(
    model: nn.Module, config: InvActConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    """Swap the modules ``find_invact`` finds for the inverted ops: the plan runtime's patcher
    (with ``probe=False`` and ``filter_fn`` its planned modules) and the planner's, measuring
    one module. ``find_invact``'s rows, each swap and the norms' re-check hook undoable."""
    rows = find_invact(model, config, filter_fn)
    modules = dict(model.named_modules())
    out: list[AppliedChange] = []
    norms = []
    for row in rows:
        if row.skipped or row.action == NORM_CHECK or not row.path:
            if row.action != NORM_CHECK:
                out.append(row)
            continue
        m = modules[row.path]
        what, _, kind = row.action.partition(":")
        if what == "invact":
            fwd = (_act_forward, (kind, config.mode, config.variant, config.backend, config.bf16))
        else:
            m._slimact_inv = NormInvertibility(config.max_bias_ratio)
            fwd = (_rms_forward, (m, rms_eps(m))) if kind == "rms" else (_ln_forward, (m,))
            norms.append(m)
        out.append(_patch(m, *fwd, row.action, row.path, row.detail))
    if norms:  # eager re-check of y / w before each forward, for compiled blocks (see _norm_ok)
        handle = model.register_forward_pre_hook(functools.partial(_refresh_norm_checks, norms))
        out.append(AppliedChange("", NORM_CHECK, f"{len(norms)} norm(s)", undo=handle.remove))
    return out


def fallback_report(model: nn.Module) -> dict[str, dict]:
    """Per inverted norm: calls that fell back to saving x, and the current reason (or None)."""
    out = {}
    for path, m in model.named_modules():
        inv = m.__dict__.get("_slimact_inv")
        if inv is not None:
            out[path] = {"fallbacks": inv.fallbacks, "reason": inv.reason}
    return out
