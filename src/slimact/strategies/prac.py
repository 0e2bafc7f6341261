"""``prac`` / ``pac`` / ``rac``: store saved activations through principal + random subspaces.

prac.txt §5.1 and App. B, Table 6. A codec policy (``codecs/saving.py``) stores, per site,
Z = [XQ1, k·XQ2] and P = [Q1, Q2] instead of X (``codecs/prac.py`` has the math):

- inputs of linear layers (q/k/v, gate/up, down, lm_head; o_proj see below): r1 = r2 = ⌊0.3n⌋;
- saves inside norms (the norm's input x; ``fuse_norms`` swaps an RMSNorm for ``ops/rms_norm``,
  which saves (x, rstd) instead of op-by-op (x, x̂), so one tensor per norm is stored, as prac.txt's
  Table 3 counts; LayerNorm already saves only its input), activations (SiLU/GELU input, or an
  output-saving activation's output) and the SwiGLU gate product's two inputs: r1 = r2 = ⌊0.2n⌋.
  These ops differentiate at the reconstruction X̃: backward unpacks X̃ and runs the op's own
  derivative there (e.g. silu'(X̃), RMSNorm's Σ g·x̃), as the paper does. The theory (unbiased
  gradient) covers the linear layers; for nonlinear ones it is the paper's empirical choice.
- never: attention internals (SDPA's q, k, v, output, logsumexp; §5.1), per-row statistics
  (RMSNorm's rstd, LayerNorm's mean/rstd: feature size 1), non-float tensors (masks), embeddings,
  the loss. A site whose feature size is below ``min_features`` or whose ranks round to 0 keeps
  its tensor and is reported (``prac_report``), as is one whose storage another site keeps
  uncompressed (o_proj's input *is* SDPA's saved output, so compressing it would add a payload
  and free nothing: the storage, not the site, is the unit).

Worth it or keep: a site whose payload plus basis (tokens·(r1 + r2) + the basis, see
``codecs/prac.py``) would not be smaller than the tensor keeps it and ``prac_report`` says from how
many tokens per micro-batch it would pay off (``only_if_smaller``; decided at the site's first
save). Below ~n tokens that is every site: PRAC is a large-micro-batch technique.

Sharing: q/k/v save the same input and gate/up the same input; the policy encodes that storage
once, for its first saver (q_proj, gate_proj), and the others reuse the payload. So one subspace
state and one payload serve the group; ``prac_report`` lists each group's members.

Step clock and checkpoints: t counts training forwards (grad enabled) of the root module; every
codec updates Q1 when t % T1 == 0 and Q2 when t % T2 == 0 (Alg. 1; with grad accumulation each
micro-batch is a forward). Defaults T1 = 5 with the randomized range finder and T2 = 1 (why, and
how to get the paper's 500/500: ``codecs/prac.py``). The codecs' state (Q1, Q2, generator, clock) is exposed as
``slimact.state.state_of(model).stateful["prac"]`` with ``state_dict``/``load_state_dict``.

Composition: ``recompute`` wins inside checkpointed blocks (its saved-tensor hooks are innermost,
nothing is saved there), so ``prac+recompute`` compresses what is saved outside them (final norm,
lm_head input); checkpoint some blocks and PRAC the rest with ``filter_fn``. With ``invact``
(apply it first, ``invact+prac``: its probe forward would otherwise initialise the subspaces from
a dummy batch) the inverted norms and activations save their output y (float: PRAC-compressed,
one payload shared with the next op's save of y) plus rstd or a uint8 mask (kept: too small /
not float). y stands for the next layer's input (q/k/v or gate/up after a norm, c_proj's after
GPT-2's GELU) and the first saver of a storage fixes its ranks, so ``inv_*`` saves take the
*linear* ranks; for SwiGLU's SiLU, whose y feeds the gate product, that is conservative.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from typing import Any

import torch
import torch.nn as nn

from slimact.classify import classify_norm, is_nonlinearity, is_norm, parse_site, rms_eps
from slimact.codecs.prac import (
    PracCodec,
    resolve_rank,
)
from slimact.codecs.saving import CodecPolicy, dense_order, install_policy
from slimact.ops.rms_norm import rms_norm
from slimact.patching import override_forward, run_all
from slimact.registry import (
    AppliedChange,
    FilterFn,
    register_strategy,
)
from slimact.state import drop_stateful, peek, state_of
from slimact.strategies.prac_config import PacConfig, PracConfig, RacConfig

logger = logging.getLogger("slimact")

ATTENTION_OPS = ("scaled_dot_product_attention", "flash_attn", "attention")


class PracState:
    """All of one model's PRAC codecs, the step clock and the per-site decisions."""

    def __init__(self, model: nn.Module, config: PracConfig, filter_fn: FilterFn | None) -> None:
        self.config = config
        self.modules = dict(model.named_modules())
        self.filter_fn = filter_fn
        self.forwards = 0
        self.codecs: dict[str, PracCodec] = {}
        self.plan: dict[str, str | None] = {}  # site -> codec key, or None (kept)
        self.skipped: dict[str, str] = {}
        self.sharers: dict[str, list[str]] = {}

    def clock(self) -> int:
        return max(self.forwards - 1, 0)

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
        if op == "mul" and any(fnmatch.fnmatchcase(path, p) for p in self.config.gate_modules):
            return "gate"
        return None

    def skip(self, site: str, reason: str) -> None:
        if site not in self.skipped:
            self.skipped[site] = reason
            logger.info("prac: %s keeps its tensor: %s", site, reason)

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
        if role is None:
            return None
        path, _, _ = parse_site(site)
        cfg = self.config
        if any(fnmatch.fnmatchcase(site, p) or fnmatch.fnmatchcase(path, p) for p in cfg.keep):
            self.skip(site, "matches a keep pattern")
            return None
        if self.filter_fn is not None and not self.filter_fn(self.modules[path], path):
            self.skip(site, "filtered out by filter_fn")
            return None
        n = t.shape[-1]
        order = dense_order(t) if t.numel() else None
        if order is not None and order[-1] != t.dim() - 1 and t.shape[-1] > 1:
            # the policy encodes in memory order, whose innermost dim is not the features
            self.skip(site, f"feature dim of shape {tuple(t.shape)} is not innermost in memory")
            return None
        r1, r2 = cfg.ranks_for(role, site, path)
        a1, a2 = resolve_rank(r1, n), resolve_rank(r2, n)
        if n < cfg.min_features or a1 + a2 == 0:
            self.skip(
                site,
                f"feature size {n} too small (min_features={cfg.min_features}, "
                f"ranks ({r1}, {r2}) -> ({a1}, {a2}))",
            )
            return None
        if raw_owner is not None:
            self.skip(site, f"its storage is kept uncompressed by {raw_owner}")
            return None
        codec = PracCodec(cfg.codec_config(a1, a2, role), clock=self.clock, name=site, role=role)
        codec._setup(n)  # ranks vs n are checked here: a bad override raises now, naming the site
        tokens, itemsize = t.numel() // n, t.element_size()
        stored = tokens * (a1 + a2) * itemsize + codec.basis_nbytes()
        if cfg.only_if_smaller and stored >= t.numel() * itemsize:
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
            cfg = self.config.codec_config(int(sd["r1"]), int(sd["r2"]), role)
            codec = PracCodec(cfg, clock=self.clock, name=key, role=role)
            codec.load_state_dict(sd)
            self.codecs[key] = codec
            self.plan[key] = key
            self.sharers.setdefault(key, [key])

    def report(self) -> dict[str, Any]:
        return {
            "strategy": self.config.name,
            "forwards": self.forwards,
            "compressed": {
                k: {**c.metadata(), "role": c.role, "sites": self.sharers.get(k, [k])}
                for k, c in self.codecs.items()
            },
            "skipped": dict(self.skipped),
        }


