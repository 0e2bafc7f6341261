"""The activation-memory meter: exact bytes of what autograd keeps for backward, per site.

``measure(model)`` enters the site router (``slimact.sites``) and listens to every save. It counts
the bytes of *unique storages* actually stored: a tensor saved by several ops (the input Q, K and V
all save) or viewed several ways counts once; parameters and buffers count zero; a tensor stored
through a codec counts its packed payload; tensors a strategy holds for recomputation count too.
Each storage is attributed to the first site that saved it; later savers are listed as sharers.
Blocks whose forward runs compiled (``slimact.compiled``) save inside their graphs with hooks
disabled; the meter reads those saves off the autograd graph behind each block's outputs
(``<block>:compiled#k``), so its count stays exact under torch.compile too.

    with slimact.measure(model) as m:
        model(x, targets=y).loss.backward()
    print(m.report.table())
    m.report.to_json()

``measure_step`` runs one full training step and adds step time and, on CUDA, peak allocated memory.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, is_dataclass

import torch
import torch.nn as nn

from slimact import actions, sites
from slimact.registry import refuse_compiled_root


@dataclass
class SiteRecord:
    site: str
    module: str
    op: str
    block: str
    action: str
    bytes: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = ""
    shared_with: list[str] = field(default_factory=list)
    host_bytes: int = 0  # kept in host memory instead (offload): not in ``bytes``


@dataclass
class MemoryReport:
    """Per-site bytes, per-block totals and the grand total of stored activations."""

    sites: list[SiteRecord] = field(default_factory=list)
    total_bytes: int = 0
    n_tokens: int | None = None
    n_blocks: int = 0
    step_time_s: float | None = None
    peak_allocated_bytes: int | None = None
    param_cast_bytes: int = 0  # autocast's parameter copies saved for backward: not activations
    param_casts: int = 0  # how many such saves (a cast saved by several ops counts each time)
    host_bytes: int = 0  # saved tensors kept in host memory (offload), apart from device bytes

    @property
    def per_block(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sites:
            key = s.block or "(outside blocks)"
            out[key] = out.get(key, 0) + s.bytes
        return out

    @property
    def per_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sites:
            out[s.op] = out.get(s.op, 0) + s.bytes
        return out

    @property
    def block_bytes(self) -> int:
        return sum(s.bytes for s in self.sites if s.block)

    def bytes_per_token_per_block(self) -> float | None:
        if not self.n_tokens or not self.n_blocks:
            return None
        return self.block_bytes / self.n_tokens / self.n_blocks

    def to_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "block_bytes": self.block_bytes,
            "n_tokens": self.n_tokens,
            "n_blocks": self.n_blocks,
            "bytes_per_token_per_block": self.bytes_per_token_per_block(),
            "step_time_s": self.step_time_s,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "param_cast_bytes": self.param_cast_bytes,
            "param_casts": self.param_casts,
            "host_bytes": self.host_bytes,
            "per_block": self.per_block,
            "sites": [asdict(s) for s in self.sites],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, block: str | None = None) -> str:
        """Plain-text table of sites (of one block if given), then per-block totals."""
        rows = [s for s in self.sites if block is None or s.block == block]
        lines = [f"{'site':<58} {'action':<10} {'shape':<20} {'bytes':>12}"]
        for s in rows:
            lines.append(f"{s.site:<58} {s.action:<10} {str(list(s.shape)):<20} {s.bytes:>12,}")
        lines.append("")
        for b, n in self.per_block.items():
            lines.append(f"{b:<58} {'':<10} {'':<20} {n:>12,}")
        lines.append(f"{'TOTAL':<58} {'':<10} {'':<20} {self.total_bytes:>12,}")
        if self.host_bytes:
            label = "(+ offloaded to host memory, not on the device)"
            lines.append(f"{label:<58} {'':<10} {'':<20} {self.host_bytes:>12,}")
        if self.param_casts:
            label = f"(+ parameter casts, not activations: {self.param_casts} saves)"
            lines.append(f"{label:<58} {'':<10} {'':<20} {self.param_cast_bytes:>12,}")
        return "\n".join(lines)


class Meter:
    """Listener that turns saved-tensor events into a :class:`MemoryReport`."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self._blocks = sites.block_paths(model) if model is not None else []
        self._by_storage: dict[tuple[str, int], SiteRecord] = {}
        self._records: dict[str, SiteRecord] = {}
        self._alive: list[torch.Tensor] = []  # keeps storages alive so pointers stay unique
        self._cast_storages: set[tuple[str, int]] = set()
        self.report = MemoryReport(n_blocks=len(self._blocks))

    def param_cast(self, module: str, op: str, t: torch.Tensor) -> None:
        """A cast of a parameter was saved (``sites.listening_casts``): counted apart."""
        self.report.param_casts += 1
        storage = t.untyped_storage()
        key = (str(t.device), sites.storage_key(t))
        if storage.nbytes() and key not in self._cast_storages:
            self._cast_storages.add(key)
            self._alive.append(t)
            self.report.param_cast_bytes += storage.nbytes()

    def __call__(self, ev: sites.SavedEvent) -> None:
        rec = self._records.get(ev.site)
        if rec is None:
            rec = SiteRecord(
                site=ev.site,
                module=ev.module,
                op=ev.op,
                block=sites.block_of(ev.module, self._blocks),
                action=ev.action,
                shape=tuple(ev.tensor.shape),
                dtype=str(ev.tensor.dtype).replace("torch.", ""),
            )
            self._records[ev.site] = rec
            self.report.sites.append(rec)
        for t in ev.stored:
            storage = t.untyped_storage()
            key = (str(t.device), sites.storage_key(t))
            if storage.nbytes() == 0:
                continue
            owner = self._by_storage.get(key)
            if owner is None:
                self._by_storage[key] = rec
                self._alive.append(t)
                rec.bytes += storage.nbytes()
                self.report.total_bytes += storage.nbytes()
            elif owner is not rec and ev.site not in owner.shared_with:
                owner.shared_with.append(ev.site)
        for t in ev.host:
            storage = t.untyped_storage()
            key = ("host", str(t.device), sites.storage_key(t))
            if storage.nbytes() and key not in self._by_storage:
                self._by_storage[key] = rec
                self._alive.append(t)
                rec.host_bytes += storage.nbytes()
                self.report.host_bytes += storage.nbytes()

    def compiled_saves(self, block: str, outputs: object, params: set, stop: set) -> None:
        """What the compiled graphs of ``block``'s forward saved: the saved tensors of every
        ``CompiledFunctionBackward`` node behind its outputs (nodes in ``stop``, the graph
        before the block, are not entered). A compiled region saves with hooks disabled, so the
        router never sees these; they are counted here as ``<block>:compiled#k``, unique
        storages as everywhere (a storage the router already counted stays with its owner)."""
        todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
        k = 0
        while todo:
            node = todo.pop()
            if node is None or node in stop:
                continue
            stop.add(node)
            todo.extend(f for f, _ in node.next_functions)
            if type(node).__name__ != "CompiledFunctionBackward":
                continue
            for t in node.saved_tensors:
                if sites.storage_key(t) in params:
                    continue
                coded = not t.is_floating_point()  # a traced codec's payload (uint8 codes)
                action = actions.codec("compiled") if coded else actions.KEEP
                self(sites.SavedEvent(f"{block}:compiled#{k}", block, "compiled", t, [t], action))
                k += 1

    def release(self) -> None:
        self._alive.clear()


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, a tuple/list, or a dict-like output)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if is_dataclass(value) and not isinstance(value, type):
        return [t for f in fields(value) for t in _tensors(getattr(value, f.name))]
    return []


