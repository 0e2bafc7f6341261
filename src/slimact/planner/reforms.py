"""Profiling the reformulate action: what a reformulated module saves instead, and what it costs.

Two families (``slimact.reformulate``), measured on the profiling forward's captured tensors so
that each new save can be matched to a profiled storage by pointer:

* **activations and norms** (``measure_reform``): the candidate module alone, inverted, runs
  under the meter on its captured inputs: the sites it no longer saves (``silenced``), the
  storages that gain a saver (its output, which the inverted op keeps; ``added`` with the new
  site names), the bytes of new storages (bit mask, rstd), and the fwd+bwd time difference,
  interleaved with the original's so that drifting load cancels;
* **the loss head** (``measure_head_reform``): the model's forward runs once more with the head
  reformulated as ``chunked-ce``: the root sites that disappear (the logits' and the loss's
  saves), the storages its chunked op saves again (the head's input h, the targets) and the new
  bytes (the per-token log-sum-exp). Its time is the difference between ``linear`` +
  ``cross_entropy`` and ``chunked_linear_cross_entropy`` forward+backward on the captured h and
  targets (``labels`` for Hugging Face models, shifted inside as their loss does).

Each result is a ``ReformProfile`` of its kind; the MILP decides with one binary per module.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from slimact import sites
from slimact.classify import classify_activation, classify_norm, is_activation_leaf, label_arg
from slimact.meter import measure
from slimact.ops.chunked_ce import chunked_linear_cross_entropy
from slimact.planner.measure import call_module, fwd_bwd, time_delta
from slimact.planner.plan import KindProfile, ReformProfile, abs_path, inside, rel_site, site_module
from slimact.reformulate import (
    ChunkedCEConfig,
    InvActConfig,
    find_chunked_ce,
    patch_chunked_ce,
    patch_invact,
)
from slimact.reformulate.head import find_head

HEAD_KIND = "chunked-ce"


def reform_candidates(block: nn.Module, device: torch.device) -> list[str]:
    """Paths (relative to ``block``) of the activations and norms ``patch_invact`` can invert."""
    out = []
    for path, m in block.named_modules():
        if is_activation_leaf(m):
            if classify_activation(m, device)[0] is not None:
                out.append(path)
        elif path and classify_norm(m, device)[0] is not None:
            out.append(path)
    return out


def _undo(changes: list) -> None:
    for c in reversed(changes):
        if c.undo is not None and not c.skipped:
            c.undo()


def measure_reform(prof: Any, kp: KindProfile, rep: str, rel: str) -> None:
    """Invert module ``rel`` of block ``rep`` alone and record what its saves become."""
    path = abs_path(rel, rep)
    if path not in prof.captured:
        return
    args, kwargs, out0 = prof.captured[path]
    module = prof.modules[path]
    run = partial(fwd_bwd, module, args, kwargs)
    changes = patch_invact(prof.model, InvActConfig(probe=False), lambda m, p: p == path)
    done = [c for c in changes if not c.skipped and c.path == path]
    events: list[sites.SavedEvent] = []
    try:
        if not done:
            return
        with torch.enable_grad(), measure(prof.model), sites.listening(events.append):
            out = call_module(module, args, kwargs)
        # the same call with the original forward: the class's (the inverted one is the instance's)
        run_orig = partial(fwd_bwd, module, args, kwargs, partial(type(module).forward, module))
        dt = time_delta(run, run_orig, prof.repeats, prof.device)
    finally:
        _undo(changes)
    base_sites = {x for s in kp.storages for x in s.sites}
    new_names = {rel_site(ev.site, rep) for ev in events}
    silenced = [x for x in base_sites if inside(site_module(x), rel) and x not in new_names]
    out_ptr = sites.storage_key(out) if isinstance(out, torch.Tensor) else -1
    out_sid = prof.by_ptr.get(sites.storage_key(out0)) if out0 is not None else None
    savers: dict[str, list[str]] = {}
    extra, seen = 0, set()
    for ev in events:
        ptr = sites.storage_key(ev.tensor)
        sid = out_sid if ptr == out_ptr else prof.by_ptr.get(ptr)
        if sid is not None:  # its output (saved by the next op too), or an input saved again
            savers.setdefault(str(sid), []).append(rel_site(ev.site, rep))
        elif ptr not in seen:
            extra += ev.tensor.untyped_storage().nbytes()  # bit mask, rstd, ...
        seen.add(ptr)
    if silenced:
        added = sorted(int(k) for k in savers)
        r = ReformProfile(rel, done[0].action, sorted(silenced), added, extra, dt, savers)
        kp.reforms.append(r)


def head_times(
    head: nn.Linear, h: torch.Tensor, t: torch.Tensor, repeats: int, device: torch.device
) -> float:
    """Median over interleaved rounds of t(chunked) - t(linear + cross_entropy), fwd+bwd."""
    h = h.detach().reshape(-1, h.shape[-1]).requires_grad_(True)  # (B, S, D) -> (N, D)
    t = t.reshape(-1).long()  # the models' losses take int32 targets too (cast as they do)
    leaves = [h, *(p for p in head.parameters() if p.requires_grad)]

    def plain() -> None:
        with torch.enable_grad():
            loss = F.cross_entropy(F.linear(h, head.weight, head.bias), t)
            torch.autograd.grad(loss, leaves, allow_unused=True)

    def chunked() -> None:
        with torch.enable_grad():
            loss = chunked_linear_cross_entropy(h, head.weight, t, head.bias)
            torch.autograd.grad(loss, leaves, allow_unused=True)

    return time_delta(chunked, plain, repeats, device)


def measure_head_reform(prof: Any, kp: KindProfile) -> None:
    """The root kind's loss head as ``chunked-ce``: one more forward of the model, patched.
    A candidate only where the ``chunked-ce`` strategy would patch it: after the same loss
    check on a dummy batch (``find_chunked_ce``), so that a head whose loss the chunked one
    does not reproduce is never planned."""
    model = prof.model
    path, head, _ = find_head(model)
    if head is None or label_arg(model) is None or path not in prof.captured:
        return
    if sites.block_of(path, prof.blocks) or prof.targets is None:
        return
    if find_chunked_ce(model, ChunkedCEConfig(probe=True), strict=True)[0].skipped:
        return
    h0 = prof.captured[path][0][0]
    h_sid = prof.by_ptr.get(sites.storage_key(h0))
    changes = patch_chunked_ce(model, ChunkedCEConfig(probe=False))
    events: list[sites.SavedEvent] = []
    inputs: list[int] = []
    try:
        if not [c for c in changes if not c.skipped]:
            return
        hook = head.register_forward_pre_hook(lambda m, a: inputs.append(sites.storage_key(a[0])))
        try:
            with torch.enable_grad(), measure(model), sites.listening(events.append):
                model(prof.input_ids, **{prof.label: prof.targets})
        finally:
            hook.remove()
    finally:
        _undo(changes)
    root = [ev for ev in events if not sites.block_of(ev.module, prof.blocks)]
    base_sites = {x for s in kp.storages for x in s.sites if x != "!extern"}
    now = {ev.site for ev in root}
    silenced = sorted(base_sites - now)
    savers: dict[str, list[str]] = {}
    extra, seen = 0, set()
    for ev in root:
        if ev.site in base_sites:
            continue
        ptr = sites.storage_key(ev.tensor)
        sid = h_sid if ptr in inputs else prof.by_ptr.get(ptr)
        if sid is not None:  # the head's input h, the targets: stored already, one more saver
            savers.setdefault(str(sid), []).append(ev.site)
        elif ptr not in seen:
            extra += ev.tensor.untyped_storage().nbytes()  # log-sum-exp per token
        seen.add(ptr)
    if not silenced:
        return
    dt = head_times(head, h0, prof.targets, prof.repeats, prof.device)
    added = sorted(int(k) for k in savers)
    kp.reforms.append(ReformProfile(path, HEAD_KIND, silenced, added, extra, dt, savers))
