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
- **gradients** (``slimact.planner.gradstats``): for every lossy codec of every storage, what it
  does to training: 1 - cos of each block parameter's gradient and of the block input's, with
  that storage alone through the codec, on the batch's real upstream gradient (``meta["grad_err"]``;
  as a recomputed module's input: ``meta["grad_err_recompute"]``; the cost in ``meta["grad_s"]``);
  the MILP caps their sum per block and parameter;
- **per block**: payload bytes of the non-stateful codecs and the outlier-channel count of every
  storage of *every* block (data-dependent: outliers differ between layers, adacc.txt Fig. 4);
- **static memory**: parameters + gradients + optimizer states; AdamW's states are measured by
  stepping a real ``torch.optim.AdamW`` on meta-device twins of the parameters.

``profile_shapes`` runs the same pass on fake tensors (``FakeTensorMode``): the structure and exact
bytes without values or times; ``slimact.planner.scaled`` builds a big model's profile from it and
a measured one-block twin. The pass itself is ``slimact.planner.profiler.Profiler``, the codec
measurements ``slimact.planner.codecstats``.

Outside the blocks (embedding, final norm, head, loss) is profiled the same way as a kind
``(root)`` with one instance whose module paths are absolute. Timings are medians over
``repeats`` after one warm-up. ``cached_profile`` stores the result as JSON, keyed by
``profile_key``: model structure, a weight fingerprint, parameter dtypes, train mode, the
forwards other changes put on its modules (a recomputed block's checkpoint, a reformulated
forward: they change what is saved), batch shape, device, autocast state and dtype, codec list
and options, torch version. A cached profile is checked against the model it serves before it
is used: its baseline bytes against one metered forward of the model on the batch (exact and
deterministic bytes); where they differ (something the key does not see changed the model's
saves) the entry is profiled again and overwritten, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from slimact import sites
from slimact.classify import label_arg
from slimact.codecs.base import codec_names
from slimact.meter import measure
from slimact.patching import ForwardOverride
from slimact.planner.codecstats import (
    _payload_bytes,  # noqa: F401  (planner.evolve reads it here)
    codec_stat,
    lossy_allowed,
    run_policy,
)
from slimact.planner.milp import GRAD_CKPT_KEY, GRAD_KEY
from slimact.planner.plan import KindProfile, Profile
from slimact.planner.profiler import Profiler, kind_signature

