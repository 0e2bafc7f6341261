"""Saving through a codec: a ``sites`` policy that stores chosen sites' tensors through codecs.

Ops know nothing about codecs. The site router's pack hook asks a :class:`CodecPolicy`, for every
saved tensor, which codec (if any) its site uses; the policy encodes it and returns a
:class:`CodecStored` that decodes in backward. A tensor saved by several ops (the input Q, K and
V all save, as different views) is encoded once: the policy caches payloads by (storage, offset,
shape, stride, version) for as long as the tensor's base is alive, so a freed storage whose address
is reused never hits a stale entry. Parameters never reach the policy (the router skips them).

``install_policy(model, policy)`` enters the router and the policy around the root module's
forward, so saves inside checkpointed regions stay under the checkpoint's own hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import ExitStack

import torch
import torch.nn as nn

from slimact import sites
from slimact.codecs.base import Codec, Packed, codec_name
from slimact.strategies.registry import AppliedChange


class CodecStored:
    """A payload in place of a saved tensor (implements ``sites.Stored``)."""

    __slots__ = ("codec", "packed", "__weakref__")

    def __init__(self, codec: Codec, packed: Packed) -> None:
        self.codec = codec
        self.packed = packed

    def unpack(self) -> torch.Tensor:
        return self.codec.decode(self.packed)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.packed.tensors.values())

    def nbytes(self) -> int:
        return self.codec.nbytes(self.packed)

    @property
    def action(self) -> str:
        return codec_name(self.codec.config)


Assign = Callable[[str, torch.Tensor], "Codec | None"]


class CodecPolicy:
    """``assign(site, tensor) -> Codec | None`` decides; this class encodes once per tensor."""

    def __init__(self, assign: Assign) -> None:
        self.assign = assign
        self._cache: dict[tuple, tuple[weakref.ref, CodecStored]] = {}

    def reset(self) -> None:
        self._cache.clear()

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (
            str(t.device),
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t._version,
            t.dtype,
        )

    def __call__(self, site: str, t: torch.Tensor) -> CodecStored | None:
        key = self._key(t)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is not None:
            return hit[1]
        codec = self.assign(site, t)
        if codec is None:
            return None
        stored = CodecStored(codec, codec.encode(t))
        base = t._base if t._base is not None else t
        self._cache[key] = (weakref.ref(base), stored)
        return stored


def install_policy(model: nn.Module, policy: Callable) -> AppliedChange:
    """Route ``model``'s saves through ``policy`` on every forward; returns an undoable change."""
    stacks: list[ExitStack] = []

    def pre_hook(module, args):
        stack = ExitStack()
        stack.enter_context(sites.tracking(model))
        stack.enter_context(sites.policy(policy))
        if hasattr(policy, "reset"):
            policy.reset()
        stacks.append(stack)

    def post_hook(module, args, output):
        if stacks:
            stacks.pop().close()

    h1 = model.register_forward_pre_hook(pre_hook)
    h2 = model.register_forward_hook(post_hook, always_call=True)

    def undo() -> None:
        h1.remove()
        h2.remove()

    return AppliedChange(path="", action="codec-policy", undo=undo)
