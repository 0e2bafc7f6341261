"""Where the lossy traced codecs may run: refused on CUDA until verified there.

On an H200 with torch 2.11 (``benchmarks/results/gpu_check.md``), llama-20m in bf16 under
``compiled-int8`` and ``compiled-int4`` gave a worst-parameter gradient cosine of 0.157, where
compiled ``none`` gave 0.9998; llama-tiny's whole gradient matched (0.99998) on the same GPU,
and every CPU run matches. The cause is not found yet (a lead: the decoded tensors are
contiguous where the saved ones may not be, and CUDA's attention backward may read them with
the saved tensors' strides). A wrong gradient is the worst result slimact can give, so a lossy
traced codec (INT8/6/4, PRAC) is refused on CUDA, the identity pair runs everywhere, and the
compiled planner leaves the lossy codecs out there, unless :data:`CUDA_OPT_IN` is ``"1"``
(``benchmarks/gpu_check.sh`` sets it to check them on a GPU).
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
                "gave llama-20m a worst-parameter gradient cosine of 0.157 "
                "(benchmarks/results/gpu_check.md). Use its eager codec (apply without "
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
