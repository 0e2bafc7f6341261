"""Strategies of compiled blocks: ``compiled-none``, ``compiled-int8``, ``compiled-int6``,
``compiled-int4``, ``compiled-int4-outlier``, ``compiled-prac``, ``compiled-recompute``, each
``@<budget>`` for compile's region budget (``compiled-int8@0.25``); the quantizing ones also take ``sr`` (or
``rounding=stochastic``) for stochastic rounding (``compiled-int4@sr``, ``compiled-int8@0.25,sr``;
``int4@sr`` under ``compile=True``), their codec then ``int4-sr`` (``compiled.codec``).

``compiled-offload`` (``offload`` under ``compile=True``): every block keeps only its input, in
pinned host memory (``slimact.compiled.offload``; CUDA only, refused on a CPU model).

One :class:`~slimact.compiled.blocks.BlockChoice` for every block: each of these strategies is
a uniform ``CompiledPlan``, which ``slimact.strategies.compiled_presets`` registers and installs
(``compiled_plan_of``); ``compiled-auto@<budget>`` (``slimact.planner.compiled``) picks one per
block instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from slimact.compiled.blocks import BlockChoice
from slimact.compiled.codec import RENAMED, SR_SUFFIX, canonical_codec, resolve_codec
from slimact.registry import StrategyConfig
from slimact.spec import AT, COMPILED_PREFIX, SR

PREFIX = COMPILED_PREFIX
# the strategies named after an earlier codec name: old -> the name in PRESETS (read in specs)
RENAMED_STRATEGIES = {PREFIX + old: PREFIX + new for old, new in RENAMED.items()}


@dataclass(frozen=True)
class CompiledCodecConfig(StrategyConfig):
    """``codec``: a traced codec name (``slimact.compiled.CODECS``); ``budget``: compile's
    activation-memory budget for each block's region (1.0: compile's default partition)."""

    codec: str = "int8"
    budget: float = 1.0
    offload: bool = False

    # a spec's settings (``slimact.spec``): compile's region budget, bare, and ``sr``
    spec_fields: ClassVar = {"region": float, "rounding": str}

    def __post_init__(self) -> None:
        resolve_codec(self.codec)
        object.__setattr__(self, "codec", canonical_codec(self.codec))  # an earlier name
        self.choice  # noqa: B018 - validates the budget

    @property
    def is_codec_policy(self) -> bool:
        """A traced codec decides how each saved tensor of the blocks is stored (the registry's
        ``codec_policy`` fact)."""
        return self.codec != "none"

    @property
    def name(self) -> str:
        """The spec that reads this config back (``compiled-int8@0.25,sr``): the registered
        name of its codec (``compiled-recompute`` for no codec at budget 0), then the budget
        where it is not that name's default, and ``sr`` for stochastic rounding."""
        if self.offload:
            return f"{PREFIX}offload"
        base = self.codec.removesuffix(SR_SUFFIX)
        recompute = base == "none" and self.budget == 0.0
        args = [] if recompute or self.budget == 1.0 else [f"{self.budget:g}"]
        if base != self.codec:
            args.append(SR)
        head = f"{PREFIX}recompute" if recompute else f"{PREFIX}{base}"
        return f"{head}{AT}{','.join(args)}" if args else head

    @property
    def merges_with_recompute(self) -> bool:
        """``<this>+compiled-recompute`` is this codec at region budget 0 (``int8+recompute``
        under compile is ``compiled-int8@0``): an INT codec or none at compile's default
        budget; PRAC and offload do not take a budget."""
        return not self.offload and self.budget == 1.0 and resolve_codec(self.codec).prac is None

    @property
    def choice(self) -> BlockChoice:
        return BlockChoice(self.budget, self.codec, self.offload)

    @classmethod
    def from_settings(cls, default: CompiledCodecConfig, values: dict) -> CompiledCodecConfig:
        """``default`` (a registered one) with a spec's settings (``slimact.spec``):
        ``compiled-int8@0.25`` -> codec ``int8`` under region budget 0.25;
        ``compiled-int4@sr`` (or ``@0.25,sr``) -> codec ``int4-sr``."""
        if default.offload:
            raise ValueError(
                f"{default.name!r} takes no settings, got {values} (every block keeps only its "
                "input, in host memory); for a mix of offload and other choices use "
                "'compiled-auto@<budget>,host_budget=<bytes>'"
            )
        codec = default.codec.removesuffix(SR_SUFFIX)
        rounding = values.get("rounding", "nearest")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(
                f"{default.name}: rounding must be one of nearest, stochastic (or '{SR}'), got "
                f"{rounding!r}"
            )
        codec += SR_SUFFIX if rounding == "stochastic" else ""
        return cls(codec, values.get("region", default.budget))


# the fixed compiled strategies: name -> (its config, its description); registered by
# ``slimact.strategies.compiled_presets``, each a codec policy where its config says so
PRESETS: dict[str, tuple[CompiledCodecConfig, str]] = {
    "compiled-none": (
        CompiledCodecConfig("none"),
        "torch.compile per block with an identity saved-tensor hook pair inlined (no compression)",
    ),
    "compiled-int8": (
        CompiledCodecConfig("int8"),
        "torch.compile per block, per-row INT8 pack/unpack inlined into the compiled graphs",
    ),
    "compiled-int6": (
        CompiledCodecConfig("int6"),
        "torch.compile per block, per-row INT6 (four codes in three bytes) inlined; SDPA's v and "
        "output INT8 per row, its q/k exact",
    ),
    "compiled-int4": (
        CompiledCodecConfig("int4"),
        "torch.compile per block, INT4 (groups of 32) inlined; SDPA's v and output INT8 per row, "
        "its q/k exact",
    ),
    "compiled-int4-outlier": (
        CompiledCodecConfig("int4-outlier"),
        "compiled-int4 with the 1/128 of channels of largest absolute sum stored exactly "
        "(adacc's outlier separation, a static count)",
    ),
    "compiled-prac": (
        CompiledCodecConfig("prac"),
        "torch.compile per block, PRAC (principal + random subspace, prac.txt) inlined: linear "
        "inputs at r1 = r2 = 0.3n, other saves 0.2n, attention exact; the basis from each "
        "step's X",
    ),
    "compiled-recompute": (
        CompiledCodecConfig("none", 0.0),
        "torch.compile per block with region budget 0: compile recomputes all but block inputs",
    ),
    "compiled-offload": (
        CompiledCodecConfig("none", 0.0, offload=True),
        "torch.compile per block, each block's input offloaded to pinned host memory by an "
        "eager wrapper, the rest recomputed in backward (CUDA only)",
    ),
}
