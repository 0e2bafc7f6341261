"""PRAC's per-site decisions and state, shared by the strategy and the plan runtime.

A PRAC *rule* (``slimact.planner.plan.SiteRule`` with ``roles="prac"``; read here by its
attributes) maps PRAC's roles (``linear``, ``norm``, ``act``, ``gate``, ``output``: see
``strategies/prac.py``) to codec labels carrying the ranks (``prac/r1=0.3,r2=0.3``), with keep
patterns, rank overrides, the gate modules, ``min_features``, ``only_if_smaller`` and the
modules whose sites it may compress (``modules``, None: all).
:class:`PracState` decides each site at its first save (role, keep patterns, filter, ranks,
worth-it check), builds one ``PracCodec`` per compressed storage (named by its first saver, which
seeds its generator), and holds the step clock that every codec reads: the count of training
forwards (grad enabled) of the root module. :class:`PracPolicy` is a ``CodecPolicy`` over it that
treats storages as the unit (a storage one site keeps uncompressed is not compressed for a later
saver) and advances the clock at each forward. ``state_dict``/``load_state_dict`` checkpoint the
codecs and the clock.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from slimact.classify import is_nonlinearity, is_norm, parse_site
from slimact.codecs.base import codec_config
from slimact.codecs.prac import PracCodec, PracCodecConfig, resolve_rank
from slimact.codecs.saving import CodecPolicy, dense_order
from slimact.planner.rules import PRAC_ROLES

logger = logging.getLogger("slimact")

ATTENTION_OPS = ("scaled_dot_product_attention", "flash_attn", "attention")
ROLES = PRAC_ROLES


def storage_of(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def prac_codec_config(label: str, r1: int | float, r2: int | float) -> PracCodecConfig:
    """The codec config ``label`` names (a PRAC-family label), with ranks ``r1``, ``r2``."""
    cfg = codec_config(label)
    if not isinstance(cfg, PracCodecConfig):
        raise ValueError(f"a PRAC rule's codec labels name prac, pac or rac, got {label!r}")
    return dataclasses.replace(cfg, r1=r1, r2=r2)


class PracState:
    """All of one model's PRAC codecs, the step clock and the per-site decisions.

    ``rule``: a PRAC rule (module docstring); ``allowed``: the modules whose sites may be
    compressed (the rule's ``modules``, a ``filter_fn``'s choice; the others are reported),
    None: all. ``name``: the strategy (``prac``, ``pac``, ``rac``: the codec its labels name)."""

    def __init__(self, model: nn.Module, rule: Any) -> None:
        self.rule = rule
        self.labels = dict(rule.codecs)
        if not self.labels:
            raise ValueError("a PRAC rule names at least one role's codec")
        self.name = next(iter(self.labels.values())).partition("/")[0]
        self.modules = dict(model.named_modules())
        self.allowed = None if rule.modules is None else frozenset(rule.modules)
        self.forwards = 0
        self.codecs: dict[str, PracCodec] = {}
        self.plan: dict[str, str | None] = {}  # site -> codec key, or None (kept)
        self.skipped: dict[str, str] = {}
        self.sharers: dict[str, list[str]] = {}
        self.raw: dict[tuple[str, int], str] = {}  # this forward: storage -> site keeping it
        self._assigned = False

    def clock(self) -> int:
        return max(self.forwards - 1, 0)

    def begin_forward(self) -> None:
        self.raw.clear()
        if torch.is_grad_enabled():
            self.forwards += 1

    def role(self, site: str) -> str | None:
        path, op, _ = parse_site(site)
        m = self.modules.get(path)
        if m is None or any(a in op for a in ATTENTION_OPS):
            return None
        if isinstance(m, nn.Linear):
            return "linear" if op == "linear" else None
        if op.startswith("inv_") and not op.endswith("_fallback"):
            return "output"  # an output-saving op (invact): its y is the next layer's input
        if is_norm(m):
            return "norm"
        if is_nonlinearity(m):
            return "act"
        if op == "mul" and any(fnmatch.fnmatchcase(path, p) for p in self.rule.gate_modules):
            return "gate"
        return None

    def ranks_for(self, label: str, site: str, path: str) -> tuple[int | float, int | float]:
        for pattern, r1, r2 in self.rule.overrides:
            if fnmatch.fnmatchcase(site, pattern) or fnmatch.fnmatchcase(path, pattern):
                return r1, r2
        cfg = codec_config(label)
        return cfg.r1, cfg.r2

    def skip(self, site: str, reason: str) -> None:
        if site not in self.skipped:
            self.skipped[site] = reason
            logger.info("prac: %s keeps its tensor: %s", site, reason)

    def assign(self, site: str, t: torch.Tensor) -> PracCodec | None:
        """The codec policy's ``assign``: a storage kept uncompressed earlier in this forward
        is not compressed for a later saver."""
        self._assigned = True
        owner = self.raw.get(storage_of(t))
        if owner is not None and self.plan.get(site) is not None:
            return None  # compressed in earlier forwards; this time another site keeps it raw
        return self.codec_for(site, t, owner)

    def codec_for(
        self, site: str, t: torch.Tensor, raw_owner: str | None = None
    ) -> PracCodec | None:
        """The codec of ``site`` (built on its first save), or None to keep the tensor.

        ``raw_owner``: a site that already keeps this tensor's storage uncompressed.
        """
        if not t.is_floating_point() or t.dim() < 2:
            return None
        if site in self.plan:
            key = self.plan[site]
            return None if key is None else self.codecs[key]
        self.plan[site] = None
        role = self.role(site)
        label = self.labels.get(role) if role is not None else None
        if label is None:
            return None
        path, _, _ = parse_site(site)
        rule = self.rule
        if any(fnmatch.fnmatchcase(site, p) or fnmatch.fnmatchcase(path, p) for p in rule.keep):
            self.skip(site, "matches a keep pattern")
            return None
        if self.allowed is not None and path not in self.allowed:
            self.skip(site, "filtered out by filter_fn")
            return None
        n = t.shape[-1]
        order = dense_order(t) if t.numel() else None
        if order is not None and order[-1] != t.dim() - 1 and t.shape[-1] > 1:
            # the policy encodes in memory order, whose innermost dim is not the features
            self.skip(site, f"feature dim of shape {tuple(t.shape)} is not innermost in memory")
            return None
        r1, r2 = self.ranks_for(label, site, path)
        a1, a2 = resolve_rank(r1, n), resolve_rank(r2, n)
        if n < rule.min_features or a1 + a2 == 0:
            self.skip(
                site,
                f"feature size {n} too small (min_features={rule.min_features}, "
                f"ranks ({r1}, {r2}) -> ({a1}, {a2}))",
            )
            return None
        if raw_owner is not None:
            self.skip(site, f"its storage is kept uncompressed by {raw_owner}")
            return None
        codec = PracCodec(prac_codec_config(label, a1, a2), clock=self.clock, name=site, role=role)
        codec._setup(n)  # ranks vs n are checked here: a bad override raises now, naming the site
        tokens, itemsize = t.numel() // n, t.element_size()
        stored = tokens * (a1 + a2) * itemsize + codec.basis_nbytes()
        if rule.only_if_smaller and stored >= t.numel() * itemsize:
            need = codec.basis_nbytes() // ((n - a1 - a2) * itemsize) + 1
            self.skip(
                site,
                f"compressing would store {stored:,} B (payload + basis) for a "
                f"{t.numel() * itemsize:,} B tensor: {tokens} tokens x n={n}, ranks ({a1}, {a2}); "
                f"it pays off from {need} tokens per micro-batch (only_if_smaller=True)",
            )
            return None
        self.codecs[site] = codec
        self.plan[site] = site
        self.sharers[site] = [site]
        return codec

    def stored(self, site: str, t: torch.Tensor, stored: Any) -> None:
        """What the codec policy returned for ``site`` (``PracPolicy``): records the storages
        kept uncompressed and the members of each sharing group."""
        if stored is None:
            owner = self.raw.setdefault(storage_of(t), site)
            if owner != site and not self._assigned and site not in self.plan:
                self.codec_for(site, t, owner)  # records why it is kept (no codec built)
        elif not self._assigned and getattr(stored.codec, "name", None) in self.codecs:
            # an encode-once cache hit: another member of a sharing group
            members = self.sharers.setdefault(stored.codec.name, [stored.codec.name])
            if site not in members:
                members.append(site)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "forwards": self.forwards,
            "codecs": {k: c.state_dict() for k, c in self.codecs.items()},
            "roles": {k: c.role for k, c in self.codecs.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.forwards = int(state["forwards"])
        self.codecs.clear()
        self.plan.clear()
        for key, sd in state["codecs"].items():
            role = state["roles"][key]
            cfg = prac_codec_config(self.labels[role], int(sd["r1"]), int(sd["r2"]))
            codec = PracCodec(cfg, clock=self.clock, name=key, role=role)
            codec.load_state_dict(sd)
            self.codecs[key] = codec
            self.plan[key] = key
            self.sharers.setdefault(key, [key])

    def report(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "forwards": self.forwards,
            "compressed": {
                k: {**c.metadata(), "role": c.role, "sites": self.sharers.get(k, [k])}
                for k, c in self.codecs.items()
            },
            "skipped": dict(self.skipped),
        }


class PracPolicy(CodecPolicy):
    """A ``CodecPolicy`` over a :class:`PracState`, treating storages as the unit: remembers
    which storages a site kept uncompressed during this forward, so a later saver of the same
    storage (o_proj after SDPA) is not compressed for nothing; each forward advances the clock.

    ``assign``: the state's own (the strategy's), or the plan runtime's ``PlanAssign``, which
    sends the sites its table does not encode to the state."""

    def __init__(
        self,
        state: PracState,
        assign: Callable[[str, torch.Tensor], Any] | None = None,
        carry: CodecPolicy | None = None,
    ) -> None:
        super().__init__(self._assign, carry)
        self.state = state
        self.inner_assign = state.assign if assign is None else assign

    def _assign(self, site: str, t: torch.Tensor) -> Any:
        self.state._assigned = True
        return self.inner_assign(site, t)

    def reset(self) -> None:
        super().reset()
        self.state.begin_forward()

    def __call__(self, site: str, t: torch.Tensor):
        self.state._assigned = False
        stored = super().__call__(site, t)
        self.state.stored(site, t, stored)
        return stored


__all__ = ["ATTENTION_OPS", "ROLES", "PracPolicy", "PracState", "prac_codec_config", "storage_of"]
