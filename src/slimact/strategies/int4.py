"""``int4``: Adacc's layer-specific compression of saved activations (adacc.txt §3.2).

Each config is a plan (``Int4Config.plan()``): no layers, one lazy rule
(``slimact.planner.plan.SiteRule``) that the plan runtime (``slimact.planner.apply``) applies.
The rule gives every saved tensor a *role* (``slimact.classify.site_role``), read from its site
name ``"<module>:<op>#k"`` and the tensor itself (so it works on any model, Hugging Face's
included), and each role a codec label that says exactly what is stored (the config's
``group_size``/``threshold``/``paper_scale`` included, e.g. ``int4-asym/g16``); the codec is
built on the role's first save, one instance per channel count:

* ``act``: inputs of ``linear``, norms (``layer_norm``, RMSNorm's ``pow``/``mul``), ``gelu`` /
  ``silu`` (and InvAct's float saves), SwiGLU's ``mul`` operands -> ``int4-outlier-g16`` (channels
  with Z-score > 3 exact, the rest INT4 per group of 16).
* ``qk``: fused SDPA's q and k -> kept exact. Its backward recomputes the probabilities from
  them against the exact saved logsumexp, so a logit error δ scales a probability by ``e^δ``,
  and δ grows as training sharpens attention: harmless at init (INT8 channel-wise gives a
  gradient cosine of 0.9996 on llama-20m), the main cause of ``int4``'s loss gap once trained
  (BENCHMARKS.md, the quality section).
* ``qkv``: SDPA's v, operands of an unfused attention ``matmul`` -> ``int8-channel`` (one scale
  per hidden channel); their errors stay linear in backward.
* ``scores``: ``softmax`` outputs and ``[.., S, S]`` matmul operands (unfused attention only;
  fused SDPA keeps no scores) -> ``int4-asym``.
* ``mask``: bool tensors (dropout masks), uint8 tensors holding only 0/1, the float dropout
  noise ``{0, 1/(1-p)}`` that CPU dropout (also inside SDPA's math path) saves, and the additive
  ``{0, -inf}`` attention mask CPU SDPA saves with a padded batch -> ``bits`` (lossless; the
  decode selects the value, ``0 * -inf`` would be NaN). Which SDPA save is q, k, v or the mask
  is read off the running call (``classify.sdpa_operand``): a mask shifts the save order.
* kept as is: SDPA's output and logsumexp, norm statistics (last dim 1), tensors below
  ``min_numel``, ``cross_entropy``'s saves, tensors that do not require grad (RoPE tables,
  constants), integer tensors (InvAct's packed uint8 masks included), and the 3-D ``bmm``
  operands of SDPA's unfused math path (taken on CPU when dropout is on).

Where we depart from the paper, and why (each measured as the minimum gradient cosine over
parameters, BENCHMARKS.md §3): fused SDPA's backward computes ``delta = rowsum(dO * O)`` from
its saved output ``O`` and subtracts it from ``dP``; at init the two nearly cancel, so any error
in ``O`` swamps ``dS``, whatever the grouping. The paper's unfused attention has no such term.
So SDPA's output and logsumexp stay exact and ``o_proj`` shares them. INT4 channel-wise Q/K/V
(the paper's choice) loses far more than INT8 channel-wise, so V is INT8; q and k stay exact,
since INT8 for them is what costs a trained model its gradients (the ``qk`` role above). Groups
of 16 instead of 128 for ``act`` buy gradient at 0.75 instead of 0.53 bytes per value.
Ablations: ``int4-plain`` (adacc.txt "w/o outlier": per-group INT4 for ``act``) and ``int8``
(INT8 everywhere, groups of 128).

``int4-paper`` is adacc.txt §3.2 as written: ``act`` (linear/norm/activation inputs, SDPA's
output included: it is ``o_proj``'s input, a Linear input the paper compresses) outlier-separated
INT4 (Z > 3 channels exact), Q/K/V channel-wise symmetric INT4, scores asymmetric INT4, masks as
bits, with the paper's divisors ``S = max|x| / 8`` (symmetric) and ``(max - min) / 16``
(asymmetric, ``O = (max + min) / 2``) and codes clipped to [-8, 7] (``paper_scale``: the group
maximum lands on +8 and is clipped to 7). Where it must still differ:

* group size: the paper gives none (Fig. 3b draws one scale per row); 128 values per scale;
* fused SDPA saves a logsumexp (one fp32 per query and head) where the paper's unfused attention
  saves the softmax probabilities it compresses (asymmetric INT4); the logsumexp is a statistic
  (1/head_dim of the output) and stays exact, like norm statistics (last dim 1);
* the paper compresses FP16 activations; ours are fp32 (or bf16 under autocast);
* project rules: a tensor the codec cannot represent faithfully (NaN/inf, squares overflowing
  float32, a row > 256x the median row, > 8x under the symmetric codecs: massive activations,
  ``codecs.quant.range_limit``) is stored exactly and reported per site; tensors below
  ``min_numel`` values, ``cross_entropy``'s saves (the loss head is outside the paper's layers),
  integer and no-grad tensors stay as they are.

Stochastic rounding: ``rounding="stochastic"`` (spec ``int4@sr`` or ``int4@rounding=stochastic``,
on any of these configs: ``int8@sr``, ``int4-plain@sr``...) gives every quantizing role's codec
unbiased rounding (``slimact.codecs.quant``; labels ``int4-outlier-g16/sr``,
``int8-channel/sr``); bit masks and exact roles are unchanged. The spec also takes
``group_size``, ``threshold`` and ``min_numel`` (``int4@sr,group_size=32``).

``int4-naive`` is the paper's *Quantization* baseline (§3.2 "Traditional compressions", Fig.
3b(i); §4.1 "compresses data directly from FP16 to INT4"): every floating-point activation
``int4-paper`` compresses, SDPA's output included, per-token symmetric INT4 (one scale per row of
the memory view, ``S = max|row| / 8``, no outlier separation, no layer-specific schemes:
``slimact.codecs.token``); masks as bits (lossless; a bool mask is not an FP16 activation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch.nn as nn

from slimact.classify import ROLES
from slimact.codecs.base import (
    CodecConfig,
    check_rounding,
    codec_config,
    codec_label,
    codec_names,
)
from slimact.codecs.token import TokenQuantConfig
from slimact.planner.assign import PlanAssign
from slimact.planner.plan import Plan, SiteRule
from slimact.planner.scope import restrict_rules
from slimact.registry import (
    AppliedChange,
    FilterFn,
    StrategyConfig,
    register_strategy,
)
from slimact.spec import AT, SR


def exact_label(cfg: CodecConfig) -> str:
    """``codec_label(cfg)``, checked to name ``cfg`` exactly (``codec_config`` reads it back)."""
    label = codec_label(cfg)
    if codec_config(label) != cfg:
        raise ValueError(f"{cfg} has no codec label that names it exactly (got {label!r})")
    return label


@dataclass(frozen=True)
class Int4Config(StrategyConfig):
    """Codec name per role (see the module docstring), plus shared quantization knobs."""

    act: str = "int4-outlier-g16"
    qk: str | None = None  # fused SDPA's q and k: kept exact (module docstring)
    qkv: str = "int8-channel"
    scores: str = "int4-asym"
    mask: str = "bits"
    group_size: int = 16
    threshold: float = 3.0
    min_numel: int = 1024
    paper_scale: bool = False  # adacc.txt's divisors 8/16 for every quantizing codec
    sdpa_out: bool = False  # SDPA's output as an ``act`` tensor (else kept exactly)
    rounding: str = "nearest"  # or "stochastic": every quantizing role's codec, unbiased

    # what a spec sets (``int4@sr,group_size=32``: ``slimact.spec``)
    spec_fields: ClassVar = {
        "rounding": str,
        "group_size": int,
        "threshold": float,
        "min_numel": int,
    }

    def __post_init__(self) -> None:
        for role in ROLES:
            name = getattr(self, role)
            if name is None and role == "qk":
                continue  # kept exact
            if name not in codec_names():
                raise ValueError(
                    f"Int4Config.{role}={name!r} is not a codec; valid: {', '.join(codec_names())}"
                )
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"Int4Config.group_size must be an int >= 2, got {self.group_size!r}")
        if not self.threshold > 0:
            raise ValueError(f"Int4Config.threshold must be > 0, got {self.threshold!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"Int4Config.min_numel must be an int >= 0, got {self.min_numel!r}")
        for flag in ("paper_scale", "sdpa_out"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Int4Config.{flag} must be a bool, got {getattr(self, flag)!r}")
        check_rounding(self, self.rounding)

    @property
    def name(self) -> str:
        """The registered name, ``@sr`` appended for stochastic rounding (``int8@sr``)."""
        if self.rounding == "nearest":
            return super().name
        return f"{dataclasses.replace(self, rounding='nearest').name}{AT}{SR}"

    def role_codec(self, role: str) -> CodecConfig:
        """The codec config of ``role``: its registered codec with this config's
        ``group_size``/``threshold``/``paper_scale``/``rounding`` where the codec has such a
        field (its ``channels``, if any, is set per tensor by the runtime)."""
        cfg = codec_config(getattr(self, role))
        names = {f.name for f in dataclasses.fields(cfg)}
        over = {
            "group_size": self.group_size,
            "threshold": self.threshold,
            "paper_scale": self.paper_scale,
            "rounding": self.rounding,
        }
        return dataclasses.replace(cfg, **{k: v for k, v in over.items() if k in names})

    def rule(self) -> SiteRule:
        kept = {role for role in ROLES if getattr(self, role) is None}
        codecs = tuple((r, exact_label(self.role_codec(r))) for r in ROLES if r not in kept)
        return SiteRule(codecs, self.min_numel, self.sdpa_out)

    def plan(self) -> Plan:
        """This config as a plan: one lazy rule, no layers (the module docstring)."""
        return Plan(rules=(self.rule(),), meta=(("strategy", self.name),))

    def describe(self) -> str:
        roles = ", ".join(f"{r}={getattr(self, r) or 'exact'}" for r in ROLES)
        return roles + (", stochastic rounding" if self.rounding == "stochastic" else "")


@dataclass(frozen=True)
class NaiveInt4Config(StrategyConfig):
    """adacc.txt's naive baseline: per-token INT4 for every float activation (module docstring)."""

    bits: int = 4
    paper_scale: bool = True
    min_numel: int = 1024

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"NaiveInt4Config.bits must be 4 or 8, got {self.bits!r}")
        if not isinstance(self.paper_scale, bool):
            raise ValueError(
                f"NaiveInt4Config.paper_scale must be a bool, got {self.paper_scale!r}"
            )
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(
                f"NaiveInt4Config.min_numel must be an int >= 0, got {self.min_numel!r}"
            )

    def rule(self) -> SiteRule:
        """Every float role per token (one scale per row of the tensor's hidden channels, SDPA's
        output included), masks as bits."""
        token = exact_label(TokenQuantConfig(self.bits, 0, self.paper_scale))
        codecs = (
            ("act", token),
            ("qk", token),
            ("qkv", token),
            ("scores", token),
            ("mask", "bits"),
        )
        sized = ("act", "qk", "qkv", "scores")
        return SiteRule(codecs, self.min_numel, sdpa_out=True, sized=sized)

    def plan(self) -> Plan:
        return Plan(rules=(self.rule(),), meta=(("strategy", self.name),))

    def describe(self) -> str:
        return f"per-token int{self.bits} for every float activation, masks=bits"


