"""``prac`` / ``pac`` / ``rac``: store saved activations through principal + random subspaces.

prac.txt §5.1 and App. B, Table 6. A plan on the plan runtime (``presets.prac_plan``: one lazy
``SiteRule(roles="prac")``, for the modules a ``filter_fn`` accepts, and the fused norms;
``planner/prac_sites.py`` decides each site and holds the codecs) stores, per site,
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
(one plan in either order, ``invact+prac``; in two calls, invact first: after ``prac`` its norms
are fused ones, which invact does not invert) the inverted norms and activations save their
output y (float: PRAC-compressed, one payload shared with the next op's save of y) plus rstd or
a uint8 mask (kept: too small / not float). y stands for the next layer's input (q/k/v or
gate/up after a norm, c_proj's after GPT-2's GELU) and the first saver of a storage fixes its
ranks, so ``inv_*`` saves take the *linear* ranks; for SwiGLU's SiLU, whose y feeds the gate
product, that is conservative.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from slimact.planner.prac_sites import PracPolicy, PracState
from slimact.registry import register_strategy
from slimact.state import peek
from slimact.strategies.prac_config import PacConfig, PracConfig, RacConfig
from slimact.strategies.presets import prac_part


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
    preset=prac_part,
    description=_DESC.format("principal+random", "r1=r2=0.3n linear, 0.2n nonlinear"),
    codec_policy=True,
    compiled_form="compiled-prac",  # traced PRAC: the basis from every step's X (no hook state)
)
register_strategy(
    "pac",
    PacConfig(),
    preset=prac_part,
    description=_DESC.format("principal-only (ablation)", "r1=0.6n linear, 0.4n nonlinear"),
    codec_policy=True,
)
register_strategy(
    "rac",
    RacConfig(),
    preset=prac_part,
    description=_DESC.format("random-only (ablation)", "r2=0.6n linear, 0.4n nonlinear"),
    codec_policy=True,
)

__all__ = [
    "PacConfig",
    "PracConfig",
    "PracPolicy",
    "PracState",
    "RacConfig",
    "load_prac_state_dict",
    "prac_report",
    "prac_state",
    "prac_state_dict",
]