__all__ = [
    "autocast_state",
    "cache_path",
    "cached_profile",
    "codec_stat",
    "kind_signature",
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


def model_fingerprint(model: nn.Module) -> str:
    h = hashlib.sha1()
    for n, p in model.named_parameters():
        h.update(f"{n}{tuple(p.shape)}{p.dtype}{float(p.detach().float().sum()):.6e}".encode())
    return h.hexdigest()[:16]


def forward_patches(model: nn.Module) -> list[str]:
    """The instance-level forwards on ``model``'s modules, ``"<path>: <wrapper>[ < <wrapper>]"``
    (innermost last): what other changes (a checkpoint, a reformulation) run in place of the
    class's forward, which the structure and the weights do not show."""
    out = []
    for path, m in model.named_modules():
        f = m.__dict__.get("forward")
        chain = []
        while f is not None:
            if isinstance(f, ForwardOverride):
                chain.append(getattr(f.wrapper, "__qualname__", type(f.wrapper).__name__))
                f = f.prev
            else:
                chain.append(getattr(f, "__qualname__", type(f).__name__))
                f = None
        if chain:
            out.append(f"{path}: {' < '.join(chain)}")
    return out


def saved_bytes(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor | None) -> int:
    """The bytes one forward of ``model`` on the batch saves for backward (the meter's total,
    as a profile's ``baseline_bytes``); the RNG state is left as it was."""
    label = (label_arg(model) or ("targets", 1))[0]
    devices = [input_ids.device] if input_ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        with measure(model, input_ids.numel()) as meter:
            model(input_ids, **{label: input_ids if targets is None else targets})
    return int(meter.report.total_bytes)


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
    slopes: bool = False,
    grads: bool = True,
    optimizer: str = "adamw",
    name: str = "",
) -> Profile:
    """Measure everything the MILP needs on one forward of ``model(input_ids, targets=...)``
    (``labels=`` for a model whose forward takes ``labels``, as Hugging Face's do).

    ``slopes``: also record each codec's payload bytes per doubling of the rows
    (``per_block[rep][sid]["<codec>@slope"]``), which ``slimact.planner.scaled`` extrapolates by.
    ``grads``: also measure what each lossy codec does to the gradient
    (``slimact.planner.gradstats``; ``meta["grad_err"]``, its cost in ``meta["grad_s"]``).
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
        prof = Profiler(model, input_ids.device, codecs, repeats, slopes=slopes, grads=grads)
        report = prof.forward(input_ids, input_ids if targets is None else targets)
        groups = tqdm(
            prof.groups, desc="slimact: profiling block kinds", unit="kind", delay=2.0, leave=False
        )
        kinds = [prof.kind(sig, members, reform, per_block) for sig, members in groups]
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "codecs": codecs,
        "autocast": autocast_state(input_ids.device),
    }
    if grads:
        meta |= {GRAD_KEY: prof.grad_err, GRAD_CKPT_KEY: prof.grad_ckpt, "grad_s": prof.grad_s}
    return _profile(model, input_ids, report, kinds, optimizer, name, t_start, meta)


def _profile(model, input_ids, report, kinds, optimizer, name, t_start, meta) -> Profile:
    """The ``Profile`` of a profiling forward (``report``: its meter report) and its kinds."""
    return Profile(
        model=name or type(model).__name__,
        batch=int(input_ids.shape[0]),
        seq=int(input_ids.shape[-1]),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        device=str(input_ids.device),
        baseline_bytes=int(report.total_bytes),
        static=static_memory(model, optimizer),
        kinds=kinds,
        meta=meta | {"training": bool(model.training), "profile_s": time.perf_counter() - t_start},
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
    prof = Profiler(model, input_ids.device, [], 1, shapes_only=True)
    report = prof.forward(input_ids, input_ids if targets is None else targets)
    kinds = []
    for sig, members in prof.groups:
        kp = KindProfile(sig, list(members), [], [], [])
        prof.by_ptr = {}
        prof._storages(kp, members[0])
        prof._modules(kp, members[0])
        kinds.append(kp)
    return _profile(model, input_ids, report, kinds, optimizer, name, t_start, {})


PROFILE_FORMAT = 5  # bumped when what a profile records changes: old cache entries miss
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

    Model structure and weights, parameter and buffer dtypes, train/eval mode, the modules'
    instance forwards (``forward_patches``), the batch's shapes, dtype and device, the autocast state of that device type (on/off and its dtype),
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
        "patches": forward_patches(model),
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
    profiled again; so is an entry whose baseline bytes are not what one metered forward of the
    model on this batch saves (``saved_bytes``: the entry was measured on a model that saved
    otherwise), with a warning; an unwritable directory is warned about once and the profile
    not cached."""
    key = profile_key(model, input_ids, targets, name=name, **kwargs)
    path = cache_path(cache_dir, key)
    if path.exists() and not refresh:
        try:
            prof = Profile.load(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"slimact: ignoring unreadable profile cache {path}: {e}", stacklevel=2)
        else:
            now = saved_bytes(model, input_ids, targets)
            if now == prof.baseline_bytes:
                prof.meta["cache"] = str(path)
                prof.meta["cache_hit"] = True
                return prof
            warnings.warn(
                f"slimact: the cached profile {path} has a baseline of {prof.baseline_bytes} "
                f"bytes, this model saves {now} bytes on this batch; profiling again",
                RuntimeWarning,
                stacklevel=2,
            )
    prof = profile_model(model, input_ids, targets, name=name, **kwargs)
    try:
        prof.save(path)
        prof.meta["cache"] = str(path)
    except OSError as e:
        _warn_uncached(path.parent, e)
        prof.meta["cache"] = None
    prof.meta["cache_hit"] = False
    return prof
