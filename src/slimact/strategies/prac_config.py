"""Typed configs of the PRAC-family strategies (``prac``, ``pac``, ``rac``; prac.txt §4–5).

Ranks per site role, lazy-update intervals, SVD method, overrides and keep patterns, validated in
``__post_init__``; a spec sets ``spec_fields`` (``prac@t1=5,svd=exact``, ``slimact.spec``). ``strategies/prac.py`` applies them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import ClassVar

from slimact.codecs.base import codec_label
from slimact.codecs.prac import (
    SVD_METHODS,
    PacCodecConfig,
    PracCodecConfig,
    RacCodecConfig,
    validate_rank_pair,
)
from slimact.planner.plan import SiteRule
from slimact.planner.prac_sites import ROLES
from slimact.registry import StrategyConfig
from slimact.spec import flag


@dataclass(frozen=True)
class PracConfig(StrategyConfig):
    """Ranks per role as (r1, r2): floats are fractions of the feature size n, ints absolute.

    ``overrides``: ((pattern, r1, r2), ...), first match wins; patterns are fnmatch'ed against
    the site name (``layers.0.mlp.down_proj:linear#0``) and its module path. ``keep``: patterns of
    sites never compressed. ``gate_modules``: modules whose elementwise-product saves (the SwiGLU
    gate ``silu(gate) * up``) count as nonlinear sites.
    """

    linear: tuple[int | float, int | float] = (0.3, 0.3)
    nonlinear: tuple[int | float, int | float] = (0.2, 0.2)
    overrides: tuple[tuple[str, int | float, int | float], ...] = ()
    keep: tuple[str, ...] = ()
    gate_modules: tuple[str, ...] = ("*mlp",)
    t1: int = 5
    t2: int = 1
    svd: str = "randomized"
    niter: int = 2
    seed: int = 0
    min_features: int = 8
    q2: str = "regenerate"
    only_if_smaller: bool = True
    fuse_norms: bool = True
    # ablation only (prac.txt App. D.3): k = k_scale·(n − r1)/r2 on linear-role / other sites;
    # anything but 1 makes the estimate biased
    k_scale: tuple[float, float] = (1.0, 1.0)

    codec_cls: ClassVar[type[PracCodecConfig]] = PracCodecConfig
    spec_fields: ClassVar = {"t1": int, "t2": int, "svd": str, "q2": str, "niter": int, "seed": int,
                             "only_if_smaller": flag, "fuse_norms": flag}  # fmt: skip

    def __post_init__(self) -> None:
        k_scale = tuple(self.k_scale)
        if len(k_scale) != 2:
            raise ValueError(f"k_scale must be a pair (linear, nonlinear), got {self.k_scale!r}")
        object.__setattr__(self, "k_scale", k_scale)
        for name in ("linear", "nonlinear"):
            pair = tuple(getattr(self, name))
            if len(pair) != 2:
                raise ValueError(f"{name} must be a pair (r1, r2), got {getattr(self, name)!r}")
            object.__setattr__(self, name, pair)
            validate_rank_pair(*pair, what=f"{type(self).__name__}.{name}")
        ov = self.overrides.items() if isinstance(self.overrides, dict) else self.overrides
        rows = []
        for row in ov:
            row = (row[0], *row[1]) if len(row) == 2 else tuple(row)
            if len(row) != 3 or not isinstance(row[0], str):
                raise ValueError(f"overrides entries must be (pattern, r1, r2), got {row!r}")
            validate_rank_pair(row[1], row[2], what=f"override {row[0]!r}")
            rows.append(row)
        object.__setattr__(self, "overrides", tuple(rows))
        for name in ("keep", "gate_modules"):
            v = getattr(self, name)
            v = (v,) if isinstance(v, str) else tuple(v)
            if not all(isinstance(p, str) for p in v):
                raise ValueError(f"{name} must be a tuple of patterns (str), got {v!r}")
            object.__setattr__(self, name, v)
        if self.svd not in SVD_METHODS:
            raise ValueError(f"svd must be one of {SVD_METHODS}, got {self.svd!r}")
        for name in ("only_if_smaller", "fuse_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.min_features, int) or self.min_features < 2:
            raise ValueError(f"min_features must be an int >= 2, got {self.min_features!r}")
        for r1, r2 in (self.linear, self.nonlinear, *[(r[1], r[2]) for r in self.overrides]):
            self.codec_config(r1, r2)  # t1, t2, niter, seed and the variant's invariants

    def codec_config(
        self, r1: int | float, r2: int | float, role: str = "linear"
    ) -> PracCodecConfig:
        """The codec config of one site (the variant's codec class checks its invariant)."""
        k_scale = self.k_scale[0] if role in ("linear", "output") else self.k_scale[1]
        return self.codec_cls(
            k_scale=k_scale,
            r1=r1,
            r2=r2,
            t1=self.t1,
            t2=self.t2,
            svd=self.svd,
            niter=self.niter,
            seed=self.seed,
            q2=self.q2,
        )

    def label(self, role: str) -> str:
        """The codec label of ``role``'s sites, its ranks spelled out (``prac/r1=0.3,r2=0.3``)."""
        r1, r2 = self._role_ranks(role)
        name, _, params = codec_label(self.codec_config(r1, r2, role)).partition("/")
        rest = [p for p in params.split(",") if p and not p.startswith(("r1=", "r2="))]
        return f"{name}/{','.join([f'r1={r1}', f'r2={r2}', *rest])}"

    def _role_ranks(self, role: str) -> tuple[int | float, int | float]:
        return self.linear if role in ("linear", "output") else self.nonlinear

    def rule(self) -> SiteRule:
        """The lazy rule the plan runtime applies (``SiteRule(roles="prac")``)."""
        return SiteRule(
            codecs=tuple((role, self.label(role)) for role in ROLES),
            roles="prac",
            keep=self.keep,
            overrides=self.overrides,
            gate_modules=self.gate_modules,
            min_features=self.min_features,
            only_if_smaller=self.only_if_smaller,
        )

    def ranks_for(self, role: str, site: str, module: str) -> tuple[int | float, int | float]:
        for pattern, r1, r2 in self.overrides:
            if fnmatch.fnmatchcase(site, pattern) or fnmatch.fnmatchcase(module, pattern):
                return r1, r2
        return self._role_ranks(role)


@dataclass(frozen=True)
class PacConfig(PracConfig):
    """Ablation: principal subspace only, at PRAC's total rank (0.6n linear, 0.4n nonlinear)."""

    linear: tuple[int | float, int | float] = (0.6, 0)
    nonlinear: tuple[int | float, int | float] = (0.4, 0)
    codec_cls: ClassVar[type[PracCodecConfig]] = PacCodecConfig


@dataclass(frozen=True)
class RacConfig(PracConfig):
    """Ablation: random subspace only (k = n/r2), at PRAC's total rank."""

    linear: tuple[int | float, int | float] = (0, 0.6)
    nonlinear: tuple[int | float, int | float] = (0, 0.4)
    codec_cls: ClassVar[type[PracCodecConfig]] = RacCodecConfig
