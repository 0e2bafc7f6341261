"""A plan's lazy rules (``SiteRule``): decisions that need a site's first save.

A rule maps a saved tensor's role (``slimact.classify.site_role``: act / qk / qkv / scores / mask,
read from the site name and the tensor; or PRAC's roles, ``roles="prac"``) to a codec label; the
plan runtime (``slimact.planner.apply``) builds the codec on the first save of each role and
channel count. ``modules`` restricts a rule to the sites of some modules (absolute module paths,
a ``filter_fn``'s choice written into the plan: ``slimact.planner.scope.restrict_rules``); the
others are kept, and a PRAC rule reports them as filtered out. ``slimact.planner.plan`` carries
the rules in a ``Plan`` (and re-exports ``SiteRule``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from slimact import actions
from slimact.classify import ROLES as SITE_ROLES
from slimact.codecs.base import codec_config
from slimact.codecs.prac import PracCodecConfig

# PRAC's roles (``roles="prac"``), each site's decided by ``slimact.planner.prac_sites``
PRAC_ROLES = ("linear", "output", "norm", "act", "gate")


@dataclass(frozen=True)
class SiteRule:
    """A lazy rule (module docstring): role -> codec label, decided on the first save.

    ``codecs``: (role, codec label) pairs, a role absent is kept; ``min_numel`` and ``sdpa_out``
    are ``slimact.classify.site_role``'s options; ``sized``: the roles whose codec gets the
    tensor's hidden channel count (``slimact.codecs.saving.hidden_channels``), the others 0 (a
    per-channel codec then takes the last dimension of the memory-order tensor).

    ``roles="prac"``: PRAC's roles instead (linear / output / norm / act / gate, decided per
    site by ``slimact.planner.prac_sites``), each labelled with a PRAC-family codec whose ranks are
    fractions of the feature size or absolute (``prac/r1=0.3,r2=0.3``); ``overrides``: (pattern,
    r1, r2), first match wins; ``keep``: patterns of sites kept; ``gate_modules``: modules whose
    product saves are the ``gate`` role; ``min_features``; ``only_if_smaller``: keep a site whose
    payload plus basis would not be smaller than its tensor. The runtime builds one codec per
    compressed storage, all reading one step clock (the count of training forwards).

    ``modules``: None, every module's sites; a tuple of absolute module paths, the sites of those
    modules only (a site belongs to the module its name carries: ``layers.0.mlp`` for
    ``layers.0.mlp:mul#0``), the others kept by this rule."""

    codecs: tuple[tuple[str, str], ...] = ()
    min_numel: int = 1024
    sdpa_out: bool = False
    sized: tuple[str, ...] = ("act", "qk", "qkv")
    roles: str = "site"
    keep: tuple[str, ...] = ()
    overrides: tuple[tuple[str, int | float, int | float], ...] = ()
    gate_modules: tuple[str, ...] = ()
    min_features: int = 0
    only_if_smaller: bool = False
    modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:  # tuples also when read from JSON lists
        object.__setattr__(self, "codecs", tuple((r, c) for r, c in self.codecs))
        object.__setattr__(self, "sized", tuple(self.sized))
        object.__setattr__(self, "keep", tuple(self.keep))
        object.__setattr__(self, "overrides", tuple((p, a, b) for p, a, b in self.overrides))
        object.__setattr__(self, "gate_modules", tuple(self.gate_modules))
        if self.modules is not None:
            paths = self.modules
            if not isinstance(paths, tuple | list) or not all(isinstance(p, str) for p in paths):
                raise ValueError(
                    "SiteRule.modules must be None (every module) or a tuple of module paths "
                    f"(str), got {paths!r}"
                )
            object.__setattr__(self, "modules", tuple(dict.fromkeys(paths)))
        roles = [r for r, _ in self.codecs]
        if len(set(roles)) != len(roles):
            raise ValueError(f"SiteRule names a role twice: {roles}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"SiteRule.min_numel must be an int >= 0, got {self.min_numel!r}")
        if self.roles not in ("site", "prac"):
            raise ValueError(f"SiteRule.roles must be 'site' or 'prac', got {self.roles!r}")
        known = PRAC_ROLES if self.roles == "prac" else SITE_ROLES
        unknown = [r for r in roles if r not in known]
        if unknown:  # a role no site ever takes: the rule would silently code nothing
            raise ValueError(
                f"SiteRule (roles={self.roles!r}) names unknown role(s) {unknown}; its roles are "
                f"{', '.join(known)}"
            )
        for role, label in self.codecs:  # a label is checked here, not at the first save
            cfg = codec_config(label)
            if (self.roles == "prac") != isinstance(cfg, PracCodecConfig):
                what = "prac, pac or rac" if self.roles == "prac" else "a codec other than PRAC's"
                raise ValueError(
                    f"SiteRule (roles={self.roles!r}): role {role!r} takes {what}, got {label!r}"
                )
        prac_only = ("keep", "overrides", "gate_modules", "min_features", "only_if_smaller")
        if self.roles == "site" and any(getattr(self, f) for f in prac_only):
            raise ValueError(f"SiteRule: {', '.join(prac_only)} are options of roles='prac'")

    def codec(self, role: str) -> str | None:
        """The codec label of ``role``, or None (kept)."""
        return dict(self.codecs).get(role)

    def within(self, paths: Iterable[str]) -> SiteRule:
        """This rule for the sites of ``paths`` only (of those among its own ``modules``, where
        it has some), in the order of ``paths``."""
        mine = None if self.modules is None else set(self.modules)
        return dataclasses.replace(
            self, modules=tuple(p for p in paths if mine is None or p in mine)
        )

    def describe(self) -> str:
        """``act=int4-outlier-g16, qkv=int8-channel, ...`` (``; in 12 modules``: ``modules``)."""
        where = "" if self.modules is None else f"; in {len(self.modules)} module(s)"
        return ", ".join(f"{r}={c}" for r, c in self.codecs) + where

    def table_lines(self) -> list[str]:
        """The rule's rows in ``Plan.table``."""
        if self.roles == "prac":
            head = (
                "== rule (PRAC's roles, on each site's first save"
                f"{'; kept where payload + basis would not be smaller' if self.only_if_smaller else ''}"
                f"; features >= {self.min_features})"
            )
        else:
            head = (
                f"== rule (on the first save of each role; {self.min_numel}+ values"
                f"{', SDPA output as act' if self.sdpa_out else ''})"
            )
        lines = [head, *(f"   {role:<44} {actions.codec(codec)}" for role, codec in self.codecs)]
        lines += [f"   {p:<44} ranks r1={a}, r2={b} (override)" for p, a, b in self.overrides]
        lines += [f"   {p:<44} {actions.KEEP}" for p in self.keep]
        if self.modules is not None:
            shown = ", ".join(p or "(root)" for p in self.modules[:4])
            more = f", ... ({len(self.modules)} in all)" if len(self.modules) > 4 else ""
            lines.append(f"   only the sites of modules: {shown or '(none)'}{more}")
        return lines


def rule_conflicts(rules: tuple[SiteRule, ...]) -> list[str]:
    """What keeps ``rules`` from holding in one plan (``Plan.merge`` names it). Rules for
    disjoint modules do not meet; two whose modules overlap (``None``: every module) conflict,
    named by what differs (a role's two codecs, two kinds of roles) or, where they agree, as one
    rule twice: which one codes a shared site would depend on their order."""
    problems: list[str] = []
    if sum(r.roles == "prac" for r in rules) > 1:
        problems.append("two PRAC rules: a plan carries at most one (one PRAC state per model)")
    for i, a in enumerate(rules):
        for b in rules[i + 1 :]:
            both = (
                None
                if a.modules is None or b.modules is None
                else sorted(set(a.modules) & set(b.modules))
            )
            if both == []:
                continue
            where = "every module" if both is None else f"modules {', '.join(both[:3])}"
            if a.roles != b.roles:
                problems.append(
                    f"two rules decide the sites of {where} by different roles "
                    f"({a.roles!r} and {b.roles!r})"
                )
                continue
            theirs = dict(b.codecs)
            before = len(problems)
            for role, codec in a.codecs:
                if role in theirs and theirs[role] != codec:
                    problems.append(
                        f"the rules give role {role!r} two codecs in {where}: {codec} and "
                        f"{theirs[role]}"
                    )
            if len(problems) == before:
                problems.append(
                    f"two rules code the sites of {where} ({a.describe()} and {b.describe()}): "
                    "a site is coded by one rule"
                )
    return problems


__all__ = ["PRAC_ROLES", "SiteRule", "rule_conflicts"]
