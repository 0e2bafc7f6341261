"""Per-site codecs in one compiled graph: a traced hook pair that picks each save's codec by the
module it belongs to.

A plan that gives different sites different codecs (``auto@<b>``'s) is lowered into the one
graph (``planner/graph.py``) as one traced hook pair (``compiled/codec.py``) whose pack reads,
for each tensor the graph saves, the forward-graph node behind it
(``compiled.codec.saved_node``) and picks the codec of its **modules**: the module of the op
that made it and of every op that reads it in the forward (eager's sites are an op saving its
input or its output, ``<module>:<op>#k``; the modules come from the nodes' ``nn_module_stack``,
dynamo's metadata, which AOTAutograd keeps on the forward graph). Where several of them carry
codecs the widest wins (INT8 over INT6 over INT4: a tensor two sites share is stored once);
where none does, the tensor is kept as it is. A module's codec is the one the plan gives its
sites (:func:`traced_label`: an eager codec label mapped to a traced codec, the widest where a
module's sites differ). The granularity is the module, not the site: two sites of one module
with different codecs take the wider, and SDPA's roles keep their traced rules (q and k exact).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch._functorch.config as functorch_config
import torch.fx
import torch.nn as nn

from slimact.compiled.codec import TRACE_CALLS, CompiledCodec, decode, encode, resolve_codec
from slimact.compiled.codec import saved_node as _saved_node

# eager codec label (its prefix) -> traced codec; the first prefix that matches wins
_LABELS = (
    ("int8", "int8"),
    ("bits", "int8"),  # a boolean mask: any quantizing traced codec packs it as bits
    ("int6", "int6"),
    ("int4-outlier", "int4-outlier"),
    ("int4", "int4"),
)
_WIDTH = {"int8": 3, "int6": 2, "int4-outlier": 1, "int4": 0}


def traced_label(label: str) -> str | None:
    """The traced codec (``compiled.codec.CODECS``) an eager codec label lowers to, or None
    where it has none (PRAC, offload, ...: kept as it is in the graph)."""
    return next((t for p, t in _LABELS if label.startswith(p)), None)


def widest(names: Iterable[str]) -> str | None:
    names = list(names)
    return max(names, key=_WIDTH.__getitem__) if names else None


def _tokens(path: str) -> list[str]:
    return re.sub(r"\[['\"]?([^\]'\"]*)['\"]?\]", r".\1", path).split(".")


@dataclass(frozen=True)
class SiteCodecs:
    """Absolute module path -> traced codec name (``table``), and every module path of the
    model (``modules``: a node's module is the longest suffix of its stack's path that is
    one)."""

    table: tuple[tuple[str, str], ...]
    modules: tuple[str, ...]  # (a tuple: fx embeds the pair's argument as a constant)
    filtering: str = "no_static"

    @classmethod
    def of(cls, model: nn.Module, labels: Mapping[str, str]) -> SiteCodecs:
        """From ``labels``: absolute module path -> traced codec name."""
        return cls(
            tuple(sorted(labels.items())), tuple(sorted(n for n, _ in model.named_modules()))
        )

    def module_of(self, node: torch.fx.Node) -> str | None:
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return None
        tokens = [t for t in _tokens(str(next(reversed(stack.values()))[0])) if t]
        for i in range(len(tokens) - 2, -1, -1):  # a forward override's ``.forward.module``
            if tokens[i : i + 2] == ["forward", "module"]:
                del tokens[i : i + 2]
        modules = set(self.modules)
        for i in range(len(tokens)):  # the longest suffix that names a module of the model
            cand = ".".join(tokens[i:])
            if cand in modules:
                return cand
        return None

    def codec_for(self, node: torch.fx.Node | None) -> CompiledCodec:
        """The codec of a saved node (module docstring); the identity where none applies."""
        table = dict(self.table)
        found = []
        for n in [node, *(node.users if node is not None else ())]:
            if n is None or n.op != "call_function":
                continue
            module = self.module_of(n)
            if module is not None and module in table:
                found.append(table[module])
        return resolve_codec(widest(found) or "none")


@torch.fx.wrap
def _pack_sites(codecs: SiteCodecs, x: torch.Tensor) -> tuple:
    TRACE_CALLS["pack"] += 1
    return encode(codecs.codec_for(_saved_node()), x)


@torch.fx.wrap
def _unpack_sites(payload: tuple) -> torch.Tensor:
    TRACE_CALLS["unpack"] += 1
    return decode(payload)


class _Pack(nn.Module):
    def __init__(self, codecs: SiteCodecs) -> None:
        super().__init__()
        self.codecs = codecs

    def forward(self, x):
        return _pack_sites(self.codecs, x)


class _Unpack(nn.Module):
    def forward(self, payload):
        return _unpack_sites(payload)


@functools.cache
def site_hook_pair(codecs: SiteCodecs) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The (pack, unpack) pair of ``codecs``, built once (dynamo guards on the hooks' ids)."""
    return torch.fx.symbolic_trace(_Pack(codecs)), torch.fx.symbolic_trace(_Unpack())


@contextmanager
def site_hooks(codecs: SiteCodecs):
    """Enter the pair around a compiled call: its graphs inline the per-module codecs."""
    pack, unpack = site_hook_pair(codecs)
    with (
        functorch_config.patch(saved_tensors_hooks_filtering_mode=codecs.filtering),
        torch.autograd.graph.saved_tensors_hooks(pack, unpack),
    ):
        yield
