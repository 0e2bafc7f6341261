"""The root's part of a compiled plan: what stays eager around the compiled blocks.

``slimact.compiled`` compiles the repeated blocks; the *root* (embedding, final norm, output
projection, loss) stays eager, and so keeps what eager autograd keeps there: on llama-20m, 8 x 256
tokens, 14.0 MiB, 2.7% of the model's bytes, but 38% of a 7.5% budget. Being eager, the root can
take the eager actions through the one plan runtime (``slimact.planner.apply``): a root-only
``Plan`` whose single ``LayerPlan`` (block ``""``) encodes the root's storages with one codec.

A **root option** is "keep" or one codec on every root storage the ``int4`` strategy's roles
allow a lossy codec on (``codecstats.lossy_allowed``: norm and linear inputs; the loss's logits
stay exact). Each is measured on the real batch:

    bytes      the root's bytes with the option (the raw bytes of the storages it encodes
               replaced by their measured payloads)
    seconds    the encode + decode time of those storages (``codecstats.codec_stat``)
    grad_err   max over the model's parameters of 1 - cos between the model's gradients with
               the option and without it (one fwd + bwd each, the same RNG)

and ``slimact.planner.compiled.solve_compiled`` picks one, jointly with the blocks' options.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from slimact import actions, sites
from slimact.classify import label_arg
from slimact.planner.apply import install
from slimact.planner.codecstats import codec_stat, lossy_allowed
from slimact.planner.plan import ROOT, LayerPlan, Plan
from slimact.registry import AppliedChange

ROOT_CODECS = ("none", "int8")


@dataclass(frozen=True)
class RootOption:
    """One way to store the root's saves: ``codec`` ("none": keep) on ``sites``."""

    codec: str
    bytes: int
    seconds: float = 0.0
    grad_err: float = 0.0
    sites: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return actions.KEEP if self.codec == "none" else actions.codec(self.codec)

    def to_dict(self) -> dict:
        return {"codec": self.codec, "bytes": self.bytes, "seconds": self.seconds,
                "grad_err": self.grad_err, "sites": list(self.sites)}  # fmt: skip

    def plan(self) -> Plan:
        """The root-only plan the runtime applies (no plan for "keep")."""
        layer = LayerPlan(block="", kind=ROOT, codecs=((self.codec, self.sites),))
        return Plan(budget="compiled-auto root", layers=(layer,))


def model_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of ``model`` on (ids, targets): slimact's ``targets=`` or HF's ``labels=``."""
    name = (label_arg(model) or ("targets", 1))[0]
    out = model(ids, **{name: targets})
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError("the model's forward returned no loss for (input_ids, labels)")
    return loss


def root_storages(
    model: nn.Module, ids: torch.Tensor, targets: torch.Tensor
) -> list[list[tuple[str, torch.Tensor]]]:
    """The root's float storages of one forward that a lossy codec may take, each as its
    (site, tensor) views: every view lossy-allowed, none of them also saved inside a block
    (encoding the root's view would not free a storage a block keeps)."""
    blocks = sites.block_paths(model)
    inside = lambda m: any(m == b or m.startswith(b + ".") for b in blocks)  # noqa: E731
    got: dict[int, list[tuple[str, torch.Tensor]]] = {}
    refused: set[int] = set()

    def listen(ev: sites.SavedEvent) -> None:
        key = sites.storage_key(ev.tensor)
        if inside(ev.module) or not lossy_allowed(ev.site, ev.tensor):
            refused.add(key)
        else:
            got.setdefault(key, []).append((ev.site, ev.tensor.detach()))

    with sites.tracking(model), sites.listening(listen):
        model_loss(model, ids, targets)
    return [views for key, views in got.items() if key not in refused]


def _gradients(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        params = [p for p in model.parameters() if p.requires_grad]
        return list(torch.autograd.grad(model_loss(model, ids, targets), params, allow_unused=True))


def _grad_err(got: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]) -> float:
    errs = [
        1.0 - float(torch.nn.functional.cosine_similarity(
            g.double().flatten(), r.double().flatten(), dim=0))
        for g, r in zip(got, ref)
        if g is not None and r is not None and float(r.norm()) > 0
    ]  # fmt: skip
    return max(errs, default=0.0)


def profile_root(
    model: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    root_bytes: int,
    codecs: Sequence[str] = ROOT_CODECS,
    repeats: int = 5,
) -> list[RootOption]:
    """Every root option measured on this batch (module docstring); ``root_bytes``: the root's
    bytes kept raw. The model is not changed (the gradient runs use a copy)."""
    options = [RootOption("none", root_bytes)]
    lossy = [c for c in codecs if c != "none"]
    if not lossy:
        return options
    with torch.random.fork_rng(devices=[]):
        storages = root_storages(model, ids, targets)
        ref = _gradients(model, ids, targets)
    device = ids.device
    for name in lossy:
        saved = seconds = 0
        chosen: list[str] = []
        for views in storages:
            stat = codec_stat(name, views, repeats, device)
            raw = views[0][1].untyped_storage().nbytes()
            if stat is None or stat.bytes >= raw:
                continue
            saved += raw - stat.bytes
            seconds += stat.encode_s + stat.decode_s
            chosen += [s for s, _ in views]
        if not chosen:
            continue
        twin = copy.deepcopy(model)
        option = RootOption(name, root_bytes - saved, seconds, 0.0, tuple(chosen))
        install(twin, option.plan())
        err = _grad_err(_gradients(twin, ids, targets), ref)
        options.append(RootOption(name, option.bytes, seconds, err, option.sites))
    return options


def install_root(model: nn.Module, option: RootOption) -> list[AppliedChange]:
    """Apply ``option`` to the model's root through the plan runtime ("keep": nothing)."""
    return [] if option.codec == "none" else install(model, option.plan())
