"""Offload in the MILP: what moving a storage to host memory costs, by measurement.

Offload (``slimact.codecs.offload``) frees a storage's device bytes and costs link time: a copy
of ``B`` bytes takes ``B / bw`` seconds each way, ``bw`` the host link's bandwidth, measured
once per device (:func:`link_bandwidth`: pinned copies timed with CUDA events, both directions,
the slower one kept; cached for the process). The copies run on side streams, so they cost the
step nothing while the compute they overlap takes longer, and their excess otherwise:

* forward: the device-to-host copies of one block's offloaded storages overlap the next block's
  forward, ``T_f`` (the profile's forward time of the whole block, ``ModuleProfile`` path "");
* backward: a block's copies back are started one block ahead, so they overlap the next
  block's backward, about ``2 T_f``.

So per block, with ``C = Σ_s B_s / bw`` over its offloaded storages (``B_s``: the tensor's
bytes, or for ``offload+<codec>`` its codec's payload, which then also costs the codec's encode
and decode time and error), the stall is

    stall = max(0, C - T_f) + max(0, C - 2 T_f)

which the MILP linearizes with two continuous columns per group (``u >= C - T_f``, ``v >= C -
2 T_f``, ``u, v >= 0``, objective ``|g| (u + v)``). The offloaded bytes, host bytes, are capped by
the ``host_budget`` (bytes of pinned host memory) in one row; on the device they count 0. What
this model leaves out: the one block of prefetched tensors on the device during backward, and
link contention with other traffic (data loading).

On a CPU profile the option does not exist: a ``host_budget`` there is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimact import actions, spec

OFFLOAD = "offload"  # the option's name among a storage's codecs (the offload codec's)
_BANDWIDTH: dict[str, float] = {}


def is_offload(option: str) -> bool:
    """``offload`` or ``offload+<codec>`` (a codec's payload offloaded)."""
    return option == OFFLOAD or option.startswith(OFFLOAD + "+")


def inner_of(option: str) -> str:
    """What an offload option moves: ``raw`` (the tensor) or the codec whose payload it is."""
    return option.partition(actions.THEN)[2] or "raw"


@dataclass(frozen=True)
class OffloadOption:
    """The option as the MILP sees it: link bandwidth (bytes/s) and the host budget (bytes)."""

    bandwidth: float
    host_budget: int

    def copy_s(self, nbytes: float) -> float:
        return nbytes / self.bandwidth


def stall_s(copies_s: float, forward_s: float) -> float:
    """One block's stall: its copies' seconds ``C`` beyond the forward window ``T_f`` and the
    backward window ``2 T_f`` (see the module docstring)."""
    return max(0.0, copies_s - forward_s) + max(0.0, copies_s - 2 * forward_s)


def parse_host_budget(value: str | int | None) -> int | None:
    """``"8GiB"`` / an int of bytes -> bytes (None: no offload); a share is refused."""
    if value is None:
        return None
    b = spec.parse_budget(value)
    if b.total is None:
        raise ValueError(
            f"host_budget is bytes of pinned host memory, like '8GiB' or an int; got {value!r}"
        )
    return b.total


def link_bandwidth(device: str | torch.device, nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Host link bandwidth of CUDA ``device`` in bytes/s: the slower direction of pinned
    ``nbytes`` copies, best of ``repeats`` (measured once per device, then cached)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"link bandwidth is measured on a CUDA device, not {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _BANDWIDTH:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        worst = 0.0
        for copy in (lambda: host.copy_(dev, non_blocking=True),
                     lambda: dev.copy_(host, non_blocking=True)):  # fmt: skip
            copy()  # warm-up
            best = float("inf")
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                copy()
                end.record()
                end.synchronize()  # planning time, not a training step
                best = min(best, start.elapsed_time(end) / 1e3)
            worst = max(worst, best)
        _BANDWIDTH[key] = nbytes / worst
    return _BANDWIDTH[key]


def option_for(
    device: str, host_budget: str | int | None, bandwidth: float | None = None
) -> OffloadOption | None:
    """The offload option of a profile on ``device`` (None without a host budget); a host budget
    on a device offload cannot serve is refused in one line."""
    total = parse_host_budget(host_budget)
    if total is None:
        return None
    if not str(device).startswith("cuda"):
        raise ValueError(
            f"host_budget asks for offload, which moves saved tensors from a CUDA device to host "
            f"memory; this profile is on {device}, where they are in host memory already"
        )
    return OffloadOption(bandwidth or link_bandwidth(device), total)


__all__ = [
    "OFFLOAD",
    "OffloadOption",
    "inner_of",
    "is_offload",
    "link_bandwidth",
    "option_for",
    "parse_host_budget",
    "stall_s",
]
