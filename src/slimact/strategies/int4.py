"""``int4``: Adacc's layer-specific compression of saved activations (adacc.txt §3.2).

A codec policy (``codecs/saving.py``) gives every saved tensor a *role*, read from its site name
``"<module>:<op>#k"`` and the tensor itself (so it works on any model, Hugging Face's included):

* ``act``: inputs of ``linear``, norms (``layer_norm``, RMSNorm's ``pow``/``mul``), ``gelu`` /
  ``silu`` (and InvAct's float saves), SwiGLU's ``mul`` operands -> ``int4-outlier-g16`` (channels
  with Z-score > 3 exact, the rest INT4 per group of 16).
* ``qkv``: the first three saves of ``scaled_dot_product_attention`` (q, k, v), operands of an
  unfused attention ``matmul`` -> ``int8-channel`` (one scale per hidden channel).
* ``scores``: ``softmax`` outputs and ``[.., S, S]`` matmul operands (unfused attention only;
  fused SDPA keeps no scores) -> ``int4-asym``.
* ``mask``: bool tensors (dropout masks), uint8 tensors holding only 0/1, and the float dropout
  noise ``{0, 1/(1-p)}`` that CPU dropout (also inside SDPA's math path) saves -> ``bits``.
* kept as is: SDPA's output and logsumexp, norm statistics (last dim 1), tensors below
  ``min_numel``, ``cross_entropy``'s saves, tensors that do not require grad (RoPE tables,
  constants), integer tensors (InvAct's packed uint8 masks included), and the 3-D ``bmm``
  operands of SDPA's unfused math path (taken on CPU when dropout is on).

Where we depart from the paper, and why (measured on llama-20m at init, batch 4 x 256, minimum
gradient cosine over parameters; benchmarks/results/quant.md): fused SDPA's backward computes
``delta = rowsum(dO * O)`` from its saved output ``O`` and subtracts it from ``dP``; at init the
two nearly cancel, so any error in ``O`` swamps ``dS``: quantizing ``O`` (shared with
``o_proj``'s input) gives cosine 0.86-0.88, whatever the grouping. The paper's unfused attention
has no such term. So SDPA's output and logsumexp stay exact and ``o_proj`` shares them. INT4
channel-wise Q/K/V (the paper's choice) gives 0.956, INT8 channel-wise 0.9996, so the default is
INT8 for Q/K/V. Groups of 16 instead of 128 for ``act`` lift the cosine from 0.982 to 0.991 at
0.75 instead of 0.53 bytes per value. Ablations: ``int4-plain`` (adacc.txt "w/o outlier":
per-group INT4 for ``act``) and ``int8`` (INT8 everywhere, groups of 128).

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
  float32, a row > 256x the median row) is stored exactly and reported per site; tensors below
  ``min_numel`` values, ``cross_entropy``'s saves (the loss head is outside the paper's layers),
  integer and no-grad tensors stay as they are.

``int4-naive`` is the paper's *Quantization* baseline (§3.2 "Traditional compressions", Fig.
3b(i); §4.1 "compresses data directly from FP16 to INT4"): every floating-point activation
``int4-paper`` compresses, SDPA's output included, per-token symmetric INT4 (one scale per row of
the memory view, ``S = max|row| / 8``, no outlier separation, no layer-specific schemes:
``slimact.codecs.token``); masks as bits (lossless; a bool mask is not an FP16 activation).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from slimact.classify import ROLES, hidden_channels, parse_site, role_of
from slimact.codecs.base import Codec, CodecConfig, codec_names, get_codec
from slimact.codecs.saving import CodecPolicy, install_policy
from slimact.codecs.token import TokenQuantConfig
from slimact.patching import run_all
from slimact.registry import AppliedChange, FilterFn, StrategyConfig, register_strategy
from slimact.state import reset_field, state_of


@dataclass(frozen=True)
class Int4Config(StrategyConfig):
    """Codec name per role (see the module docstring), plus shared quantization knobs."""

    act: str = "int4-outlier-g16"
    qkv: str = "int8-channel"
    scores: str = "int4-asym"
    mask: str = "bits"
    group_size: int = 16
    threshold: float = 3.0
    min_numel: int = 1024
    paper_scale: bool = False  # adacc.txt's divisors 8/16 for every quantizing codec
    sdpa_out: bool = False  # SDPA's output as an ``act`` tensor (else kept exactly)

    def __post_init__(self) -> None:
        for role in ROLES:
            name = getattr(self, role)
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


def is_sdpa_output(site: str, t: torch.Tensor) -> bool:
    """SDPA's saved output: a 4-D save after q, k, v (the logsumexp is 3-D or ends in 1)."""
    _, op, k = parse_site(site)
    return op == "scaled_dot_product_attention" and k >= 3 and t.dim() == 4 and t.shape[-1] > 1


