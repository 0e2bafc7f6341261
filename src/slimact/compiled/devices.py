"""Where the traced codecs may run: every one on CPU; on CUDA, the ones verified there.

A lossy traced codec once gave one llama-20m parameter a wrong gradient on an H200 (torch 2.11)
under ``compiled-int8`` and ``compiled-int4``, where compiled ``none`` was exact (BENCHMARKS.md,
the GPU section). The cause, read in inductor's lowering (``torch/_inductor/lowering.py``,
``sdpa_constraint``): on CPU an SDPA input is forced to the stride order the graph was traced
with; on CUDA an aligned input is passed with the strides inductor gave its buffer. The decode of
SDPA's q/k/v/output ([B, H, S, D] views of [B, S, H, D] storage) was a view of an elementwise
result, which inductor lays out contiguously, so CUDA's attention backward ran on other strides
than the ones its outputs' layout was planned for. Fixed in ``compiled/codec.py``
(:func:`~slimact.compiled.codec.memory_order`): the decode is a permutation of a contiguous
tensor, so its strides hold by construction (``tests/test_compiled_layout.py`` checks the backward
graph on CPU, and every parameter's gradient on CUDA).

Verified on CUDA since (BENCHMARKS.md, the GPU section): the INT codecs with nearest rounding
(``int8``, ``int6``, ``int4``, ``int4-outlier``, and INT8 with q/k coded). They run there like the
identity pair. Not verified there, a wrong gradient being the worst result slimact can give:
stochastic rounding (``-sr``) and ``prac``, whose per-step gradients are noisier by design, so the
per-parameter bar did not tell a layout bug from their variance. They are refused on CUDA, and the
compiled planner leaves them out there, unless :data:`CUDA_OPT_IN` is ``"1"``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

from slimact.compiled.codec import CompiledCodec, resolve_codec

CUDA_OPT_IN = "SLIMACT_TRACED_CODECS_ON_CUDA"


class UnverifiedOnDevice(RuntimeError):
    """A lossy traced codec asked to run where its gradients are not verified (CUDA)."""


def verified_on_cuda(codec: CompiledCodec | str) -> bool:
    """Whether ``codec``'s gradients were verified on CUDA: the identity pair, and the INT
    codecs with nearest rounding (module docstring)."""
    c = resolve_codec(codec)
    return c.identity or (c.prac is None and c.rounding == "nearest")


def usable_on(codec: CompiledCodec | str, device_type: str) -> bool:
    """Whether ``codec`` may run on ``device_type`` (module docstring)."""
    return device_type != "cuda" or verified_on_cuda(codec) or os.environ.get(CUDA_OPT_IN) == "1"


def check_device(codec: CompiledCodec | str, device_types: Iterable[str]) -> None:
    """Raise :class:`UnverifiedOnDevice` where ``codec`` may not run (:func:`usable_on`)."""
    for dev in sorted(set(device_types)):
        if not usable_on(codec, dev):
            raise UnverifiedOnDevice(
                f"traced codec {codec!r} is not verified on {dev}: its gradients were not "
                "checked there (BENCHMARKS.md, the GPU section; verified: the INT codecs with "
                "nearest rounding, int8, int6, int4 and int4-outlier). Use one of those, its eager "
                "codec (apply without compile=True), or compiled-auto (which then plans without "
                f"it) under compile; {CUDA_OPT_IN}=1 runs it anyway, to check it on a GPU "
                "(benchmarks/gpu_check.sh)"
            )


def usable_codecs(codecs: Iterable[str], device_type: str) -> tuple[str, ...]:
    """``codecs`` less those that may not run on ``device_type``, with a warning naming them."""
    codecs = tuple(codecs)
    kept = tuple(c for c in codecs if usable_on(c, device_type))
    if len(kept) < len(codecs):
        dropped = ", ".join(c for c in codecs if c not in kept)
        warnings.warn(
            f"traced codec(s) {dropped} are not verified on {device_type} and are left out of "
            f"the plan ({CUDA_OPT_IN}=1 admits them)",
            UserWarning,
            stacklevel=2,
        )
    return kept
