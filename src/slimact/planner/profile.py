"""Profiler: what each saved tensor costs to keep, recompute, encode or reformulate (adacc.txt §3.3).

One forward of the model on a real batch runs under the meter (``slimact.measure``), which names
every site and groups sites into *storages* (the unit of memory: a storage saved by several
sites, like Q/K/V's shared input, is freed only if every saver drops it). Blocks that repeat
(children of a ``ModuleList``) are grouped into *kinds* by structure; as in adacc.txt §3.3 the
expensive measurements run on one block per kind (the first) and are shared by its peers:

- **recompute**: for every submodule ``M`` of the block (the block itself included) that owns at
  least one storage no module input holds, the median time and FLOPs of re-running ``M.forward``
  with grad enabled on its captured inputs (what non-reentrant checkpointing adds to backward),
  and which storages are ``M``'s inputs (a checkpoint keeps them, so they stay stored);
- **codecs**: for every storage and every registered codec, the exact payload bytes, the median
  encode and decode times and the reconstruction error (relative L2 error and SQNR), measured by
  running the storage's saved views through a real ``CodecPolicy`` (so a storage saved as several
  views is encoded exactly as in training). Lossy codecs are only tried where the ``int4``
  strategy's roles allow one (``role_of``); elsewhere (logsumexp, norm statistics, ids, loss
  inputs) only codecs whose reconstruction is exact qualify. A stateful codec's first encode (an
  SVD for PRAC) is amortized over its update period ``t1``;
- **reformulations** (``slimact.planner.reforms``): each GELU/SiLU/norm that
  ``slimact.reformulate`` can invert is run alone, inverted, under the meter: the sites it no
  longer saves, the storage its output gains a saver for, the bytes of new storages (mask, rstd),
  and the fwd+bwd time difference; the loss head (output projection + cross-entropy) likewise as
  ``chunked-ce``;
- **per block**: payload bytes of the non-stateful codecs and the outlier-channel count of every
  storage of *every* block (data-dependent: outliers differ between layers, adacc.txt Fig. 4);
- **static memory**: parameters + gradients + optimizer states; AdamW's states are measured by
  stepping a real ``torch.optim.AdamW`` on meta-device twins of the parameters.

Outside the blocks (embedding, final norm, head, loss) is profiled the same way as a kind
``(root)`` with one instance whose module paths are absolute. Timings are medians over
``repeats`` after one warm-up. ``cached_profile`` stores the result as JSON, keyed by
``profile_key``: model structure, a weight fingerprint, parameter dtypes, train mode, batch
shape, device, autocast state and dtype, codec list and options, torch version.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from slimact import sites
from slimact.classify import hidden_channels, label_arg
from slimact.codecs.base import codec_names
from slimact.codecs.build import build_codec
from slimact.codecs.outlier import count_outlier_channels
from slimact.meter import measure
from slimact.planner.codecstats import (
    _extreme_weights,
    _payload_bytes,
    _worth_trying,
    codec_stat,
    lossy_allowed,
    run_policy,
)
from slimact.planner.measure import call_module, detach, median_time
from slimact.planner.plan import (
    ROOT,
    KindProfile,
    ModuleProfile,
    Profile,
    StorageProfile,
    abs_site,
    inside,
    rel_site,
    site_module,
)
from slimact.planner.reforms import measure_head_reform, measure_reform, reform_candidates

__all__ = [
    "autocast_state",
    "cache_path",
    "cached_profile",
    "codec_stat",
    "lossy_allowed",
    "profile_key",
    "profile_model",
    "profile_shapes",
    "run_policy",
    "static_memory",
]


def static_memory(model: nn.Module, optimizer: str = "adamw") -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes; AdamW states measured on meta twins."""
    params = list({sites.storage_key(p): p for p in model.parameters()}.values())
    p_bytes = sum(p.untyped_storage().nbytes() for p in params)
    trainable = [p for p in params if p.requires_grad]
    g_bytes = sum(p.numel() * p.element_size() for p in trainable)
    o_bytes = 0
    if optimizer == "adamw" and trainable:
        twins = [nn.Parameter(torch.empty_like(p, device="meta")) for p in trainable]
        for t in twins:
            t.grad = torch.empty_like(t)
        opt = torch.optim.AdamW(twins, foreach=False)
        opt.step()
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    o_bytes += v.numel() * v.element_size()
    elif optimizer != "adamw":
        raise ValueError(f"optimizer must be 'adamw', got {optimizer!r}")
    return {
        "params": p_bytes,
        "grads": g_bytes,
        "optimizer": o_bytes,
        "total": p_bytes + g_bytes + o_bytes,
    }


def kind_signature(module: nn.Module) -> str:
    parts = [
        (n, type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)))
        for n, m in module.named_modules()
    ]
    digest = hashlib.sha1(repr(parts).encode()).hexdigest()[:8]
    return f"{type(module).__name__}-{digest}"


