"""Planning a model too big to build: shapes from fake tensors, times from a one-block twin.

``profile_model`` runs the real model, so planning llama-7b would first build 27 GB of fp32
weights. ``profile_scaled(name, batch, seq)`` never builds the full model:

1. **structure and bytes, exact** (``profile.profile_shapes``): the full model is built under
   ``FakeTensorMode`` and one forward at the planned (batch, seq) runs under the meter. Every
   site, its storage sharing (fake tensors keep storage identity), shape, dtype and bytes, every
   module's inputs, the baseline and static bytes are what the real forward would give (tested
   equal on llama-20m), with no memory and no arithmetic;
2. **measurements, scaled**: a *twin* with the same blocks but one of them (``n_layers=1``: one
   block of the only block kind, plus embedding, final norm and head, with real random
   weights) is profiled by ``profile_model`` at a token count that fits (``max_tokens``: batch
   first, then sequence length, reduced). Its one block stands for all of its kind;
3. **merge**: the twin's kinds (storages, modules, codecs, reformulations) keep their ids and take
   the full model's block lists, bytes, shapes and FLOPs, matched by name. Twin measurements are
   scaled to the full size by ``SCALING``: a storage's codec payload bytes are affine in its rows
   (per-channel scales, outlier channel lists, PRAC's basis: the intercept), measured at the
   twin's rows and at twice them (the rows stacked twice: same channel statistics), and
   extrapolated to the model's rows (raw bytes' ratio if the stacking failed); encode/decode
   times by the raw bytes' ratio, a module's recompute time by its exact
   FLOPs ratio (counted on both: attention's quadratic term included), a reformulation's time and
   new bytes (bit mask, rstd, log-sum-exp per token) by the token ratio.

Blocks of one kind are identical in the result (one storage table, no per-block rows): the
data-dependent outlier counts and per-block codec bytes are the twin block's. Needs a registered
model whose config has ``n_layers`` and whose blocks are of one kind.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from slimact import sites
from slimact.models.registry import build_model, get_spec
from slimact.planner.plan import ROOT, CodecStat, KindProfile, Profile
from slimact.planner.profile import PROFILE_FORMAT, cache_path, profile_model, profile_shapes

__all__ = [
    "SCALED_FROM_BYTES",
    "SCALING",
    "ScaledConfig",
    "cached_profile_scaled",
    "param_bytes",
    "profile_scaled",
    "twin_shape",
]

SCALED_FROM_BYTES = 2 << 30  # ``slimact plan --profile auto``: parameters above 2 GiB are scaled
# the twin's gradient figures (planner.gradstats) hold several copies of a block's parameter
# gradients: above this a block's are not measured (a 7B model's blocks are above it)
GRAD_MAX_BLOCK_BYTES = 256 << 20

SCALING = (
    "twin of 1 block at {tb}x{ts} tokens, scaled to {b}x{s}: site bytes, shapes, sharing and "
    "FLOPs exact from fake tensors; codec payload bytes affine in rows (measured at 1x and 2x "
    "the twin's rows); codec times x raw-bytes ratio; recompute times x FLOPs ratio; "
    "reformulation times and new bytes x tokens ratio"
)


@dataclass(frozen=True)
class ScaledConfig:
    """``max_tokens``: the twin's batch x seq cap (batch reduced first, then seq); ``repeats``:
    timed runs per measurement (median), one by default: the scaled times are estimates."""

    max_tokens: int = 64
    codecs: tuple[str, ...] | None = None
    repeats: int = 1
    reform: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(
                f"ScaledConfig.max_tokens must be an int >= 1, got {self.max_tokens!r}"
            )
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"ScaledConfig.repeats must be an int >= 1, got {self.repeats!r}")
        if self.codecs is not None:
            object.__setattr__(self, "codecs", tuple(self.codecs))


def twin_shape(batch: int, seq: int, max_tokens: int) -> tuple[int, int]:
    """(batch, seq) of the twin: ``batch`` cut first, then ``seq``, to at most ``max_tokens``.

    A batch above 1 stays at least 2: the targets ``ids[:, 1:]`` of one row are contiguous
    (a loss's ``reshape`` is a view of the ids, sharing their storage), of several rows not (a
    copy), so the twin saves what the model saves."""
    low = min(batch, 2)
    b = max(low, min(batch, max_tokens // seq))
    return b, min(seq, max(1, max_tokens // b))


def param_bytes(name: str, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of model ``name``'s parameters in ``dtype``, counted on the meta device."""
    model = build_model(name, device="meta")
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params) * torch.empty((), dtype=dtype).element_size()


def _ids(vocab: int, batch: int, seq: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)


