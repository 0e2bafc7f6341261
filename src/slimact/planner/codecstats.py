"""What a codec costs on one stored tensor, measured (the profiler's codec half).

``codec_stat`` runs a storage's saved views through a real ``CodecPolicy`` with one codec: exact
payload bytes, median encode and decode times, relative L2 error and SQNR (a stateful codec's
first encode, PRAC's SVD, amortized over its update period). ``lossy_allowed`` says where a lossy
codec may be tried (the ``int4`` strategy's roles); ``_worth_trying`` skips hopeless candidates
cheaply; ``_extreme_weights`` marks modules whose inputs must stay exact.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn as nn

from slimact.classify import role_of
from slimact.codecs.base import Codec, get_codec, storage_nbytes
from slimact.codecs.build import build_codec
from slimact.codecs.saving import CodecPolicy, SharedStored
from slimact.planner.measure import median_time, sync
from slimact.planner.plan import CodecStat

EXTREME_WEIGHT_RATIO = 1e4  # max |w| over median |w| of one parameter: Gaussian init gives ~10
MEDIAN_SAMPLE = 1 << 20


def _extreme_weights(module: nn.Module) -> bool:
    """Does a parameter of ``module`` hold a value ``EXTREME_WEIGHT_RATIO`` times its median
    magnitude? Recomputing such a module from a lossy copy of its input multiplies the copy's
    error by that value (``tests/test_extreme_values.py``: a 1e20 weight), so its inputs
    are only stored exactly. The median is taken over at most ``MEDIAN_SAMPLE`` evenly strided
    values (a 32000 x 4096 embedding's full median took seconds), the maximum over all."""
    with torch.no_grad():
        for p in module.parameters():
            if p.numel() < 16 or not p.is_floating_point():
                continue
            flat = p.detach().flatten()
            lo, hi = torch.aminmax(flat)
            top = max(abs(float(lo)), abs(float(hi)))
            step = max(1, flat.numel() // MEDIAN_SAMPLE)
            med = float(flat[::step].abs().float().median())
            if not math.isfinite(top) or top > EXTREME_WEIGHT_RATIO * max(med, 1e-30):
                return True
    return False


def lossy_allowed(site: str, t: torch.Tensor) -> bool:
    """Lossy codecs only where the ``int4`` strategy would compress (``role_of``): never on fused
    SDPA's q and k (role ``qk``), whose error the backward exponentiates once training sharpens
    attention, which a gradient error measured at the profiled weights does not show."""
    return role_of(site, t, min_numel=1024) not in (None, "qk")


def run_policy(codec: Codec, views: list[tuple[str, torch.Tensor]]) -> list[Any]:
    """Store ``views`` through a fresh ``CodecPolicy`` that gives every view ``codec``."""
    policy = CodecPolicy(lambda site, t: codec)
    return [policy(site, t) for site, t in views]


def _payload_bytes(stored: list[Any]) -> int:
    tensors, seen = [], set()
    for st in stored:
        base = st.base if isinstance(st, SharedStored) else st
        if id(base) not in seen:
            seen.add(id(base))
            tensors.extend(base.tensors())
    return storage_nbytes(tensors)


def partnered_bytes(codec: Codec, views: list, partner: list) -> int:
    """The payload bytes of ``views`` stored after ``partner`` (see :func:`codec_stat`), the
    partner through a codec of its own (a stateful codec serves one site)."""
    own = {id(t) for _, t in views}
    other = type(codec)(codec.config)
    policy = CodecPolicy(lambda site, t: codec if id(t) in own else other)
    try:
        stored = [policy(site, t) for site, t in [*partner, *views]]
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return _payload_bytes(run_policy(codec, views))
    return _payload_bytes(stored[len(partner) :])


@torch.no_grad()
def codec_stat(
    name: str,
    views: list[tuple[str, torch.Tensor]],
    repeats: int,
    device: torch.device,
    partner: list[tuple[str, torch.Tensor]] = (),
) -> CodecStat | None:
    """Measure codec ``name`` on a storage's views; None if it does not apply. ``partner``: the
    save just before them by the same op (a product's other operand), encoded first through the
    same policy so that the bytes include the outlier channels the two share
    (``codecs.saving.CodecPolicy``): charged here, whether or not the plan codes the partner."""
    codec = build_codec(name, views[0][1])
    try:
        t0 = time.perf_counter()
        stored = run_policy(codec, views)
        sync(device)
        first = time.perf_counter() - t0
        decoded = [st.unpack() for st in stored]
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None
    num = den = 0.0
    for (_, t), y in zip(views, decoded):
        num += float((y.double() - t.double()).pow(2).sum())
        den += float(t.double().pow(2).sum())
    nbytes = partnered_bytes(codec, views, partner) if partner else _payload_bytes(stored)
    enc = median_time(lambda: run_policy(codec, views), repeats, device, warmup=False)
    both = lambda: [st.unpack() for st in run_policy(codec, views)]  # noqa: E731
    dec = median_time(both, repeats, device, warmup=False)  # the first run above warmed both
    dec = max(dec - enc, 0.0)
    period = getattr(codec.config, "t1", None)
    if codec.state_dict() and isinstance(period, int) and period > 0:
        enc += max(first - enc, 0.0) / period  # amortized subspace update (PRAC's SVD)
    rel = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    sqnr = math.inf if num == 0 else (10 * math.log10(den / num) if den > 0 else -math.inf)
    return CodecStat(nbytes, enc, dec, rel, sqnr)


def _worth_trying(name: str, views: list, lossy_ok: bool, device: torch.device) -> bool:
    """Cheap pre-checks before timing codec ``name`` on a storage.

    A subspace codec (PRAC family: config fields ``r1``/``r2``) stores its n x r fp32 basis per
    storage, so it cannot beat the raw tensor when n * r * 4 >= raw bytes (prac.txt: PRAC pays
    off when tokens >> n); building that basis for a wide tensor (n = 32000 logits) costs
    minutes, so it is skipped. Where only exact codecs qualify, exactness is first tried on the
    first 64 rows (a lossy codec is lossy there too)."""
    t = views[0][1]
    cfg = get_codec(name).config
    if hasattr(cfg, "r1") and hasattr(cfg, "r2") and t.dim() > 0:
        n = t.shape[-1]
        r = sum(int(v * n) if isinstance(v, float) else int(v) for v in (cfg.r1, cfg.r2))
        if n * r * 4 >= t.untyped_storage().nbytes():
            return False
    if lossy_ok or t.dim() == 0:
        return True
    head = t.detach().reshape(-1, t.shape[-1])[:64] if t.dim() > 1 else t.detach()[:4096]
    st = codec_stat(name, [("trial", head.contiguous())], 1, device)
    return st is not None and st.rel_err == 0.0
