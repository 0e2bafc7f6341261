"""Modules for inverted activations and norms (drop-ins; see ``slimact.ops.inv_act`` / ``inv_norm``).

``InvGELU(approximate=...)`` / ``InvSiLU()`` replace ``nn.GELU`` / ``nn.SiLU``; ``InvRMSNorm`` /
``InvLayerNorm`` replace slimact's (or Hugging Face LLaMA's) RMSNorm and ``nn.LayerNorm`` with the
same parameters and state_dict keys. The norms re-check that ``y / w`` is safe whenever the weight
changes (cached on the weight's version counter) and count the calls that fell back to saving x
in ``fallbacks`` (the reason is in ``fallback_reason``). A new version of weights that were
invertible (an optimizer step) is checked on the device and read at a later call, without a
sync (``NormInvertibility``; ``slimact.ops.inv_norm`` says what the backward does meanwhile).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from slimact.ops.deferred import DeferredChecks
from slimact.ops.inv_act import BF16_MODES, inv_act, inv_gelu, inv_silu, pick_variant
from slimact.ops.inv_norm import (
    DEFAULT_MAX_BIAS_RATIO,
    inv_layer_norm,
    inv_rms_norm,
    invertible,
    invertible_reason,
    invertible_stats,
)

__all__ = [
    "InvGELU",
    "InvLayerNorm",
    "InvRMSNorm",
    "InvSiLU",
    "NormInvertibility",
    "inv_act",
    "inv_gelu",
    "inv_layer_norm",
    "inv_rms_norm",
    "inv_silu",
]


class InvGELU(nn.Module):
    """``nn.GELU`` that saves its output + 1 bit per element for backward (``bf16``: see
    ``ops.inv_act.pick_variant``)."""

    def __init__(
        self,
        approximate: str = "none",
        mode: str = "newton",
        variant: str = "bitmask",
        backend: str = "auto",
        bf16: str = "floor",
    ) -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        if bf16 not in BF16_MODES:
            raise ValueError(f"bf16 must be one of {BF16_MODES}, got {bf16!r}")
        self.approximate, self.mode, self.variant = approximate, mode, variant
        self.backend, self.bf16 = backend, bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variant = pick_variant(x.dtype, self.variant, self.bf16)
        return inv_gelu(x, self.approximate, mode=self.mode, variant=variant, backend=self.backend)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, mode={self.mode!r}, variant={self.variant!r}"


class InvSiLU(nn.Module):
    """``nn.SiLU`` that saves its output + 1 bit per element for backward (``bf16``: see
    ``ops.inv_act.pick_variant``)."""

    def __init__(
        self, mode: str = "newton", variant: str = "bitmask", backend: str = "auto", bf16="floor"
    ):
        super().__init__()
        if bf16 not in BF16_MODES:
            raise ValueError(f"bf16 must be one of {BF16_MODES}, got {bf16!r}")
        self.mode, self.variant, self.backend, self.bf16 = mode, variant, backend, bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variant = pick_variant(x.dtype, self.variant, self.bf16)
        return inv_silu(x, mode=self.mode, variant=variant, backend=self.backend)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, variant={self.variant!r}"


class NormInvertibility:
    """Caches :func:`invertible` per (weight, bias) version; counts fallbacks.

    The first check of a weight (and any while it is not invertible, or after its storage or the
    dtype changed) reads :func:`invertible` on the host. A new version of an invertible weight
    (an optimizer step) is checked on the device instead (``invertible_stats``), its verdict
    copied to the host without waiting and read at a later call (``ops.deferred``); meanwhile the
    weight counts as invertible (the backward's guard: ``ops.inv_norm.guarded``)."""

    def __init__(self, max_bias_ratio: float = DEFAULT_MAX_BIAS_RATIO) -> None:
        self.max_bias_ratio = max_bias_ratio
        self._key = None
        self.reason: str | None = None
        self.fallbacks = 0
        self.last_dtype: torch.dtype | None = None
        self._checks = DeferredChecks()

    def __getstate__(self) -> dict:
        """A copy's weights live elsewhere: the cache key (data pointers) must not carry over."""
        return {**self.__dict__, "_key": None, "_checks": DeferredChecks()}

    def _late(self, dtype: torch.dtype, values: list[float]) -> None:
        reason = invertible_reason(values, dtype, self.max_bias_ratio)
        if reason is not None and self.reason is None:
            self.reason = reason

    def check(self, weight, bias, dtype) -> bool:
        self.last_dtype = dtype
        checks = self.__dict__.setdefault("_checks", DeferredChecks())
        checks.poll()  # verdicts on earlier versions, as far as the device has produced them
        key = tuple(
            (t.data_ptr(), t._version) if t is not None else None for t in (weight, bias)
        ) + (dtype,)
        if key != self._key:
            new_version = (
                self._key is not None
                and self.reason is None
                and weight is not None
                and [k[0] if k else None for k in self._key[:2]]
                == [k[0] if k else None for k in key[:2]]
                and self._key[2] == dtype
            )
            if new_version:
                checks.add(invertible_stats(weight, bias), functools.partial(self._late, dtype))
                checks.launch()
            else:
                self.reason = invertible(weight, bias, dtype, self.max_bias_ratio)
            self._key = key
        if self.reason is not None and torch.is_grad_enabled():
            self.fallbacks += 1
        return self.reason is None


class InvRMSNorm(nn.Module):
    """RMSNorm ``w ⊙ x·rsqrt(mean(x²)+eps)`` (fp32 statistics) that saves y + rstd."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.inv = NormInvertibility()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ok = self.inv.check(self.weight, None, x.dtype)
        # ok: skip the per-call check; not ok: check=True takes the saving-x fallback path
        return inv_rms_norm(x, self.weight, self.eps, check=not ok)

    @property
    def fallbacks(self) -> int:
        return self.inv.fallbacks


class InvLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that saves y + rstd (falls back to saving x when y/w is unsafe)."""

    def __init__(self, *args, max_bias_ratio: float = DEFAULT_MAX_BIAS_RATIO, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inv = NormInvertibility(max_bias_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ok = self.inv.check(self.weight, self.bias, x.dtype)
        return inv_layer_norm(
            x,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            max_bias_ratio=self.inv.max_bias_ratio,
            check=not ok,
        )

    @property
    def fallbacks(self) -> int:
        return self.inv.fallbacks