class Int4Assign(PlanAssign):
    """A config's rule as an ``assign(site, tensor)`` for a ``CodecPolicy`` of one's own
    (a study's outlier recorder); the strategies install the plan."""

    def __init__(
        self, config: Int4Config | NaiveInt4Config, allowed: set[str] | None = None
    ) -> None:
        plan = config.plan()
        if allowed is not None:  # the rule for the sites of those modules only
            plan = dataclasses.replace(plan, rules=(plan.rules[0].within(sorted(allowed)),))
        super().__init__(plan)


def int4_part(
    model: nn.Module, config: Int4Config | NaiveInt4Config, filter_fn: FilterFn | None
) -> tuple[Plan, list[AppliedChange]]:
    """The strategy as a plan: ``config.plan()``, its rule restricted to the modules
    ``filter_fn`` accepts (``restrict_rules``); its head row reads the strategy's name and
    roles (the runtime's codec-policy row follows it)."""
    plan = restrict_rules(config.plan(), model, filter_fn)
    return plan, [AppliedChange("", config.name, config.describe())]


register_strategy(
    "int4",
    Int4Config(),
    preset=int4_part,
    description="Adacc layer-specific INT4: outlier-separated act inputs, exact q/k, channel-wise INT8 v, bit masks",
    codec_policy=True,
    compiled_form="compiled-int4",  # traced INT4 (groups of 32, SDPA tensors INT8), no outliers
)
register_strategy(
    "int4-plain",
    Int4Config(act="int4"),
    preset=int4_part,
    description="Adacc w/o outlier separation: per-group INT4 for linear/norm/activation inputs",
    codec_policy=True,
)
register_strategy(
    "int4-paper",
    Int4Config(
        act="int4-outlier",
        qk="int4-channel",
        qkv="int4-channel",
        group_size=128,
        paper_scale=True,
        sdpa_out=True,
    ),
    preset=int4_part,
    description="adacc.txt §3.2 as written: divisors 8/16, INT4 Q/K/V, SDPA output compressed, groups of 128",
    codec_policy=True,
)
register_strategy(
    "int4-naive",
    NaiveInt4Config(),
    preset=int4_part,
    description="adacc.txt's naive baseline: per-token INT4 (S = max|row|/8) for every float activation",
    codec_policy=True,
)
register_strategy(
    "int8",
    Int4Config(act="int8", qkv="int8-channel", scores="int8-asym", group_size=128),
    preset=int4_part,
    description="layer-specific INT8 (same roles as int4: q/k exact)",
    codec_policy=True,
    compiled_form="compiled-int8",  # traced INT8, one scale per row
)
