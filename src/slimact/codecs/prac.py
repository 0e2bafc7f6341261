"""PRAC: store a saved activation through a principal + random subspace (prac.txt §4–5).

Reshape the saved tensor to X (tokens × n, features last). With orthonormal Q1 (n × r1, the top-r1
right singular vectors of X) and Q2 (n × r2, an orthonormal basis of (I − Q1Q1ᵀ)S, S ~ N(0, 1)),

    store    Z = [XQ1, k·XQ2]            (tokens × (r1 + r2), the activation's dtype)
    rebuild  X̃ = XQ1Q1ᵀ + k·XQ2Q2ᵀ = Z Pᵀ,   P = [Q1, Q2] (n × (r1 + r2), fp32),   k = (n − r1)/r2.

E[Q2Q2ᵀ] = r2/(n − r1)·(I − Q1Q1ᵀ) (Lemma 12), so E[X̃] = X (Thm 6) and
E‖X̃ − X‖² = (k − 1)·‖X − XQ1Q1ᵀ‖² (Thm 15): the principal part removes the large singular values
from the variance, the random part keeps the estimate unbiased. A linear layer's weight gradient
G̃ = gYᵀX̃ is then unbiased too (Lemma 3). Variants: ``pac`` (r2 = 0: X̃ = XQ1Q1ᵀ, biased, no
noise) and ``rac`` (r1 = 0, k = n/r2: unbiased, variance (n/r2 − 1)‖X‖²).

Memory per site: tokens·(r1 + r2)·itemsize for Z plus the basis, which does not depend on the
batch. By default (``q2="regenerate"``) Q2 is not kept: S is drawn from a stored seed and
Q2 = (S − Q1M)R⁻¹ rebuilt on demand from M = Q1ᵀS (r1 × r2) and the QR factor R (r2 × r2), so the
basis costs n·r1 + r2·(r1 + r2) fp32 values instead of n·(r1 + r2) (RAC's becomes r2²). The price
is one n × r2 draw and triangular solve per encode and per decode. ``q2="store"`` keeps Q2 as the
paper does. PRAC pays off when tokens ≫ n (the paper's B·S = 32768 tokens).

Lazy updates (Alg. 1): Q1 is recomputed when t % T1 == 0 and Q2 redrawn when t % T2 == 0, where t
is the step clock (the strategy's count of training forwards, or this codec's count of encodes).
Defaults T1 = 5 (randomized range finder), T2 = 1, not the paper's 500/500 (exact SVD): a Q2 kept
for T2 steps is a fixed draw, so its error acts as a bias for that window, and a Q1 from one small
batch goes stale within a few steps (the loss gap to none grows with T1, and cola-20m diverged under
500/500: BENCHMARKS.md §4). A shorter T1 costs more step time (more range finders). A seeded Q2 costs one QR of n × r2 per step; ``prac@t1=500,t2=500,svd=exact`` restores the
paper's schedule.
Q2 must lie in Q1's complement for k to be right, so Q2 is also redrawn whenever Q1 changes (with
T1 a multiple of T2, e.g. the paper's T1 = T2, that is exactly Alg. 1). Q1 comes from an exact SVD
(``svd="exact"``) or a randomized range finder with ``niter`` power iterations (``"randomized"``,
Halko et al.; like ``torch.svd_lowrank`` but drawing from this codec's own generator, so global
RNG streams are untouched). The generator is seeded, and its state is in ``state_dict``.

Non-finite X at an update: the SVD is skipped, the previous Q1 kept (a random one if there is none
yet), a warning names the site, and the update is retried on the next encode. A non-finite X is
stored exactly (``codecs.base.exact_packed``): NaN in gives NaN out, and the finite values stay
exact. So is an X the subspaces cannot carry faithfully (``codecs.quant.range_problem``: values
whose squares overflow float32, or a row beyond ``max_range`` times the median row; such rows would
also dominate the principal subspace, so no update is taken from them either), and an X whose
basis update fails (SVD/QR not converging, a non-finite basis) or whose projection overflows. The
update is then retried on the next encode; the saving policy reports the site and the reason.
Large finite X (max |x| >= 2^20) is scaled by a power of two before the basis is computed (the
singular vectors do not change, exactly), so XᵀX cannot overflow.

**Without a sync** (:meth:`PracCodec.encode_deferred`, what the saving policy calls once a
site's saves were clean): the checks above become a device verdict (non-finite X, the range
check, a non-finite new Q1, a non-finite Z) read after the step (``slimact.ops.deferred``). The
payload is Z whatever the verdict: a row of X holding NaN/inf decodes to a non-finite row (NaN
in gives NaN out, never a finite wrong value), and a new Q1 is taken on the device only where it
is usable (``torch.where``: X finite and within range, Q1 finite; else the previous Q1 stays, and
the update is retried at the next encode once the verdict is read). The power-of-two scaling is
decided on the device too, Q2's seed is a draw of the codec's host generator (a host read, no
device involved), and host draws reach the device by non-blocking copies. What
still waits for the device: a Q1 update's SVD (every ``t1`` steps) checks its own convergence on
a GPU (``torch.linalg.svd``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slimact.codecs.base import Codec, CodecConfig, Deferred, Packed, exact_value, register_codec
from slimact.codecs.prac_ref import (  # noqa: F401  (re-exported: the public names)
    Q2_MODES,
    SVD_METHODS,
    _draw,
    _is_rank,
    check_ranks,
    complement_factors_ref,
    complement_from_seed_ref,
    prac_decode_ref,
    prac_encode_ref,
    prac_reconstruct_ref,
    principal_basis_ref,
    random_complement_ref,
    randomized_basis_ref,
    resolve_rank,
    site_seed,
    validate_rank_pair,
)
from slimact.codecs.quant import (
    DEFAULT_MAX_RANGE,
    check_max_range,
)
from slimact.codecs.rows import (
    range_problem,
    row_stats,
    stats_bad,
    stats_ok_values,
)
from slimact.ops.deferred import host_values


@dataclass(frozen=True)
class PracCodecConfig(CodecConfig):
    """r1/r2: fraction of n (float in [0, 1)) or absolute rank (int). T1/T2: update intervals."""

    r1: int | float = 0.3
    r2: int | float = 0.3
    t1: int = 5
    t2: int = 1
    svd: str = "randomized"
    niter: int = 2
    oversample: int = 8
    seed: int = 0
    q2: str = "regenerate"
    max_range: float | None = DEFAULT_MAX_RANGE  # rows beyond it are stored exactly; None: off
    k_scale: float = 1.0  # ablation only (prac.txt App. D.3): k = k_scale·(n − r1)/r2, biased ≠ 1

    def __post_init__(self) -> None:
        validate_rank_pair(self.r1, self.r2, type(self).__name__)
        check_max_range(self, self.max_range)
        for name in ("t1", "t2"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"{name} (update interval in steps) must be an int >= 1, got {v!r}"
                )
        if self.svd not in SVD_METHODS:
            raise ValueError(f"svd must be one of {SVD_METHODS}, got {self.svd!r}")
        if not isinstance(self.niter, int) or self.niter < 0:
            raise ValueError(f"niter must be an int >= 0, got {self.niter!r}")
        if not isinstance(self.oversample, int) or self.oversample < 0:
            raise ValueError(f"oversample must be an int >= 0, got {self.oversample!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.q2 not in Q2_MODES:
            raise ValueError(f"q2 must be one of {Q2_MODES}, got {self.q2!r}")
        if not isinstance(self.k_scale, (int, float)) or not 0 < self.k_scale < float("inf"):
            raise ValueError(f"k_scale must be a finite number > 0, got {self.k_scale!r}")


@dataclass(frozen=True)
class PacCodecConfig(PracCodecConfig):
    """Principal subspace only (r2 = 0): X̃ = XQ1Q1ᵀ, biased (prac.txt §4.2)."""

    r1: int | float = 0.6
    r2: int | float = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.r2 != 0:
            raise ValueError(f"pac has no random subspace: r2 must be 0, got {self.r2}")


@dataclass(frozen=True)
class RacCodecConfig(PracCodecConfig):
    """Random subspace only (r1 = 0, k = n/r2): unbiased, high variance (prac.txt §4.2)."""

    r1: int | float = 0
    r2: int | float = 0.6

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.r1 != 0:
            raise ValueError(f"rac has no principal subspace: r1 must be 0, got {self.r1}")


class PracCodec(Codec):
    """Stateful PRAC codec: one instance per site (or shared group); holds Q1, Q2 and its RNG.

    ``clock`` (optional) returns the training step t; without one the codec counts its encodes.
    ``name`` labels warnings (the site or group it serves). ``q1`` is the principal basis; ``q2``
    and ``p`` = [Q1, Q2] are materialised on access when Q2 is regenerated from its seed.
    """

    def __init__(
        self,
        config: PracCodecConfig,
        clock: Callable[[], int] | None = None,
        name: str = "",
        role: str = "",
    ) -> None:
        super().__init__(config)
        self.clock = clock
        self.name = name or "prac"
        self.role = role
        self.gen = torch.Generator().manual_seed(site_seed(config.seed, self.name))
        self.calls = 0
        self.n: int | None = None
        self.r1 = self.r2 = 0
        self.q1: torch.Tensor | None = None
        self.basis: dict[str, torch.Tensor] = {}  # what payloads reference (see _basis_tensors)
        self.q2_seed = -1
        self.q1_step = self.q2_step = -1  # step of the last update
        self.q1_pending = False  # a Q1 update was skipped (non-finite X): retry next encode
        self.updates = {"q1": 0, "q2": 0, "q1_skipped": 0}

    # -- ranks ---------------------------------------------------------------------------------
    @property
    def k(self) -> float:
        return self.config.k_scale * (self.n - self.r1) / self.r2 if self.r2 else 1.0

    @property
    def regenerates(self) -> bool:
        return self.config.q2 == "regenerate" and self.r2 > 0

    def _setup(self, n: int) -> None:
        r1, r2 = resolve_rank(self.config.r1, n), resolve_rank(self.config.r2, n)
        check_ranks(r1, r2, n, self.name)
        self.n, self.r1, self.r2 = n, r1, r2

    def basis_nbytes(self) -> int:
        """Bytes of the basis every payload references (fp32), independent of the batch."""
        if self.regenerates:
            return 4 * (self.n * self.r1 + self.r2 * (self.r1 + self.r2))
        return 4 * self.n * (self.r1 + self.r2)

    # -- the basis -----------------------------------------------------------------------------
    @property
    def q2(self) -> torch.Tensor | None:
        if not self.basis:
            return None
        if "p" in self.basis:
            return self.basis["p"][:, self.r1 :]
        b = self.basis
        return complement_from_seed_ref(b["q1"], b["m"], b["r"], self.q2_seed)

    @property
    def p(self) -> torch.Tensor | None:
        if not self.basis:
            return None
        return self.basis["p"] if "p" in self.basis else torch.cat([self.q1, self.q2], dim=1)

    def _set_q2(self, seed_or_q2: int | torch.Tensor) -> None:
        """Install Q2 (a seed in regenerate mode, the matrix in store mode) and refresh payloads."""
        if self.regenerates:
            self.q2_seed = int(seed_or_q2)
            m, r = complement_factors_ref(self.q1, self.r2, self.q2_seed)
            self.basis = {"q1": self.q1, "m": m, "r": r}
        else:
            q2 = seed_or_q2 if isinstance(seed_or_q2, torch.Tensor) else None
            if q2 is None:
                q2 = torch.zeros(self.n, 0, device=self.q1.device)
            self.basis = {"p": torch.cat([self.q1, q2], dim=1).contiguous()}

    def _new_q2(self) -> int | torch.Tensor:
        if self.regenerates:  # a draw of the host generator: no device involved
            return host_values(torch.randint(0, 2**62, (1,), generator=self.gen))[0]
        if self.r2:
            return random_complement_ref(self.q1, self.n, self.r2, self.gen)
        return torch.zeros(self.n, 0, device=self.q1.device)

    # -- subspace updates (Alg. 1) ---------------------------------------------------------------
    def _q1_due(self, t: int) -> bool:
        return self.q1 is None or self.q1_pending or (t % self.config.t1 == 0 and t != self.q1_step)

    def _principal_basis(self, x2d: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Q1 of x2d; raises ``torch.linalg.LinAlgError`` if it fails or (``check``: a host
        read) comes out non-finite."""
        cfg = self.config
        if x2d.numel():  # max |x| >= 2^20: scaled by a power of two, decided on the device
            amax = x2d.abs().amax().float()
            scale = torch.where(
                amax >= 2.0**20, torch.ldexp(torch.ones_like(amax), -torch.frexp(amax)[1]), 1.0
            )
            x2d = x2d.float() * scale  # the singular vectors are exactly those of x2d
        if cfg.svd == "exact":
            q1 = principal_basis_ref(x2d, self.r1)
        else:
            q1 = randomized_basis_ref(x2d, self.r1, self.gen, cfg.niter, cfg.oversample)
        if check and not bool(torch.isfinite(q1).all()):
            raise torch.linalg.LinAlgError("the principal basis came out non-finite")
        return q1

    def _update(self, x2d: torch.Tensor, t: int, finite: bool = True) -> None:
        cfg = self.config
        q1_due = self._q1_due(t)
        changed = False
        if q1_due and self.r1:
            if finite:
                self.q1 = self._principal_basis(x2d)
                self.q1_pending = False
                self.updates["q1"] += 1
            else:
                self.updates["q1_skipped"] += 1
                self.q1_pending = True
                fallback = "keeping the previous Q1"
                if self.q1 is None:
                    fallback = "using a random Q1 until the next update"
                    s = torch.randn(self.n, self.r1, generator=self.gen)
                    self.q1 = torch.linalg.qr(s)[0].to(x2d.device)
                warnings.warn(
                    f"PRAC site {self.name}: non-finite activation at step {t}; skipped the "
                    f"principal-subspace update, {fallback}",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self.q1_step, changed = t, True
        elif self.q1 is None:  # rac: no principal part, an empty Q1 once
            self.q1 = torch.zeros(self.n, 0, device=x2d.device)
            self.q1_step, changed = t, True
        # Q2 must lie in the current Q1's complement: redrawn whenever Q1 changes
        if not self.basis or changed or (t % cfg.t2 == 0 and t != self.q2_step):
            self._set_q2(self._new_q2())
            self.q2_step = t
            self.updates["q2"] += 1

    def _update_deferred(self, x2d: torch.Tensor, t: int) -> torch.Tensor | None:
        """:meth:`_update` without a host read: a due Q1 is taken where X is usable (finite,
        within range: decided on the device) and the new basis is finite, else the previous one
        stays. Returns the 0-d bool "the Q1 update was not taken" (None: none was due)."""
        cfg = self.config
        skipped = None
        changed = False
        if self._q1_due(t) and self.r1:
            rows = row_stats(x2d, 0, cfg.max_range)
            usable = torch.isfinite(x2d).all()
            if rows is not None:
                usable = usable & ~stats_bad(rows, cfg.max_range)
            # an unusable X is replaced by zeros: the solvers never see NaN/inf (which they
            # may refuse with an error, a host read), and the result is not taken anyway
            new = self._principal_basis(torch.where(usable, x2d, 0.0), check=False)
            ok = usable & torch.isfinite(new).all()
            self.q1 = torch.where(ok, new, self.q1)
            skipped = ~ok
            self.q1_pending = False
            self.updates["q1"] += 1
            self.q1_step, changed = t, True
        if not self.basis or changed or (t % cfg.t2 == 0 and t != self.q2_step):
            self._set_q2(self._new_q2())
            self.q2_step = t
            self.updates["q2"] += 1
        return skipped

    # -- Codec interface -------------------------------------------------------------------------
    def _prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(x as tokens x n, the step t): checks the shape, sets the ranks up, moves restored
        state to x's device, counts the encode."""
        if not x.is_floating_point() or x.dim() < 1:
            raise ValueError(
                f"PRAC site {self.name}: needs a floating tensor with a feature dimension, "
                f"got dtype {x.dtype} shape {tuple(x.shape)}"
            )
        n = x.shape[-1]
        if self.n is None:
            self._setup(n)
        elif n != self.n:
            raise ValueError(
                f"PRAC site {self.name}: feature size changed from {self.n} to {n}; "
                f"one codec serves one site (or a group sharing one input)"
            )
        t = self.clock() if self.clock is not None else self.calls
        self.calls += 1
        x2d = x.reshape(-1, n)
        if self.q1 is not None and self.q1.device != x.device:  # state restored on another device
            self.q1 = self.q1.to(x.device)
            self.basis = {k: v.to(x.device) for k, v in self.basis.items()}
            if "q1" in self.basis:
                self.basis["q1"] = self.q1
        return x2d, t

    def encode(self, x: torch.Tensor) -> Packed:
        if isinstance(x, torch.Tensor) and (exact := self.float64_exact(x)) is not None:
            return exact
        x2d, t = self._prepare(x)
        finite = bool(torch.isfinite(x2d).all())
        reason = range_problem(x2d, 0, self.config.max_range) if finite else None
        if reason is not None:  # no update from rows the subspaces cannot carry: retried next time
            self.q1_pending = self.q1_pending or (self._q1_due(t) and self.r1 > 0)
            return self.fallback(x, reason)
        try:
            self._update(x2d, t, finite)
        except torch.linalg.LinAlgError as e:
            self.updates["q1_failed"] = self.updates.get("q1_failed", 0) + 1
            self.q1_pending = True
            return self.fallback(x, f"principal-subspace update failed ({e})".replace("\n", " "))
        if not finite:
            return self.fallback(x, "non-finite values (NaN/inf)")
        z = prac_encode_ref(x2d, self.p, self.r1, self.k)  # (T × n) -> (T × (r1 + r2))
        if not bool(torch.isfinite(z).all()):
            return self.fallback(x, "the projection Z = XP overflows its dtype")
        meta = {"r1": self.r1, "r2": self.r2, "k": self.k, "step": t, "seed": self.q2_seed}
        return Packed({"z": z, **self.basis}, tuple(x.shape), x.dtype, x.device, meta)

    def encode_deferred(self, x: torch.Tensor, state: dict) -> Deferred:
        """:meth:`encode` without a host read (see the module docstring); the checked encode
        where there is no basis to fall back on yet, or a skipped update to retry."""
        if (
            self.q1 is None
            or self.q1_pending
            or not x.is_floating_point()
            or x.dim() < 1
            or x.dtype == torch.float64
        ):
            return Deferred(self.encode(x))
        x2d, t = self._prepare(x)
        try:
            skipped = self._update_deferred(x2d, t)
        except torch.linalg.LinAlgError as e:
            self.updates["q1_failed"] = self.updates.get("q1_failed", 0) + 1
            self.q1_pending = True
            return Deferred(
                self.fallback(x, f"principal-subspace update failed ({e})".replace("\n", " "))
            )
        z = prac_encode_ref(x2d, self.p, self.r1, self.k)
        meta = {"r1": self.r1, "r2": self.r2, "k": self.k, "step": t, "seed": self.q2_seed}
        packed = Packed({"z": z, **self.basis}, tuple(x.shape), x.dtype, x.device, meta)
        # the verdict: [X finite, Z finite, Q1 update skipped (0 when none was due), row stats]
        flags = [torch.isfinite(x2d).all(), torch.isfinite(z).all()]
        flags.append(skipped if skipped is not None else torch.zeros_like(flags[0]))
        rows = row_stats(x2d, 0, self.config.max_range)
        verdict = [torch.stack(flags), *([rows] if rows is not None else [])]
        return Deferred(packed, verdict, self._explain)

    def _explain(self, values: list[float]) -> str | None:
        """The host's reading of a deferred verdict: a skipped Q1 update is retried at the next
        encode; a reason for what the payload could not carry faithfully."""
        finite, z_finite, skipped = values[:3]
        if skipped:
            self.q1_pending = True
            self.updates["q1_skipped"] += 1
        if not finite:
            return "non-finite values (NaN/inf): their rows decoded as non-finite"
        if len(values) > 3 and not stats_ok_values(values[3:], self.config.max_range):
            return (
                f"a row's norm beyond max_range={self.config.max_range:g} times the median "
                f"row's, or squares overflowing float32"
            )
        if not z_finite:
            return "the projection Z = XP overflowed its dtype"
        return None

    def decode(self, packed: Packed) -> torch.Tensor:
        if (y := exact_value(packed)) is not None:
            return y
        b, z = packed.tensors, packed.tensors["z"]
        if "p" in b:
            return prac_decode_ref(z, b["p"].to(z.device), packed.dtype).reshape(packed.shape)
        q2 = complement_from_seed_ref(b["q1"], b["m"], b["r"], packed.meta["seed"])  # n × r2
        p = torch.cat([b["q1"], q2], dim=1)  # n × (r1 + r2), freed after this decode
        return prac_decode_ref(z, p.to(z.device), packed.dtype).reshape(packed.shape)

    def metadata(self) -> dict[str, Any]:
        return {
            **super().metadata(),
            "site": self.name,
            "n": self.n,
            "ranks": (self.r1, self.r2),
            "k": self.k if self.n else None,
            "basis_bytes": self.basis_nbytes() if self.n else None,
            "updates": dict(self.updates),
            "fallbacks": dict(getattr(self, "fallbacks", {})),
        }

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "n": -1 if self.n is None else self.n,
            "r1": self.r1,
            "r2": self.r2,
            "calls": self.calls,
            "q1_step": self.q1_step,
            "q2_step": self.q2_step,
            "q2_seed": self.q2_seed,
            "q1_pending": self.q1_pending,
            "gen": self.gen.get_state(),
        }
        if self.q1 is not None:
            sd["q1"] = self.q1.detach().cpu().clone()
        if "p" in self.basis:
            sd["q2"] = self.basis["p"][:, self.r1 :].detach().cpu().clone()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = int(state["n"])
        self.n = None if n < 0 else n
        self.r1, self.r2 = int(state["r1"]), int(state["r2"])
        if self.n is not None:
            check_ranks(self.r1, self.r2, self.n, self.name)
        self.calls = int(state["calls"])
        self.q1_step, self.q2_step = int(state["q1_step"]), int(state["q2_step"])
        self.q1_pending = bool(state["q1_pending"])
        self.gen.set_state(state["gen"])
        self.q1, self.basis, self.q2_seed = state.get("q1"), {}, int(state.get("q2_seed", -1))
        if self.q1 is None:
            return
        if self.regenerates:
            if self.q2_seed < 0:
                raise ValueError(
                    f"PRAC site {self.name}: the state has no Q2 seed (saved with q2='store'?); "
                    f"load it into a codec configured with q2='store'"
                )
            self._set_q2(self.q2_seed)
        else:
            self._set_q2(state.get("q2"))


register_codec("prac", PracCodecConfig(), PracCodec)
register_codec("pac", PacCodecConfig(), PracCodec)
register_codec("rac", RacCodecConfig(), PracCodec)
