"""Where the lossy traced codecs may run: refused on CUDA until verified there.

On an H200 with torch 2.11, llama-20m in bf16 under ``compiled-int8`` and ``compiled-int4`` gave one
q-projection weight a gradient cosine far below the codecs' error, where compiled ``none`` was exact
(BENCHMARKS.md, the GPU section). The cause, read in inductor's lowering
(``torch/_inductor/lowering.py``, ``sdpa_constraint``): on CPU an SDPA input is forced to the stride
order the graph was traced with; on CUDA an aligned input is passed with the strides inductor gave
its buffer. The decode of SDPA's q/k/v/output ([B, H, S, D] views of [B, S, H, D] storage) was a
view of an elementwise result, which inductor lays out contiguously, so CUDA's attention backward
ran on other strides than the ones its outputs' layout was planned for. Fixed in
``compiled/codec.py`` (:func:`~slimact.compiled.codec.memory_order`): the decode is a permutation of
a contiguous tensor, so its strides hold by construction (``tests/test_compiled_layout.py`` checks
the backward graph on CPU). Until a GPU run confirms the gradients (the ``gpu`` test there,
``benchmarks/gpu_check.sh``), a wrong gradient being the worst result slimact can give, a lossy
traced codec (INT8/6/4, PRAC) is refused on CUDA, the identity pair runs everywhere, and the
compiled planner leaves the lossy codecs out there, unless :data:`CUDA_OPT_IN` is ``"1"``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

from slimact.compiled.codec import CompiledCodec, resolve_codec

CUDA_OPT_IN = "SLIMACT_TRACED_CODECS_ON_CUDA"


class UnverifiedOnDevice(RuntimeError):
    """A lossy traced codec asked to run where its gradients are not verified (CUDA)."""


def usable_on(codec: CompiledCodec | str, device_type: str) -> bool:
    """Whether ``codec`` may run on ``device_type`` (module docstring)."""
    return (
        resolve_codec(codec).identity or device_type != "cuda" or os.environ.get(CUDA_OPT_IN) == "1"
    )


def check_device(codec: CompiledCodec | str, device_types: Iterable[str]) -> None:
    """Raise :class:`UnverifiedOnDevice` where ``codec`` may not run (:func:`usable_on`)."""
    for dev in sorted(set(device_types)):
        if not usable_on(codec, dev):
            raise UnverifiedOnDevice(
                f"traced codec {codec!r} is not verified on {dev}: on an H200 (torch 2.11) it "
                "gave one llama-20m parameter a wrong gradient; the likely cause is fixed and "
                "awaits a GPU run (BENCHMARKS.md, the GPU section). Use its eager codec (apply without "
                "compile=True), or compiled-none, compiled-recompute, invact or compiled-auto "
                f"(which then plans without lossy traced codecs) under compile; {CUDA_OPT_IN}=1 "
                "runs it anyway, to check it on a GPU (benchmarks/gpu_check.sh)"
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