def site_role(site: str, t: torch.Tensor, min_numel: int, sdpa_out: bool) -> str | None:
    """``role_of``, with SDPA's output an ``act`` tensor when ``sdpa_out`` (adacc.txt)."""
    role = role_of(site, t, min_numel)
    if role is None and sdpa_out and t.is_floating_point() and t.requires_grad:
        if t.numel() >= min_numel and is_sdpa_output(site, t):
            return "act"
    return role


class Int4Assign:
    """``assign(site, tensor)`` for ``CodecPolicy``: role -> codec, built once per channel count."""

    def __init__(self, config: Int4Config, allowed: set[str] | None) -> None:
        self.config = config
        self.allowed = allowed
        self._codecs: dict[tuple[str, int], Codec] = {}
        self.counts: dict[str, int] = {}

    def _codec(self, role: str, channels: int) -> Codec:
        key = (role, channels)
        if key not in self._codecs:
            cfg: CodecConfig = get_codec(getattr(self.config, role)).config
            fields = {f.name for f in dataclasses.fields(cfg)}
            over = {
                "group_size": self.config.group_size,
                "threshold": self.config.threshold,
                "paper_scale": self.config.paper_scale,
            }
            if "channels" in fields:
                over["channels"] = channels
            cfg = dataclasses.replace(cfg, **{k: v for k, v in over.items() if k in fields})
            self._codecs[key] = cfg.build()
        return self._codecs[key]

    def __call__(self, site: str, t: torch.Tensor) -> Codec | None:
        if self.allowed is not None and site.rpartition(":")[0] not in self.allowed:
            return None
        role = site_role(site, t, self.config.min_numel, self.config.sdpa_out)
        if role is None:
            return None
        self.counts[role] = self.counts.get(role, 0) + 1
        channels = hidden_channels(t) if role in ("act", "qkv") else 0
        return self._codec(role, channels)


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


class NaiveAssign:
    """``assign(site, tensor)``: per-token codec (one per row width) for every float role."""

    def __init__(self, config: NaiveInt4Config, allowed: set[str] | None) -> None:
        self.config = config
        self.allowed = allowed
        self._codecs: dict[int, Codec] = {}
        self._bits = get_codec("bits")
        self.counts: dict[str, int] = {}

    def __call__(self, site: str, t: torch.Tensor) -> Codec | None:
        if self.allowed is not None and site.rpartition(":")[0] not in self.allowed:
            return None
        role = site_role(site, t, self.config.min_numel, True)
        if role is None:
            return None
        self.counts[role] = self.counts.get(role, 0) + 1
        if role == "mask":
            return self._bits
        width = hidden_channels(t)
        if width not in self._codecs:
            cfg = TokenQuantConfig(self.config.bits, width, self.config.paper_scale)
            self._codecs[width] = cfg.build()
        return self._codecs[width]


def apply_int4(
    model: nn.Module, config: Int4Config | NaiveInt4Config, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    allowed = None
    if filter_fn is not None:
        allowed = {p for p, m in model.named_modules() if filter_fn(m, p)}
    if isinstance(config, NaiveInt4Config):
        assign: Int4Assign | NaiveAssign = NaiveAssign(config, allowed)
        detail = f"per-token int{config.bits} for every float activation, masks=bits"
    else:
        assign = Int4Assign(config, allowed)
        detail = ", ".join(f"{r}={getattr(config, r)}" for r in ROLES)
    change = install_policy(model, CodecPolicy(assign))
    change.action = config.name
    change.detail = detail
    state_of(model).int4_assign = assign
    change.undo = functools.partial(
        run_all, change.undo, functools.partial(reset_field, model, "int4_assign")
    )  # picklable, and deep copies undo the copy (see slimact.patching)
    return [change]


register_strategy(
    "int4",
    Int4Config(),
    apply_int4,
    "Adacc layer-specific INT4: outlier-separated act inputs, channel-wise Q/K/V, bit masks",
)
register_strategy(
    "int4-plain",
    Int4Config(act="int4"),
    apply_int4,
    "Adacc w/o outlier separation: per-group INT4 for linear/norm/activation inputs",
)
register_strategy(
    "int4-paper",
    Int4Config(
        act="int4-outlier", qkv="int4-channel", group_size=128, paper_scale=True, sdpa_out=True
    ),
    apply_int4,
    "adacc.txt §3.2 as written: divisors 8/16, INT4 Q/K/V, SDPA output compressed, groups of 128",
)
register_strategy(
    "int4-naive",
    NaiveInt4Config(),
    apply_int4,
    "adacc.txt's naive baseline: per-token INT4 (S = max|row|/8) for every float activation",
    codec_policy=True,
)
register_strategy(
    "int8",
    Int4Config(act="int8", qkv="int8-channel", scores="int8-asym", group_size=128),
    apply_int4,
    "layer-specific INT8 (same roles as int4)",
)