def model_fingerprint(model: nn.Module) -> str:
    h = hashlib.sha1()
    for n, p in model.named_parameters():
        h.update(f"{n}{tuple(p.shape)}{p.dtype}{float(p.detach().float().sum()):.6e}".encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return (
        Path(os.environ.get("SLIMACT_CACHE_DIR", Path.home() / ".cache" / "slimact")) / "profiles"
    )


def profile_model(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    codecs: tuple[str, ...] | list[str] | None = None,
    repeats: int = 3,
    reform: bool = True,
    per_block: bool = True,
    optimizer: str = "adamw",
    name: str = "",
) -> Profile:
    """Measure everything the MILP needs on one forward of ``model(input_ids, targets=...)``
    (``labels=`` for a model whose forward takes ``labels``, as Hugging Face's do).

    Parameters' ``.grad`` and the global RNG state are left untouched.
    """
    codecs = list(codecs) if codecs else codec_names()
    unknown = [c for c in codecs if c not in codec_names()]
    if unknown:
        raise ValueError(f"unknown codec(s) {unknown}; valid codecs: {', '.join(codec_names())}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    t_start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        prof = _Profiler(model, input_ids.device, codecs, repeats)
        report = prof.forward(input_ids, input_ids if targets is None else targets)
        groups = tqdm(
            prof.groups, desc="slimact: profiling block kinds", unit="kind", delay=2.0, leave=False
        )
        kinds = [prof.kind(sig, members, reform, per_block) for sig, members in groups]
    return Profile(
        model=name or type(model).__name__,
        batch=int(input_ids.shape[0]),
        seq=int(input_ids.shape[-1]),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        device=str(input_ids.device),
        baseline_bytes=int(report.total_bytes),
        static=static_memory(model, optimizer),
        kinds=kinds,
        meta={
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "repeats": repeats,
            "codecs": codecs,
            "autocast": autocast_state(input_ids.device),
            "training": bool(model.training),
            "profile_s": time.perf_counter() - t_start,
        },
    )


def profile_shapes(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    optimizer: str = "adamw",
    name: str = "",
) -> Profile:
    """The structure of ``profile_model``'s result from one forward on fake tensors: every kind's
    storages (sites, sharers, exact bytes, shapes, dtypes), its modules' inputs and FLOPs,
    baseline and static bytes; no times, codecs, reformulations nor lossy flags (no values).

    ``model`` and the ids are fake: built under ``torch._subclasses.fake_tensor.FakeTensorMode``,
    and this is called under that mode (fake tensors keep CPU kernels' shapes, SDPA's included,
    which the meta device does not)."""
    t_start = time.perf_counter()
    prof = _Profiler(model, input_ids.device, [], 1, shapes_only=True)
    report = prof.forward(input_ids, input_ids if targets is None else targets)
    kinds = []
    for sig, members in prof.groups:
        kp = KindProfile(sig, list(members), [], [], [])
        prof.by_ptr = {}
        prof._storages(kp, members[0])
        prof._modules(kp, members[0])
        kinds.append(kp)
    return Profile(
        model=name or type(model).__name__,
        batch=int(input_ids.shape[0]),
        seq=int(input_ids.shape[-1]),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        device=str(input_ids.device),
        baseline_bytes=int(report.total_bytes),
        static=static_memory(model, optimizer),
        kinds=kinds,
        meta={"training": bool(model.training), "profile_s": time.perf_counter() - t_start},
    )


class _Profiler:
    """State of one profiling pass: the captured views, module inputs and the meter's report."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        codecs: list[str],
        repeats: int,
        shapes_only: bool = False,
    ):
        self.model, self.device, self.codecs, self.repeats = model, device, codecs, repeats
        self.shapes_only = shapes_only  # fake tensors: structure, bytes and FLOPs, no values
        self.modules = dict(model.named_modules())
        self.blocks = sites.block_paths(model)
        groups: dict[str, list[str]] = {}
        for b in self.blocks:
            groups.setdefault(kind_signature(self.modules[b]), []).append(b)
        self.groups = [*groups.items(), (ROOT, [""])]
        self.reps = [g[1][0] for g in self.groups]
        ts = (*model.parameters(), *model.buffers())
        self.skip = {sites.storage_key(t) for t in ts}
        self.views: dict[str, torch.Tensor] = {}
        self.captured: dict[str, list] = {}  # path -> [args, kwargs, output]

    def region(self, path: str) -> str | None:
        """The rep block a module is profiled in ("" = root), or None (a non-rep block)."""
        b = sites.block_of(path, self.blocks)
        if b:
            return b if b in self.reps else None
        ok = path and not isinstance(self.modules[path], (nn.ModuleList, nn.Sequential))
        return "" if ok else None

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor):
        def pre(mod, args, kwargs, path):
            if path not in self.captured:
                kw = {k: detach(v) for k, v in kwargs.items()}
                self.captured[path] = [tuple(detach(a) for a in args), kw, None]

        def post(mod, args, kwargs, out, path):
            self.captured[path][2] = out.detach() if isinstance(out, torch.Tensor) else None

        handles = []
        for path, m in self.modules.items():
            if self.region(path) is not None:
                handles.append(
                    m.register_forward_pre_hook(partial(pre, path=path), with_kwargs=True)
                )
                handles.append(m.register_forward_hook(partial(post, path=path), with_kwargs=True))
        self.input_ids, self.targets = input_ids, targets
        self.label = (label_arg(self.model) or ("targets", 1))[0]  # HF: labels
        listen = lambda ev: self.views.setdefault(ev.site, detach(ev.tensor))  # noqa: E731
        try:
            with torch.enable_grad(), measure(self.model, input_ids.numel()) as meter:
                with sites.listening(listen):  # fake ids have no values to check
                    call = (
                        partial(nn.Module.__call__, self.model) if self.shapes_only else self.model
                    )
                    call(input_ids, **{self.label: targets})
        finally:
            for h in handles:
                h.remove()
        self.report = meter.report
        self.owner_of = {sh: rec.site for rec in self.report.sites for sh in rec.shared_with}
        return self.report

    def kind(self, sig: str, members: list[str], reform: bool, per_block: bool) -> KindProfile:
        rep = members[0]
        kp = KindProfile(sig, list(members), [], [], [])
        self.by_ptr: dict[int, int] = {}
        self._storages(kp, rep)
        self._modules(kp, rep)
        for s in kp.storages:
            if s.bytes >= 4096:
                vs = self._views(s, rep) or [(s.name, self.views[f"{rep}|{s.name}"])]
                for c in self.codecs:
                    if not _worth_trying(c, vs, s.lossy_ok, self.device):
                        continue
                    st = codec_stat(c, vs, self.repeats, self.device)
                    if st is not None and (s.lossy_ok or st.rel_err == 0.0) and st.bytes < s.bytes:
                        s.codecs[c] = st
        if reform:
            block = self.modules[rep] if rep else self.model
            for rel in reform_candidates(block, self.device):
                if rel or rep:
                    measure_reform(self, kp, rep, rel)
            if not rep:
                measure_head_reform(self, kp)
        for b in members if per_block else [rep]:
            with torch.no_grad():
                kp.per_block[b] = {
                    str(s.id): row for s in kp.storages if (row := self._row(s, b, rep))
                }
        return kp

    def _views(self, s: StorageProfile, block: str) -> list[tuple[str, torch.Tensor]]:
        names = [abs_site(x, block) for x in s.sites if x != "!extern"]
        return [(n, self.views[n]) for n in names if n in self.views]

    def _row(self, s: StorageProfile, b: str, rep: str) -> dict[str, int]:
        vs = self._views(s, b)
        if not s.sites or not vs:
            return {}
        t = vs[0][1]
        row = {"raw": t.untyped_storage().nbytes()}
        if t.is_floating_point() and t.dim() > 0 and t.numel():
            row["outliers"] = count_outlier_channels(t, channels=hidden_channels(t))
        for c, st in s.codecs.items():
            codec = build_codec(c, t)
            stateful = bool(codec.state_dict())
            row[c] = st.bytes if b == rep or stateful else _payload_bytes(run_policy(codec, vs))
        return row

    def _storages(self, kp: KindProfile, rep: str) -> None:
        for rec in self.report.sites:
            if rec.site in self.owner_of or rec.block != rep or rec.bytes == 0:
                continue
            if rec.site not in self.views:
                continue
            same = [rec.site]
            same += [
                x for x in rec.shared_with if sites.block_of(site_module(x), self.blocks) == rep
            ]
            foreign = len(same) != 1 + len(rec.shared_with)  # a saver in another block
            t = self.views[rec.site]
            names = [rel_site(x, rep) for x in same] + (["!extern"] if foreign else [])
            lossy = not self.shapes_only and lossy_allowed(rec.site, t) and not foreign
            sid = len(kp.storages)
            kp.storages.append(
                StorageProfile(sid, names[0], names, rec.bytes, list(rec.shape), rec.dtype, lossy)
            )
            self.by_ptr[sites.storage_key(t)] = sid

    def _modules(self, kp: KindProfile, rep: str) -> None:
        for path, (args, kwargs, _) in list(self.captured.items()):
            if self.region(path) != rep:
                continue
            rel = rel_site(path, rep)
            ins = []
            flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            for a in [a for a in flat if sites.storage_key(a) not in self.skip]:
                ptr = sites.storage_key(a)
                if ptr not in self.by_ptr:  # an input nobody saves: stored only if checkpointed
                    sid = self.by_ptr[ptr] = len(kp.storages)
                    nm = f"{rel}:input#{len(ins)}"
                    dt = str(a.dtype).replace("torch.", "")
                    nb = a.untyped_storage().nbytes()
                    lossy = not self.shapes_only and lossy_allowed(f"{rel}:linear#0", a)
                    kp.storages.append(StorageProfile(sid, nm, [], nb, list(a.shape), dt, lossy))
                    self.views[f"{rep}|{nm}"] = a
                ins.append(self.by_ptr[ptr])
            if ins and not self.shapes_only and _extreme_weights(self.modules[path]):
                for sid in ins:  # a recomputation from a lossy copy: the weights amplify its error
                    kp.storages[sid].lossy_ok = False
            internal = [
                s for s in kp.storages
                if s.sites and s.id not in ins and "!extern" not in s.sites
                and all(inside(site_module(x), rel) for x in s.sites)
            ]  # fmt: skip
            if not internal or (not rep and not rel):
                continue
            module = self.modules[path]
            run = partial(call_module, module, args, kwargs)
            t = 0.0 if self.shapes_only else median_time(run, self.repeats, self.device)
            with FlopCounterMode(display=False) as fc:
                call_module(module, args, kwargs)
            flops = int(fc.get_total_flops())
            kp.modules.append(ModuleProfile(rel, type(module).__name__, ins, t, flops))


PROFILE_FORMAT = 4  # bumped when what a profile records changes: old cache entries miss
_unwritable: set[str] = set()  # cache directories already warned about (one warning each)


def autocast_state(device: torch.device | str) -> str | None:
    """``"bfloat16"`` if autocast is on for ``device``'s type (the dtype it casts to), else None."""
    dev = torch.device(device).type
    if not torch.is_autocast_enabled(dev):
        return None
    return str(torch.get_autocast_dtype(dev)).replace("torch.", "")


def profile_key(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    name: str = "",
    **kwargs: Any,
) -> dict[str, Any]:
    """Everything that changes what a profile measures, as a JSON-able dict (the cache key).

    Model structure and weights, parameter and buffer dtypes, train/eval mode, the batch's
    shapes, dtype and device, the autocast state of that device type (on/off and its dtype),
    the candidate codecs and other ``profile_model`` options, torch's version and the profile
    format."""
    codecs = tuple(kwargs.pop("codecs", None) or codec_names())
    tensors = [*model.parameters(), *model.buffers()]
    return {
        "format": PROFILE_FORMAT,
        "name": name or type(model).__name__,
        "structure": kind_signature(model),
        "weights": model_fingerprint(model),
        "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in tensors}),
        "training": bool(model.training),
        "input": [list(input_ids.shape), str(input_ids.dtype)],
        "targets": None if targets is None else [list(targets.shape), str(targets.dtype)],
        "device": str(input_ids.device),
        "autocast": autocast_state(input_ids.device),
        "codecs": list(codecs),
        "options": sorted((k, str(v)) for k, v in kwargs.items()),
        "torch": torch.__version__,
    }


def cache_path(cache_dir: str | Path | None, key: dict[str, Any]) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir or default_cache_dir()) / f"{key['name'] or 'model'}-{digest}.json"


def _warn_uncached(directory: Path, error: BaseException) -> None:
    if str(directory) in _unwritable:
        return
    _unwritable.add(str(directory))
    warnings.warn(
        f"slimact: the profile cache {directory} is not writable ({error}); profiling without "
        f"a cache (pass cache=None / --cache none to silence this, or another directory)",
        RuntimeWarning,
        stacklevel=3,
    )


def cached_profile(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    cache_dir: str | Path | None = None,
    name: str = "",
    refresh: bool = False,
    **kwargs: Any,
) -> Profile:
    """``profile_model`` with a JSON cache (``cache_dir=None``: ``default_cache_dir()``) keyed by
    ``profile_key``. ``refresh``: profile again and overwrite the entry. An unreadable entry is
    profiled again; an unwritable directory is warned about once and the profile not cached."""
    key = profile_key(model, input_ids, targets, name=name, **kwargs)
    path = cache_path(cache_dir, key)
    if path.exists() and not refresh:
        try:
            prof = Profile.load(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"slimact: ignoring unreadable profile cache {path}: {e}", stacklevel=2)
        else:
            prof.meta["cache"] = str(path)
            prof.meta["cache_hit"] = True
            return prof
    prof = profile_model(model, input_ids, targets, name=name, **kwargs)
    try:
        prof.save(path)
        prof.meta["cache"] = str(path)
    except OSError as e:
        _warn_uncached(path.parent, e)
        prof.meta["cache"] = None
    prof.meta["cache_hit"] = False
    return prof
