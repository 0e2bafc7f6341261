"""Which code path slimact's ops take for a tensor: the CUDA one, or the CPU one, decided here.

The ops and codecs choose per tensor. On CUDA, ``backend="auto"`` runs the Triton kernels
(``ops.quant``, ``ops.inv_act``, the chunked loss head) and the refs that have no kernel run
eagerly (``ops.compiled_ref.run``: inductor only inside ``compiled_refs_on_cuda``); on a CPU
the refs run compiled by inductor. :func:`takes_cuda_path` is that choice, and every such
dispatch asks it instead of ``t.is_cuda``.

:func:`cuda_path` (or ``SLIMACT_CUDA_PATH=1`` in the environment, read at import) makes CPU
tensors take the CUDA path: what a GPU step runs, op for op and kernel for kernel, measured on
a CPU (``slimact.bench.launches``: the launch count of a training step). The Triton kernels
then run under Triton's interpreter, which reads ``TRITON_INTERPRET=1`` when triton is first
imported; entering without it is an error (the variable without it is ignored, with a
warning). The results are the CUDA path's (each kernel matches its ``*_ref`` bit for bit, or
within its documented error), only slow: the interpreter runs a kernel in NumPy.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV = "SLIMACT_CUDA_PATH"
FUSED_ENV = "SLIMACT_FUSED_CODECS"


def _env_forced() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def interpreter_on() -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


if _env_forced() and not interpreter_on():
    warnings.warn(
        f"{ENV}=1 is ignored: the CUDA path on a CPU runs Triton's interpreter, which needs "
        "TRITON_INTERPRET=1 as well",
        RuntimeWarning,
        stacklevel=1,
    )
# the last entry says whether CPU tensors take the CUDA path (module docstring)
_FORCED: list[bool] = [_env_forced() and interpreter_on()]


# whether the INT codecs take their fused kernels on the Triton path (:func:`fused_codecs`)
_FUSED_SETTING = os.environ.get(FUSED_ENV, "")


def fused_codecs() -> bool:
    """Whether the INT codecs' deferred encodes and the outlier codec's decode take their fused
    Triton kernels on the Triton path (``ops.quant_stats``, ``ops.outlier_triton``).
    ``SLIMACT_FUSED_CODECS=1`` / ``0`` in the environment (read at import) decides; unset, they
    run in Triton's interpreter (the CPU tests, the launch count) and not on a real device, until
    ``benchmarks/gpu_check.sh``'s kernel step has checked their atomics and the column kernel's
    ticket on one (the interpreter runs programs one after another and cannot show a race).
    Off: the quantize kernel alone and the statistics as eager ops."""
    if _FUSED_SETTING:
        return _FUSED_SETTING != "0"
    return interpreter_on()


@contextmanager
def cuda_path(enabled: bool = True) -> Iterator[None]:
    """Inside, CPU tensors take the CUDA path (module docstring); ``enabled=False``: the CPU
    path. Nests, and restores the previous choice on exit."""
    if enabled and not interpreter_on():
        raise RuntimeError(
            "slimact.ops.device_path.cuda_path runs Triton kernels on CPU tensors: set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
    _FORCED.append(bool(enabled))
    try:
        yield
    finally:
        _FORCED.pop()


def forced() -> bool:
    """Whether CPU tensors take the CUDA path now."""
    return _FORCED[-1]


def takes_cuda_path(t: torch.Tensor) -> bool:
    """Whether ``t``'s ops take the CUDA path: a CUDA tensor, or a CPU one inside
    :func:`cuda_path`."""
    return t.is_cuda or (_FORCED[-1] and t.device.type == "cpu")