class PracPolicy:
    """A ``sites`` policy: a ``CodecPolicy`` over ``PracState``, treating storages as the unit.

    Remembers which storages a site kept uncompressed during this forward, so a later saver of
    the same storage (o_proj after SDPA) is not compressed for nothing.
    """

    def __init__(self, state: PracState) -> None:
        self.state = state
        self.inner = CodecPolicy(self._assign)
        self._raw: dict[tuple[str, int], str] = {}
        self._assigned = False

    @staticmethod
    def _storage(t: torch.Tensor) -> tuple[str, int]:
        return str(t.device), t.untyped_storage().data_ptr()

    def reset(self) -> None:
        self.inner.reset()
        self._raw.clear()
        if torch.is_grad_enabled():
            self.state.forwards += 1

    def end(self) -> None:
        self.inner.end()

    def _assign(self, site: str, t: torch.Tensor) -> PracCodec | None:
        self._assigned = True
        owner = self._raw.get(self._storage(t))
        if owner is not None and self.state.plan.get(site) is not None:
            return None  # compressed in earlier forwards; this time another site keeps it raw
        return self.state.codec_for(site, t, owner)

    def __call__(self, site: str, t: torch.Tensor):
        self._assigned = False
        stored = self.inner(site, t)
        if stored is None:
            key = self._storage(t)
            owner = self._raw.setdefault(key, site)
            if owner != site and not self._assigned and site not in self.state.plan:
                self.state.codec_for(site, t, owner)  # records why it is kept (no codec built)
        elif not self._assigned:  # encode-once cache hit: another member of a sharing group
            members = self.state.sharers.setdefault(stored.codec.name, [stored.codec.name])
            if site not in members:
                members.append(site)
        return stored


