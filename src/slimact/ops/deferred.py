"""Checks decided on the device and read on the host later, without waiting for the device.

A check that reads a device tensor on the host (``bool(t)``, ``.item()``, ``.cpu()``) makes the
host wait until the device has run everything queued before it: a device-to-host sync, which
stalls the queue of kernels the host keeps ahead of the device. The per-step paths of slimact's
actions (codecs, PRAC, inverted norms) therefore compute their verdicts as small device tensors
and hand them to a :class:`DeferredChecks`, which

* ``add``: keeps the verdict tensor (a few values) and what to do with its values on the host;
* ``launch``: concatenates the verdicts added since the last launch into one tensor and starts
  one non-blocking copy to (pinned) host memory, recording an event after it on CUDA;
* ``poll``: hands the values of every launched batch whose copy has finished (the event has
  completed; never waited for) to their callbacks, then launches what was added since.

A verdict is therefore read at the earliest in the ``poll`` after the one that launched it: in
the codecs' and norms' use, at the next training forward. The behaviour does not depend on the
device's speed on a CPU, where every copy has finished when it returns, so the CPU runs exactly
the logic a GPU runs (the sync-count test relies on that). :meth:`wait` blocks until every
verdict is read; it is for reports that ask for the figures now, not for a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Callback = Callable[[list[float]], None]


class _Batch:
    __slots__ = ("host", "event", "parts")

    def __init__(self, host: torch.Tensor, event, parts: list[tuple[int, int, Callback]]) -> None:
        self.host, self.event, self.parts = host, event, parts

    def done(self) -> bool:
        return self.event is None or self.event.query()


class DeferredChecks:
    """Verdicts on the device, read on the host once the device has produced them (see the
    module docstring)."""

    def __init__(self) -> None:
        self._added: list[tuple[torch.Tensor, Callback | None]] = []
        self._launched: list[_Batch] = []

    def __getstate__(self) -> dict:
        """Copies and pickles start empty (pending verdicts belong to this object's steps)."""
        return {"_added": [], "_launched": []}

    def __len__(self) -> int:
        return len(self._added) + sum(len(b.parts) for b in self._launched)

    def add(self, values: torch.Tensor | Sequence[torch.Tensor], callback: Callback) -> None:
        """Queue ``values`` (a tensor or several, any shapes, read as one flat list of floats)
        for ``callback``."""
        parts = [values] if isinstance(values, torch.Tensor) else list(values)
        for i, v in enumerate(parts):
            v = v.detach().reshape(-1)
            self._added.append((v, callback if i == len(parts) - 1 else None))

    def launch(self) -> None:
        """One non-blocking device-to-host copy of everything added since the last launch."""
        if not self._added:
            return
        added, self._added = self._added, []
        by_device: dict[torch.device, list[tuple[torch.Tensor, Callback | None]]] = {}
        for v, cb in added:
            by_device.setdefault(v.device, []).append((v, cb))
        for device, items in by_device.items():
            values = [v for v, _ in items]
            flat = torch.empty(sum(v.numel() for v in values), dtype=torch.float64, device=device)
            torch.cat(values, out=flat)  # one kernel: cat casts into its float64 output
            parts, at, start = [], 0, 0
            for v, cb in items:  # a callback's values end at its last tensor
                at += v.numel()
                if cb is not None:
                    parts.append((start, at, cb))
                    start = at
            event = None
            if device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            elif device.type == "cpu":
                host = flat
            else:  # another accelerator: a plain copy (its backend decides whether it waits)
                host = flat.to("cpu", non_blocking=True)
            self._launched.append(_Batch(host, event, parts))

    def poll(self) -> None:
        """Run the callbacks of every launched batch the device has finished, then launch the
        verdicts added since (never waits for the device)."""
        ready = [b for b in self._launched if b.done()]
        self._launched = [b for b in self._launched if not b.done()]
        for batch in ready:
            _deliver(batch)
        self.launch()

    def wait(self) -> None:
        """Read every verdict now: launch, wait for the copies, run the callbacks (a sync)."""
        self.launch()
        launched, self._launched = self._launched, []
        for batch in launched:
            if batch.event is not None:
                batch.event.synchronize()
            _deliver(batch)


def host_values(t: torch.Tensor) -> list:
    """The values of a tensor that lives on the host by construction (a draw from a CPU
    ``torch.Generator``): a read of host memory, no sync. Refuses a tensor on a device."""
    if t.device.type != "cpu":
        raise ValueError(f"host_values reads host tensors; this one is on {t.device}")
    return t.tolist()


def _deliver(batch: _Batch) -> None:
    # the copy has finished (event completed, or a CPU tensor): a read of host memory
    values = batch.host.tolist()
    for start, stop, cb in batch.parts:
        cb(values[start:stop])
