"""CPU offload: keep a saved tensor in host memory between forward and backward.

On CUDA the copy goes to pinned host memory with ``non_blocking=True`` on a side stream, so it
overlaps the forward kernels that follow. The side stream first waits for the current stream
(the tensor must be fully written), and ``record_stream`` keeps the caching allocator from reusing
the source until the copy is done. Decode makes the current stream wait for the copy's event and
copies back asynchronously (PyTorch's pinned allocator keeps the host block alive until then).
On CPU the "device" is the host: the codec makes a plain copy and saves nothing; it exists so
plans stay device-independent. Lossless for every dtype.

``nbytes`` is the cost on the tensor's own device (0 for a CUDA tensor, the full size on CPU);
``host_nbytes`` is the pinned memory used. PCIe bandwidth (~25 GB/s) is far below HBM, so offload
pays off only for tensors whose backward use is far enough away for the copy to hide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimact.codecs.base import Codec, CodecConfig, Packed, register_codec, storage_nbytes


@dataclass(frozen=True)
class OffloadConfig(CodecConfig):
    """``pin_memory``/``non_blocking`` apply to CUDA tensors only."""

    pin_memory: bool = True
    non_blocking: bool = True


class OffloadCodec(Codec):
    config: OffloadConfig

    def __init__(self, config: OffloadConfig) -> None:
        super().__init__(config)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def __getstate__(self) -> dict:
        """Copies and pickles make their own side streams (a CUDA stream does not pickle)."""
        return {**self.__dict__, "_streams": {}}

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def encode(self, x: torch.Tensor) -> Packed:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec 'offload' needs a tensor, got {type(x).__name__}")
        meta: dict = {}
        if x.is_cuda:
            c = self.config
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=c.pin_memory)
            side = self._side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                host.copy_(x, non_blocking=c.non_blocking)
                meta["event"] = torch.cuda.Event()
                meta["event"].record(side)
            x.record_stream(side)
        else:
            host = x.clone(memory_format=torch.contiguous_format)
        return Packed({"host": host}, tuple(x.shape), x.dtype, x.device, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        host = packed.tensors["host"]
        if packed.device.type == "cuda":
            torch.cuda.current_stream(packed.device).wait_event(packed.meta["event"])
            return host.to(packed.device, non_blocking=self.config.non_blocking)
        return host

    def nbytes(self, packed: Packed) -> int:
        """Bytes held on the tensor's own device: 0 when a CUDA tensor went to the host."""
        if packed.device.type == "cuda":
            return 0
        return storage_nbytes(list(packed.tensors.values()))

    def host_nbytes(self, packed: Packed) -> int:
        return storage_nbytes(list(packed.tensors.values()))


register_codec("offload", OffloadConfig(), OffloadCodec)
