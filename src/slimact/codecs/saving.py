"""Saving through a codec: a ``sites`` policy that stores chosen sites' tensors through codecs.

Ops know nothing about codecs. The site router's pack hook asks a :class:`CodecPolicy`, for every
saved tensor, which codec (if any) its site uses; the policy encodes it and returns a
:class:`CodecStored` that decodes in backward. A tensor saved by several ops (the input Q, K and
V all save, the SDPA output that ``o_proj`` saves again as a reshaped view) is encoded once and
decoded once per backward: the policy caches payloads per forward by exact view and, for tensors
covering their storage densely, by storage, for as long as the tensor's base is alive, so a freed
storage whose address is reused never hits a stale entry. Parameters never reach the policy (the
router skips them). An encode error is re-raised with the site's name.

Why a hook and not module wrappers: the saved tensors are chosen by autograd inside each op
(``linear`` saves its input, SDPA its q/k/v/out/logsumexp), so a hook sees exactly what is stored,
for any model (HF included), without re-implementing any backward; module wrappers would have to
know every op's saving rule.

The plan runtime (``slimact.planner.apply``: a plan's policy, or ``install_policy(model,
policy)`` for a policy of one's own) enters the router and the policy around the root module's
forward, so saves inside checkpointed regions stay under the checkpoint's own hooks.

No device-to-host sync per step: a site's first save is encoded with the codec's checks read on
the host (``Codec.encode``: it may store the tensor exactly, and the policy reports that at
once); once a site's save was clean, its later saves use ``Codec.encode_deferred``, whose
verdicts the policy collects in a ``slimact.ops.deferred.DeferredChecks``, copies to the host in
one non-blocking copy when the forward ends (``end``) and reads at the start of a later forward
(``reset``), once the device has produced them. A verdict reporting a problem is counted in
``late[site][reason]`` with one ``RuntimeWarning`` per site, and the site is checked on the host
again from its next save on.

A codec that draws random numbers (stochastic rounding, ``Codec.draws``) encodes under a seed of
the site's name and the site's count of such encodes (``codecs.base.site_draw_seed``), kept in
the site's state: checkpoints carry it (``site_state_dict``), and a site whose codec changes (a
new plan) keeps counting, so no two of its encodes share draws.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from slimact import actions
from slimact.codecs.base import FLOAT64, Codec, Packed, codec_label, draw_seed, site_draw_seed
from slimact.ops.deferred import DeferredChecks


class CodecStored:
    """A payload in place of a saved tensor (implements ``sites.Stored``).

    ``encoded_view`` records how the encoded tensor was derived from the saved one (a permutation
    to memory order), so decode returns the saved tensor's exact shape and strides. When several
    backward nodes unpack one payload (Q/K/V's shared input), the decoded tensor is kept from the
    first unpack to the last (``refs`` counts the savers), so it is decoded once per backward.
    """

    __slots__ = ("codec", "packed", "perm", "refs", "_served", "_decoded", "__weakref__")

    def __init__(self, codec: Codec, packed: Packed, perm: tuple[int, ...] | None = None) -> None:
        self.codec = codec
        self.packed = packed
        self.perm = perm  # saved = decoded.permute(perm); None: decoded as is
        self.refs = 1
        self._served = 0
        self._decoded: torch.Tensor | None = None

    def _decode(self) -> torch.Tensor:
        """The decoded tensor in the encoded (memory-order) layout, cached across sharers."""
        if self._decoded is not None:
            y = self._decoded
        else:
            with exact(self.packed.device):
                y = shared_back(self.codec.decode(self.packed), self.packed)
        self._served = (self._served + 1) % self.refs
        self._decoded = y if self._served else None
        return y

    def unpack(self) -> torch.Tensor:
        y = self._decode()
        return y.permute(self.perm) if self.perm is not None else y

    def tensors(self) -> list[torch.Tensor]:
        """Payload tensors held on the saved tensor's device (what activation memory counts)."""
        return [t for t in self.packed.tensors.values() if t.device == self.packed.device]

    def nbytes(self) -> int:
        return self.codec.nbytes(self.packed)

    def host_tensors(self) -> list[torch.Tensor]:
        """Payload tensors kept in host memory (offload's pinned buffer), for the meter."""
        host = getattr(self.codec, "host_tensors", None)
        return host(self.packed) if host is not None else []

    @property
    def fallback(self) -> str | None:
        """Why the codec stored this tensor exactly (see ``codecs.base``), or None."""
        return self.packed.meta.get("fallback")

    @property
    def action(self) -> str:
        """``codec:<label>``, with ``:exact`` when the codec stored this tensor exactly."""
        return actions.codec(codec_label(self.codec.config), exact=self.fallback is not None)


def outlier_columns(packed: Packed) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """The channels a payload stores exactly as outliers (``codecs.outlier``): their indices,
    the deferred encode's "is an outlier" flags (None: all are) and the channel count; None if
    it stores none."""
    t = packed.tensors
    if "outlier_idx" not in t:
        return None
    return t["outlier_idx"], t.get("outlier_flag"), packed.meta["channels"]


def share_columns(codec: Codec, packed: Packed, x: torch.Tensor, columns: tuple) -> None:
    """Store the channels ``columns`` (:func:`outlier_columns` of the other operand of a
    product) of ``x``, the tensor ``packed`` codes, exactly beside its payload (see
    :class:`CodecPolicy`). Nothing to do for a lossless codec, a tensor stored exactly, or a
    layout the other operand's channels do not divide."""
    idx, flags, channels = columns
    t = packed.tensors
    if codec.codes_float64 or "fallback" in packed.meta or "shared_idx" in t:
        return
    if tuple(x.shape) != packed.shape or not x.is_contiguous() or x.numel() % channels:
        return
    t["shared_idx"] = idx.clone()  # its own storage: the meter's sites share none
    t["shared_val"] = x.detach().view(-1, channels).index_select(1, idx.long())
    if flags is not None:
        t["shared_flag"] = flags.clone()
    packed.meta["shared_channels"] = channels


def shared_back(y: torch.Tensor, packed: Packed) -> torch.Tensor:
    """A decoded tensor with the channels :func:`share_columns` stored written back (in place:
    the codecs' decodes are fresh tensors)."""
    t = packed.tensors
    if "shared_idx" not in t:
        return y
    y2d = y.view(-1, packed.meta["shared_channels"])
    idx, val = t["shared_idx"].long(), t["shared_val"].to(y.dtype)
    if "shared_flag" in t:  # a deferred outlier encode's: only the flagged ones are outliers
        val = torch.where(t["shared_flag"], val, y2d.index_select(1, idx))
    y2d.index_copy_(1, idx, val)
    return y


class SharedStored:
    """Another view of a storage some earlier site encoded: unpacks by re-striding its decode."""

    __slots__ = ("base", "size", "stride", "offset")

    def __init__(self, base: CodecStored, t: torch.Tensor) -> None:
        self.base = base
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        base.refs += 1

    @property
    def codec(self) -> Codec:
        return self.base.codec

    @property
    def packed(self) -> Packed:
        return self.base.packed

    def unpack(self) -> torch.Tensor:
        flat = self.base._decode().reshape(-1)  # memory order: the encoded tensor is contiguous
        return flat.as_strided(self.size, self.stride, self.offset)

    def tensors(self) -> list[torch.Tensor]:
        return self.base.tensors()

    def nbytes(self) -> int:
        return self.base.nbytes()

    def host_tensors(self) -> list[torch.Tensor]:
        return self.base.host_tensors()

    @property
    def fallback(self) -> str | None:
        return self.base.fallback

    @property
    def action(self) -> str:
        return self.base.action


Assign = Callable[[str, torch.Tensor], "Codec | None"]


def exact(device: torch.device) -> AbstractContextManager:
    """Autocast off while a codec encodes or decodes: the codec chooses its own precision (PRAC's
    bases are fp32; under autocast its matmuls would silently run, and keep state, in bf16)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """Dims of ``t`` sorted outermost-first in memory if ``t`` covers its whole storage densely.

    ``t.permute(order)`` is then contiguous and views every byte of the storage exactly once.
    """
    if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    return order if t.permute(order).is_contiguous() else None


def hidden_channels(t: torch.Tensor) -> int:
    """Channels of the memory-order view: ``H*Dh`` for a 4-D [B, S, H, Dh]-laid tensor."""
    order = dense_order(t)
    if t.dim() == 4 and order == (0, 2, 1, 3):
        return t.shape[1] * t.shape[3]
    if order is not None:
        return t.shape[order[-1]]
    return t.shape[-1]


class CodecPolicy:
    """``assign(site, tensor) -> Codec | None`` decides; this class encodes once per storage.

    Per forward (``reset`` clears it), a payload is found again by the exact view (storage,
    offset, shape, stride, version, dtype) or, for a tensor that covers its whole storage densely,
    by the storage alone: the SDPA output and ``o_proj``'s reshaped input are two views of one
    storage and share one payload. A storage an earlier site kept as is is not encoded again for a
    later view of it (that would only add bytes). Tensors covering their storage are encoded in
    memory order (a permutation, no copy), which is also the layout the codecs' groups and
    channels are defined on. Entries hold weak references only, so nothing outlives the autograd
    graph. Encode errors name the site.

    A codec that stored a tensor exactly because it could not represent it (``codecs.base``) is
    reported here: ``fallbacks[site][reason]`` counts it, one ``RuntimeWarning`` per site names
    the site and the reason, and the meter shows the site's action as ``<codec>:exact``. The other
    tensors the same op saves beside it (the two operands of a product: saves of one op reach the
    policy back to back, ``<module>:<op>#k``, ``#k+1``) are stored exactly too: an extreme operand
    means an extreme gain upstream of it, which multiplies its siblings' reconstruction error in
    the gradient (llama-tiny, one ``gate_proj`` weight at 1e20: ``silu(gate)`` is extreme, and
    quantizing ``up`` beside it alone takes the gradient cosine from 0.996 to 0.990). The sibling
    that was encoded first has its payload replaced while the op still holds it; the meter has
    already counted that site's encoded bytes.

    The operands of a product share their outlier channels: when one stores channels exactly
    (``codecs.outlier``), the other stores the same channels exactly beside its payload
    (:func:`share_columns`, written back on decode by :func:`shared_back`), whichever of the two
    was saved first. In ``y = a * b`` the gradient of ``b`` is ``g * a``: a channel where ``b``
    is massive was written by a large gain, which multiplies ``a``'s error in that channel on
    its way back (llama-tiny with one ``up_proj`` row scaled up: ``up`` carries the massive
    channel, and ``silu(gate)``, which looks normal, held the gradient's error). It costs
    nothing on a product with no outlier channels, and no sync: a deferred encode shares its
    flagged top-capacity channels.
    """

    def __init__(self, assign: Assign, carry: CodecPolicy | None = None) -> None:
        """``carry``: a policy this one replaces (a new plan): its sites' states (the ones whose
        codec instance is unchanged stay deferred), its pending verdicts and its reports."""
        self.assign = assign
        self._cache: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self._raw: dict[tuple, weakref.ref] = {}  # storages an earlier site kept as they are
        self.fallbacks: dict[str, dict[str, int]] = {}  # site -> reason -> count (all forwards)
        self._prev: tuple | None = None  # the last encoded save: (prefix, site, stored, t, order)
        self._exact_next: tuple[str, str] | None = None  # (prefix, site) of a fallback just made
        self.deferred = True  # False: every save is checked on the host (a sync per encode)
        self.checks = DeferredChecks()
        self.late: dict[str, dict[str, int]] = {}  # site -> reason -> count, found after a step
        self._sites: dict[str, tuple[weakref.ref | None, dict]] = {}  # site -> (codec, state)
        if carry is not None:
            self.checks, self._sites = carry.checks, carry._sites
            self.fallbacks, self.late = carry.fallbacks, carry.late

    def _report_fallback(self, site: str, reason: str) -> None:
        fallbacks = self.__dict__.setdefault("fallbacks", {})
        counts = fallbacks.setdefault(site, {})
        if reason == FLOAT64 and any(FLOAT64 in c for c in fallbacks.values() if c):
            counts[reason] = counts.get(reason, 0) + 1  # a float64 model: said once, not per site
            return
        if not counts:
            warnings.warn(
                f"site {site}: stored exactly, not through its codec: {reason}",
                RuntimeWarning,
                stacklevel=2,
            )
        counts[reason] = counts.get(reason, 0) + 1

    def _late(self, site: str, state: dict, explain, values: list[float]) -> None:
        """A deferred verdict of ``site`` read on the host (see the module docstring)."""
        reason = explain(values) if explain is not None else None
        if reason is None:
            return
        state["clean"] = False  # the next save of the site is checked on the host
        counts = self.late.setdefault(site, {})
        if not counts:
            warnings.warn(
                f"site {site}: {reason}; found on the device after its step, which stored it "
                f"through its codec (within the codec's error bound); checked on the host from "
                f"its next save on",
                RuntimeWarning,
                stacklevel=2,
            )
        counts[reason] = counts.get(reason, 0) + 1

    def _encode(self, site: str, codec: Codec, x: torch.Tensor) -> Packed:
        """Checked on the host for a site's first save (and after a problem), else deferred."""
        sites_ = self.__dict__.setdefault("_sites", {})
        entry = sites_.get(site)
        if entry is None or (entry[0] is not None and entry[0]() is not codec):
            draws = {"draws": entry[1]["draws"]} if entry and "draws" in entry[1] else {}
            entry = sites_[site] = (weakref.ref(codec), draws)
        elif entry[0] is None:  # a state loaded from a checkpoint: this codec's from now on
            entry = sites_[site] = (weakref.ref(codec), entry[1])
        state = entry[1]
        if not getattr(codec, "draws", False):
            return self._encode_in(site, codec, x, state)
        count = state.get("draws", 0)
        state["draws"] = count + 1
        with draw_seed(site_draw_seed(site, count)):
            return self._encode_in(site, codec, x, state)

    def _encode_in(self, site: str, codec: Codec, x: torch.Tensor, state: dict) -> Packed:
        if self.__dict__.get("deferred", True) and state.get("clean"):
            d = codec.encode_deferred(x, state)
            if d.verdict is not None:
                checks = self.__dict__.setdefault("checks", DeferredChecks())
                checks.add(d.verdict, functools.partial(self._late, site, state, d.explain))
            return d.packed
        packed = codec.encode(x)
        state["clean"] = "fallback" not in packed.meta
        if state["clean"]:
            codec.calibrate(packed, state)
        return packed

    def reset(self) -> None:
        """Start of a forward: forget the last forward's payloads, read the verdicts the device
        has produced since (never waiting for it)."""
        self._cache.clear()
        self._raw.clear()
        self._prev = self._exact_next = None
        self.__dict__.setdefault("checks", DeferredChecks()).poll()

    def end(self) -> None:
        """End of a forward: start copying its verdicts to the host (one non-blocking copy)."""
        self.__dict__.setdefault("checks", DeferredChecks()).launch()

    def wait(self) -> None:
        """Read every pending verdict now (a sync: for reports, not for training steps)."""
        self.__dict__.setdefault("checks", DeferredChecks()).wait()

    def site_state_dict(self) -> dict[str, dict]:
        """The sites' states (deferred or checked, an outlier site's capacity), after reading
        every pending verdict (a sync: checkpoints are rare), so that a run resumed from them
        encodes as the uninterrupted run does."""
        self.wait()
        return {site: dict(state) for site, (_, state) in self.__dict__.get("_sites", {}).items()}

    def load_site_state_dict(self, states: dict[str, dict]) -> None:
        """Restore :meth:`site_state_dict`; each state goes to the codec of its site's next
        save."""
        sites_ = self.__dict__.setdefault("_sites", {})
        for site, state in states.items():
            sites_[site] = (None, dict(state))

    def __getstate__(self) -> dict:
        """Copies and pickles start with empty per-forward caches (weak references do not copy)
        and the sites' states as a checkpoint carries them (:meth:`site_state_dict`: pending
        verdicts read first; each state goes to the codec of its site's next save, the copy's
        own), so that a copy stores each site as the original does: without them its first
        step would check every site again and train differently."""
        sites_ = {site: (None, state) for site, state in self.site_state_dict().items()}
        return {
            **self.__dict__, "_cache": {}, "_raw": {}, "_prev": None, "_exact_next": None,
            "_sites": sites_,
        }  # fmt: skip

    @staticmethod
    def _share_sibling_columns(prev: tuple | None, prefix: str, stored, x: torch.Tensor) -> None:
        """``prev``, the save just before this one (``stored``, the encoded ``x``), if the same
        op made it: each operand stores the other's outlier channels exactly too."""
        if prev is None or prev[0] != prefix:
            return
        other, t = prev[2](), prev[3]()
        if other is None or t is None or other.fallback is not None or other.perm != stored.perm:
            return
        if (cols := outlier_columns(other.packed)) is not None:
            share_columns(stored.codec, stored.packed, x, cols)
        if (cols := outlier_columns(stored.packed)) is not None:
            share_columns(other.codec, other.packed, t.permute(prev[4]) if prev[4] else t, cols)
            if "shared_val" in other.packed.tensors:  # counted with this save, made by it
                stored.packed.tensors["partner_val"] = other.packed.tensors["shared_val"]

    def _exact_sibling(self, prev: tuple | None, prefix: str, site: str) -> None:
        """``prev``, the save just before ``site``, if the same op made it: store it exactly."""
        if prev is None or prev[0] != prefix:
            return
        stored, t = prev[2](), prev[3]()
        if stored is None or t is None or stored.fallback is not None:
            return
        x = t.permute(prev[4]) if prev[4] is not None else t
        stored.packed = stored.codec.fallback(
            x, f"saved by the same op as {site}, which its codec cannot represent"
        )
        stored._decoded = None
        self._report_fallback(prev[1], stored.fallback)

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (
            str(t.device),
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t._version,
            t.dtype,
        )

    @staticmethod
    def _storage_key(t: torch.Tensor) -> tuple:
        s = t.untyped_storage()
        return ("storage", str(t.device), s.data_ptr(), s.nbytes(), t._version, t.dtype)

    def _lookup(self, key: tuple) -> CodecStored | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        base, stored = hit[0](), hit[1]()
        if base is None or stored is None:
            del self._cache[key]
            return None
        return stored

    def __call__(self, site: str, t: torch.Tensor) -> CodecStored | SharedStored | None:
        prefix = site.rpartition("#")[0]
        prev, exact_next = self.__dict__.get("_prev"), self.__dict__.get("_exact_next")
        self._prev = self._exact_next = None  # only back-to-back saves of one op are siblings
        if t.numel() == 0:  # nothing to code (checkpoint's CPU-side dummy input, say): kept as is
            return None
        key = self._key(t)
        stored = self._lookup(key)
        if stored is not None:
            stored.refs += 1
            return stored
        order = dense_order(t) if t.numel() else None
        skey = self._storage_key(t) if order is not None else None
        if skey is not None:
            shared = self._lookup(skey)
            if shared is not None:
                return SharedStored(shared, t)
        rkey = self._storage_key(t)
        raw = self._raw.get(rkey)
        if raw is not None and raw() is not None:
            return None  # the storage stays alive anyway: encoding this view would only add bytes
        codec = self.assign(site, t)
        base = t._base if t._base is not None else t
        if codec is None:
            self._raw[rkey] = weakref.ref(base)
            return None
        perm = None
        x = t
        if order is not None and order != tuple(range(t.dim())):
            x = t.permute(order)
            perm = tuple(sorted(range(t.dim()), key=order.__getitem__))
        try:
            if exact_next is not None and exact_next[0] == prefix:
                packed = codec.fallback(
                    x, f"saved by the same op as {exact_next[1]}, which its codec cannot represent"
                )
            else:
                with exact(x.device):
                    packed = self._encode(site, codec, x)
            stored = CodecStored(codec, packed, perm)
        except (ValueError, TypeError) as e:
            raise type(e)(f"site {site}: {e}") from e
        if stored.fallback is not None:
            self._report_fallback(site, stored.fallback)
            if exact_next is None and stored.fallback != FLOAT64:  # (float64: each its own)
                # a tensor its codec cannot represent: its op's other saves
                self._exact_sibling(prev, prefix, site)
                self._exact_next = (prefix, site)
        else:
            self._share_sibling_columns(prev, prefix, stored, x)
            self._prev = (
                prefix,
                site,
                weakref.ref(stored),
                weakref.ref(t),
                order if perm else None,
            )
        entry = (weakref.ref(base), weakref.ref(stored))
        self._cache[key] = entry
        if skey is not None:
            self._cache[skey] = entry
        return stored