def _param_storages(model: nn.Module) -> set[int]:
    """Storage keys of the parameters and buffers (a DTensor's local shard; FSDP2's sharded
    parameters are DTensors, whose wrapper has no storage of its own)."""
    keys = set()
    for t in (*model.parameters(), *model.buffers()):
        local = t.to_local() if callable(getattr(t, "to_local", None)) else t
        try:
            keys.add(sites.storage_key(local))
        except RuntimeError:  # a storage with no data (freed or resized away): nothing to skip
            continue
    return keys


@contextmanager
def _compiled_regions(meter: Meter, model: nn.Module | None) -> Iterator[None]:
    """Forward hooks on the blocks that hand their compiled saves to ``meter``."""
    if model is None:
        yield
        return
    params = _param_storages(model)
    stop: set = set()  # autograd nodes already walked (earlier blocks, inputs)
    mods = dict(model.named_modules())
    mine = threading.get_ident()  # module hooks are global; a planner's worker thread is not ours

    def ours() -> bool:  # not while dynamo traces a whole-model compile through the hooks
        return not torch.compiler.is_compiling() and threading.get_ident() == mine

    def pre(mod, args, kwargs):
        if ours():
            stop.update(t.grad_fn for t in _tensors([args, kwargs]) if t.grad_fn is not None)

    def post(mod, args, kwargs, out, path):
        if ours():
            meter.compiled_saves(path, out, params, stop)

    handles = [  # the root too: a graph compiled whole saves behind its output (``:compiled#k``)
        model.register_forward_pre_hook(pre, with_kwargs=True),
        model.register_forward_hook(lambda m, a, k, o: post(m, a, k, o, ""), with_kwargs=True),
    ]
    for path in sites.block_paths(model):
        hook = lambda m, a, k, o, p=path: post(m, a, k, o, p)  # noqa: E731
        handles.append(mods[path].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mods[path].register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def measure(model: nn.Module | None = None, n_tokens: int | None = None) -> Iterator[Meter]:
    """Count bytes saved for backward by the forward passes run inside the block.

    ``model`` gives module paths (sites) and the parameters to exclude; ``n_tokens`` (B*S) enables
    per-token figures. A model compiled whole by ``torch.compile`` is refused (its forward is
    one graph the router cannot see into): measure the plain model (``model._orig_mod``), whose
    blocks ``slimact.apply(..., compile=True)`` compiles.
    """
    refuse_compiled_root(model, "slimact.measure")
    meter = Meter(model)
    meter.report.n_tokens = n_tokens
    try:
        with (
            sites.tracking(model),
            sites.listening(meter),
            sites.listening_casts(meter.param_cast),
            _compiled_regions(meter, model),
        ):
            yield meter
    finally:
        meter.release()


def measure_step(
    model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor | None = None
) -> MemoryReport:
    """One forward+backward of ``model(input_ids, targets=...)``: saved bytes, step time, CUDA peak."""
    cuda = input_ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with measure(model, n_tokens=input_ids.numel()) as m:
        out = model(input_ids, targets=targets if targets is not None else input_ids)
    out.loss.backward()
    if cuda:
        torch.cuda.synchronize()
        m.report.peak_allocated_bytes = torch.cuda.max_memory_allocated()
    m.report.step_time_s = time.perf_counter() - start
    return m.report