def profile_scaled(
    name: str,
    batch: int,
    seq: int,
    config: ScaledConfig = ScaledConfig(),
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Profile:
    """Profile registered model ``name`` at (``batch``, ``seq``) without building it (see the
    module docstring). The result's ``meta["scaled"]`` states the twin's size and the rule."""
    spec = get_spec(name)
    if not hasattr(spec.config, "n_layers"):
        raise ValueError(f"model {name!r}: scaled profiling needs a config with n_layers")
    t0 = time.perf_counter()
    vocab = spec.config.vocab_size
    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # .to(dtype) cannot swap fake parameters
        try:
            fake = build_model(name, device=device).train()
        finally:
            torch.set_default_dtype(default)
        ids = _ids(vocab, batch, seq, config.seed, device)
        full = profile_shapes(fake, ids[:, :-1], ids[:, 1:], name=name)
    del fake
    blocks = [k for k in full.kinds if k.kind != ROOT]
    if len(blocks) != 1:
        raise ValueError(
            f"model {name!r}: scaled profiling needs blocks of one kind, got {len(blocks)} kinds"
        )
    tb, ts = twin_shape(batch, seq, config.max_tokens)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        twin = build_model(name, n_layers=1, device=device).to(dtype).train()
    tids = _ids(vocab, tb, ts, config.seed, device)
    block_bytes = max(
        (sum(p.numel() * p.element_size() for p in b.parameters()) for b in _blocks(twin)),
        default=0,
    )
    grads = block_bytes <= GRAD_MAX_BLOCK_BYTES
    small = profile_model(
        twin, tids[:, :-1], tids[:, 1:], codecs=config.codecs, repeats=config.repeats,
        reform=config.reform, name=name, slopes=True, grads=grads,
    )  # fmt: skip
    del twin
    tokens = (batch * seq) / (tb * ts)
    kinds = [_merge(f, _twin_kind(small, f.kind), tokens) for f in full.kinds]
    rule = SCALING.format(tb=tb, ts=ts, b=batch, s=seq)
    meta = dict(small.meta)
    meta.update(
        profile_s=time.perf_counter() - t0,
        scaled={"twin_batch": tb, "twin_seq": ts, "twin_layers": 1, "rule": rule},
    )
    if not grads:
        meta["grad_err_skipped"] = (
            f"a block holds {block_bytes / 2**20:.0f} MiB of parameters (> "
            f"{GRAD_MAX_BLOCK_BYTES / 2**20:.0f} MiB): its gradient copies would exceed a small "
            "machine's memory, so no gradient figures were measured and max_grad_err caps nothing"
        )
    return replace(full, kinds=kinds, meta=meta)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = dict(model.named_modules())
    return [mods[p] for p in sites.block_paths(model)]


def cached_profile_scaled(
    name: str,
    batch: int,
    seq: int,
    config: ScaledConfig = ScaledConfig(),
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    cache_dir: str | Path | None = None,
) -> Profile:
    """``profile_scaled`` with the JSON cache of ``cached_profile`` (``cache_dir=None``: the
    default directory), keyed by the model's name and config, the shape, dtype, device, the
    config and torch's version (the twin's weights are drawn from ``config.seed``)."""
    key = {
        "format": PROFILE_FORMAT, "scaled": True, "name": name,
        "config": repr(get_spec(name).config), "batch": batch, "seq": seq, "dtype": str(dtype),
        "device": str(device), "options": repr(config), "torch": torch.__version__,
    }  # fmt: skip
    path = cache_path(cache_dir, key)
    if path.exists():
        try:
            prof = Profile.load(path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: profiled again and overwritten
        else:
            prof.meta.update(cache=str(path), cache_hit=True)
            return prof
    prof = profile_scaled(name, batch, seq, config, dtype=dtype, device=device)
    try:
        prof.save(path)
        prof.meta.update(cache=str(path), cache_hit=False)
    except OSError:
        prof.meta.update(cache=None, cache_hit=False)
    return prof


def _twin_kind(small: Profile, kind: str) -> KindProfile:
    for k in small.kinds:
        if k.kind == kind:
            return k
    got = [k.kind for k in small.kinds]
    raise ValueError(f"the one-block twin has no kind {kind!r} (it has {got})")


def _merge(full: KindProfile, twin: KindProfile, tokens: float) -> KindProfile:
    """``twin``'s measurements at ``full``'s size (the ids are the twin's; names must match)."""
    by_name = {s.name: s for s in full.storages}
    names = sorted(s.name for s in twin.storages)
    if names != sorted(by_name):
        diff = sorted(set(names) ^ set(by_name))
        raise ValueError(f"kind {full.kind}: the twin's storages differ from the model's: {diff}")
    storages = []
    rep = twin.per_block.get(twin.blocks[0], {})
    for s in twin.storages:
        f = by_name[s.name]
        r = f.bytes / s.bytes if s.bytes else tokens
        codecs = {}
        for c, st in s.codecs.items():
            slope = rep.get(str(s.id), {}).get(f"{c}@slope")  # payload per copy of the rows
            nbytes = st.bytes * r if slope is None else st.bytes + slope * (r - 1)
            codecs[c] = CodecStat(round(nbytes), st.encode_s * r, st.decode_s * r, st.rel_err,
                                  st.sqnr_db)  # fmt: skip
        storages.append(dataclasses.replace(s, bytes=f.bytes, shape=list(f.shape), codecs=codecs))
    flops = {m.path: m.flops for m in full.modules}
    modules = []
    for m in twin.modules:
        n = flops.get(m.path)
        if n is None:
            raise ValueError(f"kind {full.kind}: module {m.path!r} of the twin is not the model's")
        r = n / m.flops if m.flops else tokens
        modules.append(dataclasses.replace(m, recompute_s=m.recompute_s * r, flops=n))
    reforms = [
        dataclasses.replace(
            r, extra_bytes=round(r.extra_bytes * tokens), delta_s=r.delta_s * tokens
        )
        for r in twin.reforms
    ]
    return KindProfile(full.kind, list(full.blocks), storages, modules, reforms, {})