def apply_prac(
    model: nn.Module, config: PracConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    registry = state_of(model).stateful
    if "prac" in registry:
        raise ValueError(
            f"a PRAC-family strategy ({registry['prac'].config.name}) is already applied to this "
            f"model; revert it before applying {config.name}"
        )
    state = PracState(model, config, filter_fn)
    change = install_policy(model, PracPolicy(state))
    registry["prac"] = state
    change.undo = functools.partial(
        run_all, change.undo, functools.partial(drop_stateful, model, "prac")
    )  # picklable, and deep copies undo the copy (see slimact.patching)
    change.action = config.name
    change.detail = (
        f"linear ranks {config.linear}, nonlinear {config.nonlinear} (of n), "
        f"T1={config.t1} T2={config.t2}, svd={config.svd}"
    )
    changes = [change]
    if config.fuse_norms:
        changes.extend(_fuse_rms_norms(model, config, filter_fn))
    for path, m in model.named_modules():  # what is known before the first forward
        role = "linear" if isinstance(m, nn.Linear) else "norm" if is_norm(m) else None
        if role is None:
            continue
        if filter_fn is not None and not filter_fn(m, path):
            changes.append(AppliedChange(path, config.name, "filtered out", skipped=True))
            continue
        n = (
            m.in_features
            if role == "linear"
            else (m.weight.shape[-1] if getattr(m, "weight", None) is not None else None)
        )
        if n is None:
            continue
        r1, r2 = config.ranks_for(role, f"{path}:?", path)
        a1, a2 = resolve_rank(r1, n), resolve_rank(r2, n)
        if n < config.min_features or a1 + a2 == 0:
            changes.append(
                AppliedChange(path, config.name, f"feature size {n} too small", skipped=True)
            )
        else:
            changes.append(AppliedChange(path, config.name, f"{role} n={n} r1={a1} r2={a2}"))
    return changes


def _fused_rms_forward(inner, module: nn.Module, eps: float | None, x: torch.Tensor):
    return rms_norm(x, module.weight, eps=eps)


def _fuse_rms_norms(
    model: nn.Module, config: PracConfig, filter_fn: FilterFn | None
) -> list[AppliedChange]:
    """RMSNorms save (x, rstd) instead of (x, x̂): one compressed tensor per norm (ops/rms_norm)."""
    changes = []
    for path, m in model.named_modules():
        if "forward" in m.__dict__ or (filter_fn is not None and not filter_fn(m, path)):
            continue  # already patched (e.g. by invact, applied first) or filtered out
        w = getattr(m, "weight", None)
        kind, _ = classify_norm(m, w.device if isinstance(w, torch.Tensor) else torch.device("cpu"))
        if kind != "rms":
            continue
        _, undo = override_forward(m, _fused_rms_forward, m, rms_eps(m))
        changes.append(
            AppliedChange(path, config.name, "RMSNorm saves (x, rstd), not (x, x̂)", undo=undo)
        )
    return changes


def prac_state(model: nn.Module) -> PracState:
    st = peek(model)
    state = st.stateful.get("prac") if st is not None else None
    if state is None:
        raise ValueError("no PRAC-family strategy (prac, pac, rac) is applied to this model")
    return state


def prac_report(model: nn.Module) -> dict[str, Any]:
    """Per group: ranks, k, updates, member sites; per kept site: why. After one forward."""
    return prac_state(model).report()


def prac_state_dict(model: nn.Module) -> dict[str, Any]:
    return prac_state(model).state_dict()


def load_prac_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    prac_state(model).load_state_dict(state)


_DESC = "prac.txt: {} subspace compression of linear/norm/activation inputs ({})"
register_strategy(
    "prac",
    PracConfig(),
    apply_prac,
    _DESC.format("principal+random", "r1=r2=0.3n linear, 0.2n nonlinear"),
    codec_policy=True,
    compiled_form="compiled-prac",  # traced PRAC: the basis from every step's X (no hook state)
)
register_strategy(
    "pac",
    PacConfig(),
    apply_prac,
    _DESC.format("principal-only (ablation)", "r1=0.6n linear, 0.4n nonlinear"),
    codec_policy=True,
)
register_strategy(
    "rac",
    RacConfig(),
    apply_prac,
    _DESC.format("random-only (ablation)", "r2=0.6n linear, 0.4n nonlinear"),
    codec_policy=True,
)

__all__ = [
    "PacConfig",
    "PracConfig",
    "PracPolicy",
    "PracState",
    "RacConfig",
    "apply_prac",
    "load_prac_state_dict",
    "prac_report",
    "prac_state",
    "prac_state_dict",
]
