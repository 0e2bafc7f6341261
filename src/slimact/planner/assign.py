"""A plan as the codec policy's ``assign(site, tensor)``: its site table, then its lazy rules.

One codec instance per (block, storage) of the table, built for the tensor's channel count, and
one per (rule, role, channel count) of the rules; a PRAC rule's sites go to the runtime's PRAC
state (``planner.prac_sites``). The plan runtime (``planner.apply``) routes saves through it.
"""

from __future__ import annotations

from typing import Any

import torch

from slimact.classify import site_role
from slimact.codecs.base import Codec
from slimact.codecs.build import build_codec
from slimact.codecs.saving import hidden_channels
from slimact.planner.plan import Plan, abs_site, site_module
from slimact.planner.prac_sites import PracState


class PlanAssign:
    """``assign(site, tensor) -> Codec | None`` from a plan's site table, then its lazy rules
    (each for the sites of its ``modules`` only, where it has some). ``runtime``: the plan
    runtime whose ``observer`` sees each save first (``planner.apply``)."""

    def __init__(self, plan: Plan, runtime: Any = None) -> None:
        self.runtime = runtime
        self.table: dict[str, tuple[str, str]] = {}  # abs site -> (codec, storage key)
        for lp in plan.layers:
            for codec, names in lp.codecs:
                key = f"{lp.block}|{names[0]}"
                for n in names:
                    self.table[abs_site(n, lp.block)] = (codec, key)
        self.codecs: dict[str, Codec] = {}
        self.rules = plan.rules
        self.allowed = [None if r.modules is None else frozenset(r.modules) for r in plan.rules]
        self.rule_codecs: dict[tuple[int, str, int], Codec] = {}  # (rule, role, channels)
        self.prac: PracState | None = None  # a PRAC rule's state (the runtime sets it)

    def __call__(self, site: str, t: torch.Tensor) -> Codec | None:
        observer = self.runtime.observer if self.runtime is not None else None
        if observer is not None:
            observer(site, t)
        hit = self.table.get(site)
        if hit is None:
            return self._by_rule(site, t) if self.rules else None
        name, key = hit
        # the key names a block's first site of this codec, which may span several storages:
        # a channel codec is sized per channel count (int8-channel on 768- and 2048-wide ones)
        ck = f"{key}|{hidden_channels(t) if t.dim() else 0}"
        codec = self.codecs.get(ck)
        if codec is None:
            codec = self.codecs[ck] = build_codec(name, t)
        return codec

    def _by_rule(self, site: str, t: torch.Tensor) -> Codec | None:
        for i, rule in enumerate(self.rules):
            if rule.roles == "prac":  # its state filters (and reports what it filters out)
                if self.prac is None:
                    raise ValueError("a PRAC rule needs the plan runtime's PRAC state")
                codec = self.prac.assign(site, t)
                if codec is not None:
                    return codec
                continue
            allowed = self.allowed[i]
            if allowed is not None and site_module(site) not in allowed:
                continue
            role = site_role(site, t, rule.min_numel, rule.sdpa_out)
            label = rule.codec(role) if role is not None else None
            if role is None or label is None:
                continue
            channels = hidden_channels(t) if role in rule.sized else 0
            key = (i, role, channels)
            codec = self.rule_codecs.get(key)
            if codec is None:
                codec = self.rule_codecs[key] = build_codec(label, t, channels)
            return codec
        return None
