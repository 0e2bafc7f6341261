"""Offload: keep a saved tensor in pinned host memory between forward and backward (CUDA only).

The action ``offload`` (``slimact.actions``) trades link time for device memory, losslessly.
Per device, one :class:`OffloadEngine` (shared by every offload codec on that device) owns

* a **pool of pinned host buffers** keyed by (shape, dtype), allocated on first need and reused
  from then on: pinning memory on the fly (``pin_memory=True`` per call) is a host allocation
  that synchronizes, so a training step after the first allocates none (``HostPool.allocated``);
  a buffer goes back to the pool when the autograd graph holding its tensor is freed, and its
  next writer waits (on the device) for the event of its last read. Each new shape adds
  buffers (a run whose sequence length varies keeps one set per length it met);
  ``HostPool.clear`` drops the idle ones;
* a **device-to-host stream**: a save waits (``wait_stream``) for the kernel that made the
  tensor, copies it into its buffer ``non_blocking`` and records an event; ``record_stream``
  keeps the caching allocator from reusing the tensor's memory before that copy ran. The copy
  overlaps the forward kernels that follow;
* a **host-to-device stream**: each saved tensor remembers the root call and the repeated block
  that were running when it was saved (``sites.call_index``, ``sites.current_block``: its
  *group*; another forward's tensors are never prefetched). The first unpack of
  a group's tensor in backward starts the copies of its group and of the group saved just
  before it in forward (one block ahead), which then overlap this block's recomputation and
  backward; the unpack itself makes the current stream wait for its own copy's event.

Only events order the streams: no ``synchronize`` and no host read on the step's path. The
trade-off is bandwidth: a copy moves ``bytes / link bandwidth`` seconds each way, hidden while
the work it overlaps takes longer, a stall otherwise (what the planner charges:
``slimact.planner.offload``).

On a CPU the tensor is in host memory already, so offload would only copy it: the codec refuses
a CPU tensor with a ``ValueError`` saying so. Tests run the same code path on CPU with the
streams stubbed (:func:`using_streams`, a stand-in for the CUDA stream/event calls).

The payload keeps no tensor on the device (``Packed.tensors`` is empty): ``nbytes`` is 0, and
``host_tensors`` names the pinned buffer, which the meter counts as host bytes.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from slimact import sites
from slimact.codecs.base import (
    Codec,
    CodecConfig,
    Deferred,
    Packed,
    exact_value,
    get_codec,
    register_codec,
    storage_nbytes,
)
from slimact.utils import model_device

REFUSED_ON_CPU = (
    "offload moves saved tensors from a CUDA device to pinned host memory; a tensor on {dev} is "
    "in host memory already, so offload would only copy it (use keep or recompute there)"
)


class CudaStreams:
    """The stream/event calls the engine makes, on CUDA (tests substitute a stand-in)."""

    pin = True  # host buffers are page-locked (non_blocking copies need it to be asynchronous)

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)


class HostPool:
    """Pinned host buffers by (shape, dtype): a buffer is handed out with the event after which
    it may be written (its last reader's), and returned with the event of its latest read."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[tuple, list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()  # returns come from whichever thread frees the graph
        self.allocated = 0  # buffers allocated (pinned) since the pool was made
        self.allocated_bytes = 0  # bytes of those buffers: the pool's host memory
        self.in_use_bytes = 0  # bytes of buffers holding a saved tensor now

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                buf, ready = free.pop()
                self.in_use_bytes += buf.untyped_storage().nbytes()
                return buf, ready
        buf = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        with self._lock:
            self.allocated += 1
            self.allocated_bytes += buf.untyped_storage().nbytes()
            self.in_use_bytes += buf.untyped_storage().nbytes()
        return buf, None

    def release(self, buf: torch.Tensor, box: list) -> None:
        """``box[0]``: the event of the buffer's last read (None: never read back)."""
        with self._lock:
            self.in_use_bytes -= buf.untyped_storage().nbytes()
            self._free.setdefault((tuple(buf.shape), buf.dtype), []).append((buf, box[0]))

    def clear(self) -> None:
        """Drop the free buffers (their memory is unpinned once nothing else holds them)."""
        with self._lock:
            for free in self._free.values():
                for buf, _ in free:
                    self.allocated_bytes -= buf.untyped_storage().nbytes()
            self._free.clear()


class Lease:
    """One offloaded tensor: its host buffer, the events of its copies, the tensor saved just
    before it on the same engine (prefetched when this one is unpacked)."""

    __slots__ = ("buf", "box", "saved", "prev", "group", "fetched", "fetch_event", "__weakref__")

    def __init__(
        self, buf: torch.Tensor, saved: Any, prev: weakref.ref | None, group: tuple
    ) -> None:
        self.buf = buf
        self.group = group  # (root call, block) running when it was saved
        self.box: list = [None]  # the event after which the buffer may be written again
        self.saved = saved  # event recorded after the device-to-host copy
        self.prev = prev
        self.fetched: torch.Tensor | None = None  # the device copy, once started
        self.fetch_event: Any = None


class OffloadEngine:
    """One device's streams and host pool (see the module docstring)."""

    def __init__(self, device: torch.device, streams: Any) -> None:
        self.device = device
        self.streams = streams
        self.pool = HostPool(streams.pin)
        self.d2h = streams.new_stream(device)
        self.h2d = streams.new_stream(device)
        self._last: weakref.ref | None = None  # the latest lease (forward order)
        self.fetches = 0  # host-to-device copies started
        self.prefetches = 0  # of which started ahead, by the unpack of the next tensor

    def save(self, x: torch.Tensor) -> Lease:
        x = x.detach()  # the buffer never joins the autograd graph
        st = self.streams
        buf, ready = self.pool.acquire(tuple(x.shape), x.dtype)
        main = st.current(self.device)
        self.d2h.wait_stream(main)  # x is fully written
        if ready is not None:
            self.d2h.wait_event(ready)  # the buffer's previous tensor was read back
        with st.use(self.d2h):
            buf.copy_(x, non_blocking=True)
            saved = st.event()
            saved.record(self.d2h)
        st.record_stream(x, self.d2h)  # x's memory is not reused before the copy ran
        lease = Lease(buf, saved, self._last, (sites.call_index(), sites.current_block()))
        weakref.finalize(lease, self.pool.release, buf, lease.box)
        self._last = weakref.ref(lease)
        return lease

    def _fetch(self, lease: Lease) -> None:
        st = self.streams
        self.h2d.wait_event(lease.saved)  # the host copy is complete
        with st.use(self.h2d):
            out = torch.empty(lease.buf.shape, dtype=lease.buf.dtype, device=self.device)
            out.copy_(lease.buf, non_blocking=True)
            done = st.event()
            done.record(self.h2d)
        lease.fetched, lease.fetch_event, lease.box[0] = out, done, done
        self.fetches += 1

    def _older(self, lease: Lease) -> Lease | None:
        return lease.prev() if lease.prev is not None else None

    def load(self, lease: Lease) -> torch.Tensor:
        """The tensor back on the device, ordered after its copy; starts the copies of the rest
        of its group and of the group saved before it (see the module docstring)."""
        if lease.fetched is None:
            self._fetch(lease)
        node = self._older(lease)
        while node is not None and node.group == lease.group:
            if node.fetch_event is None:  # never fetched (a consumed one is not fetched again)
                self._fetch(node)
            node = self._older(node)
        ahead = node.group if node is not None else None
        while node is not None and node.group == ahead and ahead[0] == lease.group[0]:
            if node.fetch_event is None:
                self._fetch(node)
                self.prefetches += 1
            node = self._older(node)
        out, lease.fetched = lease.fetched, None  # a second backward (retain_graph) fetches anew
        main = self.streams.current(self.device)
        main.wait_event(lease.fetch_event)
        self.streams.record_stream(out, main)  # allocated on the copy stream, used on this one
        return out


_ENGINES: dict[torch.device, OffloadEngine] = {}
_STREAMS: list[Any] = [CudaStreams()]
_LOCK = threading.Lock()


def engine_for(device: torch.device) -> OffloadEngine:
    """The engine of ``device`` (made once); a device the streams do not serve is refused."""
    streams = _STREAMS[-1]
    if not streams.accepts(device):
        raise ValueError(REFUSED_ON_CPU.format(dev=device))
    with _LOCK:
        eng = _ENGINES.get(device)
        if eng is None or eng.streams is not streams:
            eng = _ENGINES[device] = OffloadEngine(device, streams)
        return eng


def check_device(device: torch.device | str) -> None:
    """Raise the one-line refusal where offload cannot run (a CPU device)."""
    device = torch.device(device)
    if not _STREAMS[-1].accepts(device):
        raise ValueError(REFUSED_ON_CPU.format(dev=device))


def check_model(model: nn.Module) -> None:
    """:func:`check_device` for where ``model`` lives (a strategy or plan that offloads, refused
    at apply time on a CPU model)."""
    check_device(model_device(model))


@contextmanager
def using_streams(streams: Any) -> Iterator[None]:
    """Run offload with ``streams`` in place of CUDA's (tests: a stand-in that accepts CPU
    tensors and records the stream calls); the engines made meanwhile are dropped after."""
    _STREAMS.append(streams)
    try:
        yield
    finally:
        _STREAMS.remove(streams)
        with _LOCK:
            for dev in [d for d, e in _ENGINES.items() if e.streams is streams]:
                del _ENGINES[dev]


@dataclass(frozen=True)
class OffloadConfig(CodecConfig):
    """``inner``: the label of a codec whose payload is offloaded instead of the tensor
    (``offload+int8``: fewer bytes cross the link, INT8's error); "" offloads the tensor. The
    copies are always pinned, non-blocking, on the engine's streams."""

    inner: str = ""

    @property
    def label(self) -> str:
        return f"offload+{self.inner}" if self.inner else "offload"


class OffloadCodec(Codec):
    """Offloads the tensor, or an inner codec's payload tensors (one lease each); the inner
    codec's host checks, deferred verdicts, fallbacks and state are its own."""

    config: OffloadConfig
    codes_float64 = True  # a copy (an inner codec decides for its own payload)

    def __init__(self, config: OffloadConfig) -> None:
        super().__init__(config)
        self.inner: Codec | None = get_codec(config.inner) if config.inner else None

    @property
    def draws(self) -> bool:
        return self.inner is not None and self.inner.draws

    def _offload(self, x: torch.Tensor, inner: Packed | None) -> Packed:
        eng = engine_for(x.device)
        if inner is None:
            return Packed({}, tuple(x.shape), x.dtype, x.device, {"lease": eng.save(x)})
        leases = {k: eng.save(t) for k, t in inner.tensors.items()}
        meta = {"leases": leases, "inner": inner}
        if "fallback" in inner.meta:  # stored exactly by the inner codec: reported by the policy
            meta["fallback"] = inner.meta["fallback"]
        return Packed({}, tuple(x.shape), x.dtype, x.device, meta)

    def encode(self, x: torch.Tensor) -> Packed:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec 'offload' needs a tensor, got {type(x).__name__}")
        engine_for(x.device)  # a CPU tensor is refused before any encode
        return self._offload(x, self.inner.encode(x) if self.inner is not None else None)

    def encode_deferred(self, x: torch.Tensor, state: dict) -> Deferred:
        if self.inner is None:
            return Deferred(self.encode(x))
        engine_for(x.device)
        d = self.inner.encode_deferred(x, state)
        return Deferred(self._offload(x, d.packed), d.verdict, d.explain)

    def calibrate(self, packed: Packed, state: dict) -> None:
        if self.inner is not None:
            self.inner.calibrate(packed.meta["inner"], state)

    def decode(self, packed: Packed) -> torch.Tensor:
        eng = engine_for(packed.device)
        if "lease" in packed.meta:
            return eng.load(packed.meta["lease"])
        if "leases" not in packed.meta:  # ``fallback``: the tensor kept on the device as is
            return exact_value(packed)
        inner: Packed = packed.meta["inner"]
        tensors = {k: eng.load(lease) for k, lease in packed.meta["leases"].items()}
        if "fallback" in inner.meta:  # the tensor itself, offloaded
            return tensors["exact"]
        assert self.inner is not None
        return self.inner.decode(dataclasses.replace(inner, tensors=tensors))

    def nbytes(self, packed: Packed) -> int:
        """Bytes held on the tensor's own device: none (an exact fallback: the tensor)."""
        return storage_nbytes(list(packed.tensors.values()))

    def host_tensors(self, packed: Packed) -> list[torch.Tensor]:
        if "lease" in packed.meta:
            return [packed.meta["lease"].buf]
        return [lease.buf for lease in packed.meta.get("leases", {}).values()]

    def host_nbytes(self, packed: Packed) -> int:
        return storage_nbytes(self.host_tensors(packed))

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)


# not a planner candidate among the codecs: the planner adds offload as its own option where it
# can run (``slimact.planner.offload``), priced by the link's bandwidth, not by a codec timing
register_codec("offload", OffloadConfig(), OffloadCodec, candidate=False)
