"""The root's part of a compiled plan: what stays eager around the compiled blocks.

``slimact.compiled`` compiles the repeated blocks; the *root* (embedding, final norm, output
projection, loss) stays eager, and so keeps what eager autograd keeps there: a small share of the
model's bytes, but a large share of a tight budget (BENCHMARKS.md §7). Being eager, the root can
take the eager actions through the one plan runtime (``slimact.planner.apply``): a root-only
``Plan`` whose single ``LayerPlan`` (block ``""``) reformulates root modules and encodes the
root's storages with one codec.

A **root option** is a (reformulation, codec) pair:

* reformulation: none, or every root module that takes one: the loss head as ``chunked-ce``
  (output projection + cross-entropy in token chunks: the logits and log-probabilities are never
  stored, only the head's input h, the targets and one log-sum-exp per token) and the final
  norm inverted (``invnorm``: it keeps its output, which the head keeps anyway, instead of its
  input). On llama-20m 8 x 256 (V = 257) they take the root from 14.0 to 4.0 MiB raw: 4 MiB of
  the final norm's input and 4 MiB of logits and log-probabilities go, h stays. Each module is
  checked by the strategies' own finders and probes, the model unchanged (``probe=True``: the chunked loss equals the
  model's; the norm's output is saved by the next op) and left out where it fails (a masked LM,
  a head with logit soft-capping);
* codec: "none" (keep), or one codec on every root storage the ``int4`` strategy's roles allow a
  lossy codec on (``codecstats.lossy_allowed``: norm and linear inputs, the chunked head's h; the
  loss's logits stay exact).

Each option is measured on the real batch:

    bytes      the meter's count of the root's saves with the reformulation installed (on a
               copy), the raw bytes of the storages the codec encodes replaced by their
               measured payloads
    seconds    the codec's encode + decode time of those storages (``codecstats.codec_stat``),
               plus the reformulation's fwd+bwd time difference: ``chunked_linear_cross_entropy``
               against ``linear`` + ``cross_entropy`` on the captured h and targets
               (``reforms.head_times``), each inverted norm against the original on its captured
               input, interleaved rounds
    grad_err   max over the model's parameters of 1 - cos between the model's gradients with
               the option and without it (one fwd + bwd each, the same RNG)

and ``slimact.planner.compiled.solve_compiled`` picks one, jointly with the blocks' options.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from slimact import actions, sites
from slimact.checkpointing import CACHE_KWARGS, is_cache
from slimact.classify import label_arg, parse_site
from slimact.gradcheck import grad_error
from slimact.meter import measure
from slimact.planner.apply import PlanRuntime, install
from slimact.planner.codecstats import codec_stat, lossy_allowed
from slimact.planner.measure import fwd_bwd, time_delta
from slimact.planner.plan import ROOT, LayerPlan, Plan
from slimact.planner.reforms import head_times, reform_candidates
from slimact.reformulate import ChunkedCEConfig, InvActConfig, find_chunked_ce, find_invact
from slimact.reformulate.head import find_head
from slimact.registry import AppliedChange

ROOT_CODECS = ("none", "int8")


@dataclass(frozen=True)
class RootOption:
    """One way to store the root's saves: ``reform`` ((module path, kind) pairs: the modules
    reformulated) and ``codec`` ("none": keep) on ``sites``."""

    codec: str
    bytes: int
    seconds: float = 0.0
    grad_err: float = 0.0
    sites: tuple[str, ...] = ()
    reform: tuple[tuple[str, str], ...] = ()

    @property
    def keeps(self) -> bool:
        """Is this "keep" (nothing reformulated, nothing encoded)?"""
        return self.codec == "none" and not self.reform

    @property
    def label(self) -> str:
        parts = [actions.reformulate(actions.reform_op(kind)) for _, kind in self.reform]
        if self.codec != "none":
            parts.append(actions.codec(self.codec))
        return "+".join(parts) or actions.KEEP

    def to_dict(self) -> dict:
        return {"codec": self.codec, "bytes": self.bytes, "seconds": self.seconds,
                "grad_err": self.grad_err, "sites": list(self.sites),
                "reform": [list(r) for r in self.reform]}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> RootOption:
        """Inverse of :meth:`to_dict`."""
        return cls(
            codec=str(d["codec"]),
            bytes=int(d["bytes"]),
            seconds=float(d.get("seconds", 0.0)),
            grad_err=float(d.get("grad_err", 0.0)),
            sites=tuple(d.get("sites", ())),
            reform=tuple((str(p), str(k)) for p, k in d.get("reform", ())),
        )

    def plan(self) -> Plan:
        """The root-only plan the runtime applies (no plan for "keep")."""
        codecs = ((self.codec, self.sites),) if self.codec != "none" else ()
        layer = LayerPlan(
            block="",
            kind=ROOT,
            reform=tuple(p for p, _ in self.reform),
            codecs=codecs,
            reform_kinds=self.reform,
        )
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


def capture_inputs(
    model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, paths: Sequence[str]
) -> dict[str, tuple[tuple, dict]]:
    """The (args, kwargs) each module in ``paths`` is first called with on this batch
    (detached). A KV cache handed to a module (Hugging Face decoders build one in a forward
    with ``use_cache``) is replaced by None: every later call on the captured inputs would
    append to it, so keys and values would grow call by call and carry the graphs of calls
    whose backward already ran."""
    mods, got, handles = dict(model.named_modules()), {}, []

    def det(k: str | None, v: object) -> object:
        if k in CACHE_KWARGS or is_cache(v):
            return None
        return v.detach() if isinstance(v, torch.Tensor) else v

    def pre(mod, args, kwargs, path):
        a = tuple(det(None, v) for v in args)
        got.setdefault(path, (a, {k: det(k, v) for k, v in kwargs.items()}))

    for p in paths:
        hook = lambda m, a, k, p=p: pre(m, a, k, p)  # noqa: E731
        handles.append(mods[p].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model_loss(model, ids, targets)
    finally:
        for h in handles:
            h.remove()
    return got


def _outside_blocks(model: nn.Module) -> Callable[[str], bool]:
    blocks = sites.block_paths(model)
    return lambda m: not any(m == b or m.startswith(b + ".") for b in blocks)


def root_storages(
    model: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    reform: Sequence[tuple[str, str]] = (),
) -> list[list[tuple[str, torch.Tensor]]]:
    """The root's float storages of one forward that a lossy codec may take, each as its
    (site, tensor) views: every view lossy-allowed, none of them also saved inside a block
    (encoding the root's view would not free a storage a block keeps). ``reform``: the root's
    reformulated modules, whose first save (the chunked head's h, an inverted norm's output:
    the tensor the plain head's ``linear`` saves) is allowed as a linear input is."""
    outside = _outside_blocks(model)
    reformed = {actions.reform_op(kind) for _, kind in reform}

    def lossy(site: str, t: torch.Tensor) -> bool:
        module, op, k = parse_site(site)
        if op in reformed and k == 0:
            site = f"{module}:linear#0"
        return lossy_allowed(site, t)

    got: dict[int, list[tuple[str, torch.Tensor]]] = {}
    refused: set[int] = set()

    def listen(ev: sites.SavedEvent) -> None:
        key = sites.storage_key(ev.tensor)
        if not outside(ev.module) or not lossy(ev.site, ev.tensor):
            refused.add(key)
        else:
            got.setdefault(key, []).append((ev.site, ev.tensor.detach()))

    with sites.tracking(model), sites.listening(listen):
        model_loss(model, ids, targets)
    return [views for key, views in got.items() if key not in refused]


def root_reforms(model: nn.Module, device: torch.device) -> tuple[tuple[str, str], ...]:
    """The root modules that take a reformulation, as (path, kind): the loss head as
    ``chunked-ce``, then the activations and norms outside the blocks inverted, each checked
    by its strategy's finder and probe, the model left unchanged (module docstring)."""
    outside = _outside_blocks(model)
    path, head, _ = find_head(model)
    found = []
    if head is not None and outside(path) and label_arg(model) is not None:
        changes = find_chunked_ce(model, ChunkedCEConfig(probe=True))
        found += [(c.path, c.action) for c in changes if not c.skipped and c.path == path]
    cands = {p for p in reform_candidates(model, device) if p and outside(p)}
    if cands:
        changes = find_invact(model, InvActConfig(probe=True), lambda m, p: p in cands)
        found += [(c.path, c.action) for c in changes if not c.skipped and c.path in cands]
    return tuple(found)


def _reform_seconds(
    model: nn.Module,
    twin: nn.Module,
    reform: Sequence[tuple[str, str]],
    ids: torch.Tensor,
    targets: torch.Tensor,
    repeats: int,
) -> float:
    """fwd+bwd seconds the reformulated modules add (module docstring; may be negative)."""
    paths = [p for p, _ in reform]
    inputs = capture_inputs(model, ids, targets, paths)
    mods, twins, dt = dict(model.named_modules()), dict(twin.named_modules()), 0.0
    for path, kind in reform:
        if path not in inputs:
            continue
        args, kwargs = inputs[path]
        if kind == "chunked-ce":
            dt += head_times(mods[path], args[0], targets, repeats, ids.device)
            continue
        run_new = functools.partial(fwd_bwd, twins[path], args, kwargs)
        run_old = functools.partial(fwd_bwd, mods[path], args, kwargs)
        dt += time_delta(run_new, run_old, repeats, ids.device)
    return dt


def _gradients(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        params = [p for p in model.parameters() if p.requires_grad]
        return list(torch.autograd.grad(model_loss(model, ids, targets), params, allow_unused=True))


def _codec_options(
    twin: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    base: RootOption,
    codecs: Sequence[str],
    repeats: int,
) -> list[RootOption]:
    """``base`` with each lossy codec on the root storages of ``twin`` (``base``'s reform
    installed) that it makes smaller (error not yet measured)."""
    storages = root_storages(twin, ids, targets, base.reform)
    out = []
    for name in codecs:
        saved = seconds = 0
        chosen: list[str] = []
        for views in storages:
            stat = codec_stat(name, views, repeats, ids.device)
            raw = views[0][1].untyped_storage().nbytes()
            if stat is None or stat.bytes >= raw:
                continue
            saved += raw - stat.bytes
            seconds += stat.encode_s + stat.decode_s
            chosen += [s for s, _ in views]
        if chosen:
            bytes_, secs = base.bytes - saved, base.seconds + seconds
            out.append(RootOption(name, bytes_, secs, sites=tuple(chosen), reform=base.reform))
    return out


def profile_root(
    model: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    root_bytes: int,
    codecs: Sequence[str] = ROOT_CODECS,
    repeats: int = 5,
    reform: bool = True,
) -> list[RootOption]:
    """Every root option measured on this batch (module docstring), "keep" first;
    ``root_bytes``: the root's bytes kept raw; ``reform``: also the reformulated options. The
    model is not changed (the measurements and gradient runs use copies)."""
    lossy = [c for c in codecs if c != "none"]
    keep = RootOption("none", root_bytes)
    with torch.random.fork_rng(devices=[]):
        found = root_reforms(model, ids.device) if reform else ()
        if not lossy and not found:
            return [keep]
        ref = _gradients(model, ids, targets)
        options = _codec_options(model, ids, targets, keep, lossy, repeats)
        if found:
            twin = copy.deepcopy(model)
            install(twin, RootOption("none", 0, reform=found).plan())
            change = _meter_bytes(twin, ids, targets) - _meter_bytes(model, ids, targets)
            seconds = _reform_seconds(model, twin, found, ids, targets, repeats)
            reformed = RootOption("none", root_bytes + change, seconds, reform=found)
            options += [reformed, *_codec_options(twin, ids, targets, reformed, lossy, repeats)]
        measured = [keep]
        for option in options:
            twin = copy.deepcopy(model)
            install(twin, option.plan())
            err = grad_error(_gradients(twin, ids, targets), ref)
            measured.append(dataclasses.replace(option, grad_err=err))
    return measured


def _meter_bytes(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> int:
    with measure(model) as m:
        model_loss(model, ids, targets)
    return m.report.total_bytes


def install_root(
    model: nn.Module, option: RootOption, runtime: PlanRuntime | None = None
) -> list[AppliedChange]:
    """Apply ``option`` to the model's root through the plan runtime ("keep": nothing): a new
    one, or ``runtime``, the model's own still without a plan (``install``)."""
    return [] if option.keeps else install(model, option.plan(), runtime=runtime)
