"""The loss head reformulated: output projection + cross-entropy without stored logits.

``find_chunked_ce(model, ChunkedCEConfig, filter_fn)`` finds the head (its probe included)
without changing the model, for the ``chunked-ce`` strategy's plan; ``patch_chunked_ce`` is the
one implementation of the patch, used by the plan runtime for a plan that reformulates the head
(the ``chunked-ce`` strategy's, ``slimact.strategies.chunked_ce``) and by the planner's
measurements.

With a real vocabulary the head's log-probabilities are the largest single site (250 of 760 MiB
for llama-20m at V = 32,000, 8 × 256 tokens). This strategy computes the head's loss with
``slimact.ops.chunked_ce.chunked_linear_cross_entropy``, which keeps (h, targets, lse) instead of
N × V values (see that module for the math and the recompute / precompute trade-off).

The head is found by structure: the output embedding (``model.get_output_embeddings()``, else
``model.lm_head``), an ``nn.Linear`` (tied to the input embedding or not), and the forward's
label argument: ``targets`` (slimact's models; already shifted, ``-100`` ignored) or ``labels``
(Hugging Face causal LMs; shifted inside as ``ForCausalLMLoss`` does, or ``shift_labels`` as
given, ``ignore_index`` from the call, ``num_items_in_batch`` turning the mean into sum / items for
gradient accumulation). Two instance forwards (``patching.ForwardOverride``) share one small
state object:

* the root's: when a label is passed and grad is enabled, it calls the model *without* the
  label, with the label parked in the state;
* the head's: with a label parked, it computes the loss from its input (so HF's
  ``logits_to_keep`` slice and the site name ``lm_head:chunked_ce#k`` come for free) and returns
  a zero-stride placeholder of the logits' shape (no memory) instead of the logits.

The root then returns the model's output with ``loss`` set and ``logits=None``: in training with
labels the full logits are never computed. No caller in slimact reads ``.logits`` in training
(train loop, compare, bench and meter read ``.loss``); eval without labels, ``torch.no_grad``
(evaluation, ``generate``) and calls without labels run the model unchanged, logits included
(a training call without labels says so once: it saves nothing there). A call with TRL's
``fused_lm_head=True`` runs unchanged too, its labels left where TRL's forward reads them (TRL's
own fused head stores no logits either), said once.

Through a peft wrapper (``PeftModel``) the loss is the wrapped Hugging Face model's
(``hf_inputs.hf_model_of``): its labels shifted, its label argument where the wrapper's forward only
passes ``*args, **kwargs`` on.

``probe=True`` checks on a tiny dummy batch that the chunked loss equals the model's own loss
(with ``num_items_in_batch`` too, under the autocast the head runs in; see ``_probe``); a
model whose head does more than ``linear`` + cross-entropy (Gemma-2's logit soft-capping,
Cohere's logit scale, a custom loss) is skipped with that reason. The planner considers the head
only where the same probe passes. ``slimact.revert`` undoes both overrides (a wrapper installed
over the root's after it, such as accelerate's mixed-precision forward, keeps calling a retired
root, which passes calls through); copies and pickles of the model carry their own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from slimact import sites
from slimact.classify import label_arg
from slimact.hf_inputs import hf_model_of
from slimact.ops.chunked_ce import BACKENDS, MODES, chunked_linear_cross_entropy
from slimact.patching import override_forward, overrides, run_all
from slimact.registry import AppliedChange, FilterFn, StrategyConfig

_PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6}  # else (bf16/fp16) 2e-2
PROBE_LOGIT_STD = 10.0  # the probe's second run: logits about this large (see _probe)


@dataclass(frozen=True)
class ChunkedCEConfig(StrategyConfig):
    """``chunk_size``: tokens per chunk (None: ``default_chunk_size(V)``); ``mode``: 'recompute'
    (keeps h, targets, lse) or 'precompute' (keeps dh, dW; no extra matmul); ``probe``: check
    the loss on a dummy batch before patching. Spec: ``chunked-ce@256,precompute``."""

    chunk_size: int | None = None
    mode: str = "recompute"
    backend: str = "auto"
    probe: bool = True

    spec_fields: ClassVar = {"chunk_size": int, "mode": str}  # bare in a spec: ``chunked-ce@256``

    def __post_init__(self) -> None:
        c = self.chunk_size
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(
                f"ChunkedCEConfig.chunk_size must be a positive int or None, got {c!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"ChunkedCEConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"ChunkedCEConfig.backend must be one of {BACKENDS}, got {self.backend!r}"
            )


class HeadState:
    """What the root and head overrides share: the config, the head, and the pending call."""

    __slots__ = (
        "head",
        "chunk_size",
        "mode",
        "backend",
        "label",
        "label_pos",
        "shift",
        "job",
        "told",
        "live",
    )

    def __init__(self, head, config: ChunkedCEConfig, label: str, label_pos: int, shift: bool):
        self.head = head
        self.chunk_size, self.mode, self.backend = config.chunk_size, config.mode, config.backend
        self.label, self.label_pos, self.shift = label, label_pos, shift
        self.job: dict | None = None  # labels, num_items, ignore_index, shift_labels -> loss
        self.told: set[str] = set()  # the calls left unchanged that were said once
        self.live = True  # False once undone (see ``_retire``)


def _retire(state: HeadState) -> None:
    """The undo's last step. A wrapper installed over the root override after it (accelerate's
    ``prepare`` wraps ``model.forward`` in autocast for mixed precision, holding the override
    inside) keeps calling it after ``undo_forward`` took it out of the instance: retired, it
    passes every call through."""
    state.live = False


def _hf_like(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def _shifts(model: nn.Module) -> bool:
    """Does the model's loss shift its labels inside (Hugging Face causal LMs, also under
    peft), rather than take them shifted (slimact's ``targets``)?"""
    return _hf_like(hf_model_of(model))


def _label_arg(model: nn.Module) -> tuple[str, int] | None:
    """The forward's label parameter; a peft wrapper whose forward takes ``*args, **kwargs``
    (``PeftModel`` without a task type) passes them on: the wrapped model's."""
    arg = label_arg(model)
    inner = hf_model_of(model)
    return arg if arg is not None or inner is model else label_arg(inner)


def find_head(model: nn.Module) -> tuple[str, nn.Module | None, str]:
    """(path, head, why-not): the output projection, by structure."""
    head = None
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (AttributeError, NotImplementedError):
            head = None
    if head is None:
        head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        return "", None, "no output embedding (get_output_embeddings() / lm_head)"
    path = next((p for p, m in model.named_modules() if m is head), "")
    if not isinstance(head, nn.Linear):
        return path, None, f"output embedding is a {type(head).__name__}, not an nn.Linear"
    return path, head, ""


def _take_label(state: HeadState, args: tuple, kwargs: dict):
    if len(args) > state.label_pos:
        return (
            args[state.label_pos],
            (*args[: state.label_pos], None, *args[state.label_pos + 1 :]),
            kwargs,
        )
    if state.label in kwargs:
        return kwargs[state.label], args, {**kwargs, state.label: None}
    return None, args, kwargs


def _with_loss(out, loss: torch.Tensor):
    """The model's output with ``loss`` set and the (placeholder) logits dropped."""
    if isinstance(out, tuple):
        return (loss, None, *out[1:])
    if dataclasses.is_dataclass(out):
        return dataclasses.replace(out, loss=loss, logits=None)
    raise TypeError(f"chunked-ce: cannot set the loss on a {type(out).__name__} output")


# The caller's own fused head: TRL's trainers call ``model(..., labels=..., fused_lm_head=True)``
# and compute the loss from the per-token log-probabilities the model returns, reading the labels
# in the model's (TRL-patched) forward; such a call runs unchanged, its labels where they were.
_CALLER_HEAD = "fused_lm_head"


def _tell_once(state: HeadState, key: str, msg: str) -> None:
    if key not in state.told and not sites.is_probing():
        state.told.add(key)
        warnings.warn(f"slimact chunked-ce: {msg}", stacklevel=4)


def _park(state: HeadState, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Take the call's label into ``state.job`` for the head; (args, kwargs) without it, or
    None when the call runs unchanged (no label, no grad, a caller's fused head)."""
    if state.job is not None or not torch.is_grad_enabled():
        return None
    if kwargs.get(_CALLER_HEAD):
        _tell_once(
            state,
            _CALLER_HEAD,
            f"a call with {_CALLER_HEAD}=True (TRL's trainers) computes its loss with the "
            "caller's own fused head, which stores no logits either; chunked-ce leaves it as "
            "it is",
        )
        return None
    labels, a, kw = _take_label(state, args, kwargs)
    if labels is None:
        _tell_once(
            state,
            "no-labels",
            f"a training forward without `{state.label}` computes the full logits (the caller "
            f"computes the loss); chunked-ce saves memory where the model gets `{state.label}` "
            "and returns the loss itself",
        )
        return None
    state.job = {
        "labels": labels,
        "num_items": kwargs.get("num_items_in_batch"),
        "ignore_index": kwargs.get("ignore_index", -100),
        "shift_labels": kwargs.get("shift_labels"),
        "loss": None,
    }
    return a, kw


def _finish(state: HeadState, out):
    loss = state.job["loss"] if state.job is not None else None
    state.job = None
    if loss is None:
        raise RuntimeError(
            "chunked-ce: the model's forward did not call its output projection; "
            "slimact.revert(model) and report the model class"
        )
    return _with_loss(out, loss)


def _root_forward(inner, state: HeadState, *args, **kwargs):
    parked = _park(state, args, kwargs) if state.live else None
    if parked is None:
        return inner(*args, **kwargs)
    try:
        out = inner(*parked[0], **parked[1])
    except BaseException:
        state.job = None
        raise
    return _finish(state, out)


def _state_of(model: nn.Module) -> HeadState | None:
    return next((o.args[0] for o in overrides(model) if o.wrapper is _root_forward), None)


def park_labels(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """For a forward pre-hook of the root: what the root override does on entry. A hook sees
    the call even when the override was installed during this very call (``nn.Module`` reads
    ``forward`` before its pre-hooks run), e.g. by a plan solved on the first batch. Returns
    (args, kwargs) without the label, or None (nothing parked: the call runs unchanged)."""
    state = _state_of(model)
    return None if state is None else _park(state, args, kwargs)


def loss_output(model: nn.Module, out):
    """For a forward hook of the root after ``park_labels``: the output with the head's loss."""
    state = _state_of(model)
    if state is None:
        raise RuntimeError("chunked-ce: loss_output without a chunked head on this model")
    return _finish(state, out)


def _head_forward(inner, state: HeadState, x: torch.Tensor, *args, **kwargs):
    job = state.job
    if job is None or job["loss"] is not None:
        return inner(x, *args, **kwargs)
    job["loss"] = _chunked_loss(state, job, x)
    return x.new_zeros(()).expand(*x.shape[:-1], state.head.out_features)  # placeholder, no memory


def _chunked_loss(state: HeadState, job: dict, x: torch.Tensor) -> torch.Tensor:
    """The loss of ``job`` (labels, num_items, ignore_index, shift_labels) from the head's
    input ``x``, in token chunks."""
    head = state.head
    ignore = job["ignore_index"]
    t = job["shift_labels"]
    if t is None:
        t = job["labels"]
        if state.shift:  # HF ForCausalLMLoss: tokens < n predict n
            t = F.pad(t, (0, 1), value=ignore)[..., 1:]
    h = x.reshape(-1, x.shape[-1])  # (B, S, D) -> (N, D)
    t = t.reshape(-1).to(x.device)
    if t.numel() != h.shape[0]:
        raise ValueError(
            f"chunked-ce: {t.numel()} labels for {h.shape[0]} positions reaching the head "
            "(logits_to_keep with labels?)"
        )
    n_items = job["num_items"]
    red = "mean" if n_items is None else "sum"
    loss = chunked_linear_cross_entropy(
        h, head.weight, t, head.bias, ignore_index=ignore, reduction=red,
        chunk_size=state.chunk_size, mode=state.mode, backend=state.backend,
    )  # fmt: skip
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
    return loss


def _dummy_batch(model: nn.Module, label: str) -> dict | None:
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and isinstance(dummy.get("input_ids"), torch.Tensor):
        ids = dummy["input_ids"].to(dev)
        return {"input_ids": ids, label: ids}
    cfg = getattr(model, "config", None)
    vocab, max_len = getattr(cfg, "vocab_size", None), getattr(cfg, "max_seq_len", None)
    if isinstance(vocab, int) and isinstance(max_len, int):
        ids = torch.arange(min(16, max_len), device=dev).mul(7).remainder(vocab).view(1, -1)
        return {"input_ids": ids, label: ids.roll(-1, 1)}
    return None


def _takes_num_items(model: nn.Module) -> bool:
    """Can ``model`` be passed ``num_items_in_batch`` (by name or ``**kwargs``)? Where it
    cannot, ``Trainer`` passes none, and the probe does not either."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "num_items_in_batch" or p.kind is p.VAR_KEYWORD for p in params)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``device``, else None."""
    dev = device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _probe(model: nn.Module, state: HeadState, strict: bool = False) -> str:
    """'' when the chunked loss matches the model's own on a dummy batch, else why not.

    The model is not patched: one forward with the label gives the model's own loss and, by a
    forward hook, the head's input, from which the chunked loss is computed as the patched head
    computes it (and set on the model's output as the patched root sets it). Twice: with the
    head's weights as they are, and scaled so that the logits' spread is about
    ``PROBE_LOGIT_STD`` (restored after). At initialization the logits are ~0.1 and a
    soft-capped head (``cap * tanh(z / cap)``) computes nearly ``z``, so only large logits
    tell the two losses apart. A Hugging Face model's second run passes ``num_items_in_batch``
    where its forward takes it (as ``Trainer`` does under gradient accumulation; more than the
    batch's labels), so that its loss must be the sum over the items, as the chunked one is. With the model's
    forward under autocast (accelerate's ``mixed_precision``, which ``Trainer(bf16=True)``
    wraps the model's forward in) the chunked loss is computed under the same autocast as the
    head's call, and the two compare at the tolerance of autocast's dtype."""
    batch = _dummy_batch(model, state.label)
    if batch is None:
        return "unverified (no dummy input to probe the loss)"
    flags = {m: m.training for m in model.modules()}
    weight = state.head.weight
    saved = weight.detach().clone()
    rms = float(saved.float().pow(2).mean().sqrt()) * weight.shape[-1] ** 0.5
    scales = (1.0, PROBE_LOGIT_STD / rms) if rms > 0 and math.isfinite(rms) else (1.0,)
    job = {"labels": batch[state.label], "num_items": None, "ignore_index": -100}
    inputs: list[tuple[torch.Tensor, torch.dtype | None]] = []  # the head's input, autocast
    hook = state.head.register_forward_pre_hook(
        lambda m, args: inputs.append((args[0], _autocast_dtype(args[0].device)))
    )
    low = False  # did the head run under a low-precision autocast?
    takes_items = state.shift and _takes_num_items(model)
    pairs = []
    try:
        model.eval()  # no dropout: both losses see the same function
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), sites.probing():
            for k, scale in enumerate(scales):
                with torch.no_grad():
                    weight.copy_(saved * scale)
                inputs.clear()
                items = job["labels"].numel() + 3 if k and takes_items else None
                kw = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
                out = model(**batch, **kw)
                if not inputs:
                    raise RuntimeError(
                        "chunked-ce: the model's forward did not call its output projection; "
                        "slimact.revert(model) and report the model class"
                    )
                x, cast = inputs[0]
                low = low or cast not in (None, torch.float32, torch.float64)
                with torch.autocast(x.device.type, dtype=cast, enabled=cast is not None):
                    loss = _chunked_loss(
                        state, {**job, "num_items": items, "shift_labels": None}, x
                    )
                got = getattr(_with_loss(out, loss), "loss", None)
                pairs.append((getattr(out, "loss", None), got))
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RuntimeError) as e:
        # the model's own failures (e.g. an output type the loss cannot be set on); a bug of
        # ours (NameError, ImportError, ...) propagates instead of reading as a skipped head
        if strict:
            raise
        return f"MISMATCH: {type(e).__name__}: {e}"
    finally:
        hook.remove()
        with torch.no_grad():
            weight.copy_(saved)
        for m, flag in flags.items():
            m.training = flag
    rtol = 2e-2 if low else _PROBE_RTOL.get(weight.dtype, 2e-2)
    for ref, got in pairs:
        if ref is None or got is None:
            return "MISMATCH: the model returned no loss for labels"
        if not torch.allclose(got.detach().float(), ref.detach().float(), rtol=rtol, atol=rtol):
            got, ref = float(got.detach()), float(ref.detach())
            return (
                f"MISMATCH: chunked loss {got:.6g} != model's {ref:.6g} (the head does more "
                "than linear + cross-entropy, e.g. logit soft-capping or scaling)"
            )
    return ""


def find_chunked_ce(
    model: nn.Module,
    config: ChunkedCEConfig,
    filter_fn: FilterFn | None = None,
    *,
    strict: bool = False,
) -> list[AppliedChange]:
    """What ``chunked-ce`` would change, found without changing the model: the loss head's row
    (action ``chunked-ce``), or skipped with the reason (no head or label, not a causal-LM
    loss, filtered out, already patched, the probe's mismatch). With ``config.probe`` the loss
    is checked on a dummy batch (``_probe``: under ``sites.probing()``, the head's weights,
    the RNG and the training flags restored); ``strict``: the model's own failure in the probe
    raises (the planner's, whose every run's failure does) instead of skipping the head. One
    row, without an undo."""
    path, head, why = find_head(model)
    arg = _label_arg(model)
    if head is None or arg is None:
        why = why or "the forward takes neither `labels` nor `targets`"
        return [AppliedChange(path, "chunked-ce", why, skipped=True)]
    inner = hf_model_of(model)
    loss_type = getattr(inner, "loss_type", None) if _hf_like(inner) else None
    if loss_type not in (None, "ForCausalLM"):  # e.g. ForMaskedLM: labels are not shifted
        why = f"{type(inner).__name__} computes a {loss_type} loss; only causal-LM losses chunk"
        return [AppliedChange(path, "chunked-ce", why, skipped=True)]
    if filter_fn is not None and not filter_fn(head, path):
        return [AppliedChange(path, "chunked-ce", "filtered out", skipped=True)]
    if any(o.wrapper is _head_forward for o in overrides(head)):
        return [AppliedChange(path, "chunked-ce", "already applied", skipped=True)]
    if "forward" in head.__dict__:
        return [AppliedChange(path, "chunked-ce", "head forward already patched", skipped=True)]
    detail = f"{arg[0]} -> {config.mode}, chunk {config.chunk_size or 'auto'}"
    if config.probe:
        state = HeadState(head, config, arg[0], arg[1], shift=_shifts(model))
        why = _probe(model, state, strict)
        if why.startswith("MISMATCH"):
            return [AppliedChange(path, "chunked-ce", why[10:], skipped=True)]
        detail += f"; {why}" if why else "; loss verified on a dummy batch"
    return [AppliedChange(path, "chunked-ce", detail)]


def patch_chunked_ce(
    model: nn.Module, config: ChunkedCEConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    """Patch the loss head ``find_chunked_ce`` finds (the root's and the head's overrides): the
    plan runtime's patcher (``probe=False``: the plan names the head) and the planner's,
    measuring the head. ``find_chunked_ce``'s row, undoable where it patched."""
    (row,) = find_chunked_ce(model, config, filter_fn)
    if row.skipped:
        return [row]
    head = model.get_submodule(row.path) if row.path else model
    arg = _label_arg(model)
    state = HeadState(head, config, arg[0], arg[1], shift=_shifts(model))
    _, undo_head = override_forward(head, _head_forward, state)
    _, undo_root = override_forward(model, _root_forward, state)
    row.undo = functools.partial(run_all, undo_root, undo_head, functools.partial(_retire, state))
    return [row]
