"""Sites: every tensor autograd saves for backward is a *site*.

A site is named ``"<module path>:<op>#<k>"``: the path of the innermost module running when the
tensor was saved, the Python-level torch function that saved it (``linear``, ``silu``,
``scaled_dot_product_attention`` ... or a role an op declares with :func:`role`), and ``k``, the
ordinal of that op within one call of that module. Names are deterministic for a given model and
input shape, so a plan made while profiling applies unchanged while training.

One :class:`SiteRouter` per thread owns the single ``torch.autograd.graph.saved_tensors_hooks``
pair slimact installs. Its pack hook

1. skips parameters and buffers (they are not activations) and *parameter casts*: under
   ``torch.autocast`` each op first casts its parameters (a linear's weight) to the low
   precision and saves that copy; it is a function of the weights, not of the batch, so it gets
   no site name and no ordinal (names, and so codec choices and plans, are the same with and
   without autocast), never reaches a policy, and is reported to *cast listeners* (the meter
   counts it apart from activations),
2. names the site,
3. asks the active *policy* what to do with the tensor (keep it, or store it through a codec),
4. tells every *listener* (the meter) what is actually stored, in bytes of unique storages.

Nesting: ``saved_tensors_hooks`` only applies the innermost pair. Inside a region checkpointed by
``torch.utils.checkpoint`` the checkpoint's hooks win, which is right: nothing there is stored.
The router is entered once, around the root module's forward (by the meter or by ``apply``).
Tensors a strategy keeps alive outside autograd (the inputs a checkpointed block holds for its
recomputation) are reported with :func:`hold`, so the meter sees every stored byte.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from slimact import actions


class Stored(Protocol):
    """What a policy returns in place of a kept tensor (e.g. a codec's packed payload)."""

    def unpack(self) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it keeps alive, so the meter can count their unique storages."""
        ...


@dataclass(frozen=True)
class SavedEvent:
    """One tensor saved for backward, as the listeners see it."""

    site: str
    module: str
    op: str
    tensor: torch.Tensor  # the tensor autograd asked to save
    stored: list[torch.Tensor]  # what is actually kept (the tensor itself, or a codec's payload)
    action: str = "keep"
    host: list[torch.Tensor] = field(default_factory=list)  # kept in host memory (offload)


Listener = Callable[[SavedEvent], None]
CastListener = Callable[[str, str, torch.Tensor], None]  # (module, op, cast) of a parameter
Policy = Callable[[str, torch.Tensor], "Stored | None"]


@dataclass
class _State(threading.local):
    depth: int = 0
    stack: list[str] = field(default_factory=list)
    counters: dict[str, Counter] = field(default_factory=dict)
    op: str | None = None
    op_args: tuple = ()
    roles: list[str] = field(default_factory=list)
    excluded: set[int] = field(default_factory=set)
    listeners: list[Listener] = field(default_factory=list)
    cast_listeners: list[CastListener] = field(default_factory=list)
    policies: list[Policy] = field(default_factory=list)
    blocks: frozenset[str] = frozenset()  # the tracked model's repeated blocks (block_paths)
    calls: int = 0  # root calls tracked so far on this thread (``call_index``)
    tracked: frozenset[int] = frozenset()  # ids of the tracked model's modules
    probing: int = 0  # > 0 inside ``probing()``
    entry: object | None = None  # this thread's outermost ``tracking``: its hooks act here only


_state = _State()


@contextmanager
def probing() -> Iterator[None]:
    """Inside, a strategy's probe runs the model on a dummy batch (``slimact.reformulate``), and
    the call is not a training step: saves skip every policy (kept as they are, so no codec's
    state, capacity or draw counter moves), listeners still hear them, and the hooks that act
    once per step (the plan runtime's lazy planning, the first-step budget check and re-plan,
    compiled-auto's lazy planning) let it pass. Without this, a probe run after such a hook was
    installed (``apply(m, plan)`` then ``apply(m, "invact")``) was taken for the first step."""
    _state.probing += 1
    try:
        yield
    finally:
        _state.probing -= 1


def is_probing() -> bool:
    return _state.probing > 0


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage: its data pointer; for a meta or fake tensor (every pointer is
    0) the storage object's own address, so shapes-only runs keep their storage sharing."""
    storage = t.untyped_storage()
    if t.device.type == "meta" or isinstance(t, FakeTensor):
        return storage._cdata
    return storage.data_ptr()


def current_module() -> str:
    return _state.stack[-1] if _state.stack else ""


def call_index() -> int:
    """Which tracked root call is running (counts the router's outermost entries per thread):
    saves of one forward share it."""
    return _state.calls


def current_block() -> str:
    """The outermost repeated block running now (a decoder layer, not an expert inside it),
    else the current module."""
    for path in _state.stack:
        if path in _state.blocks:
            return path
    return current_module()


def _next_site(op: str) -> tuple[str, str]:
    module = current_module()
    counter = _state.counters.setdefault(module, Counter())
    k = counter[op]
    counter[op] += 1
    return f"{module}:{op}#{k}", module


def is_active() -> bool:
    return _state.depth > 0


def _is_excluded(t: torch.Tensor) -> bool:
    if isinstance(t, nn.Parameter):
        return True
    try:
        return storage_key(t) in _state.excluded and t.untyped_storage().nbytes() > 0
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return False


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or _is_excluded(t)


def is_param_cast(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the tensor it views) is a dtype cast of a parameter, not an activation.

    Under ``torch.autocast`` a linear saves its input and its weight *cast to the low precision*
    (often as a transposed view). A trainable parameter's cast has ``grad_fn`` ``ToCopyBackward0``
    whose only input is the parameter's ``AccumulateGrad``. A frozen parameter's cast has no
    ``grad_fn``; it is recognised as a low-precision tensor equal to a parameter argument of the
    same shape of the running op (only tensors without autograd history are compared).
    """
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is not None:
        if type(fn).__name__ != "ToCopyBackward0":
            return False
        nxt = fn.next_functions
        acc = nxt[0][0] if nxt else None
        var = getattr(acc, "variable", None)
        return isinstance(var, torch.Tensor) and _is_param(var)
    if base.requires_grad or not base.is_floating_point() or not _state.op_args:
        return False
    for a in _state.op_args:
        if (
            isinstance(a, torch.Tensor)
            and a.dtype != base.dtype
            and a.shape == base.shape
            and a.device == base.device
            and _is_param(a)
            and torch.equal(a.to(base.dtype), base)
        ):
            return True
    return False


class _Unpacker:
    __slots__ = ("stored",)

    def __init__(self, stored: Stored) -> None:
        self.stored = stored


def _pack(t: torch.Tensor) -> Any:
    # What is kept as is is kept detached: a pack hook's result that holds the saved tensor
    # itself closes a reference cycle through autograd's C++ graph when the tensor is its op's
    # output (the tensor holds its grad_fn, which holds the packed result), one Python's
    # collector cannot see, so a forward whose backward never runs (a meter's, a probe's, a
    # loss computed only to log it) would keep its whole graph alive.
    if _is_excluded(t):
        return t.detach()
    if is_param_cast(t):
        for listener in list(_state.cast_listeners):
            listener(current_module(), _state.op or "saved", t)
        return t.detach()
    op = _state.roles[-1] if _state.roles else (_state.op or "saved")
    site, module = _next_site(op)
    stored: Stored | None = None
    for policy in () if _state.probing else reversed(_state.policies):
        stored = policy(site, t)
        if stored is not None:
            break
    if _state.listeners:
        kept = [t] if stored is None else stored.tensors()
        action = (
            actions.for_role(op)
            if stored is None
            else getattr(stored, "action", None) or actions.codec(type(stored).__name__)
        )
        host = getattr(stored, "host_tensors", None)
        event = SavedEvent(site, module, op, t, kept, action, host() if host else [])
        for listener in list(_state.listeners):
            listener(event)
    return t.detach() if stored is None else _Unpacker(stored)


def _unpack(obj: Any) -> torch.Tensor:
    return obj.stored.unpack() if isinstance(obj, _Unpacker) else obj


def hold(t: torch.Tensor, role: str, host: list[torch.Tensor] | None = None) -> None:
    """Report a tensor a strategy keeps alive for backward outside autograd's saved tensors;
    ``host``: it is kept in host memory instead, as these tensors (offload), not on its device.

    Under ``torch.compile`` nothing is reported: the compiled graph's own saves (which include
    what a checkpoint keeps) reach the router as saved tensors of the graph."""
    if (
        torch.compiler.is_compiling()
        or not is_active()
        or not isinstance(t, torch.Tensor)
        or _is_excluded(t)
    ):
        return
    site, module = _next_site(role)
    if host is not None:
        event = SavedEvent(site, module, role, t, [], actions.OFFLOAD, list(host))
    else:
        event = SavedEvent(site, module, role, t, [t], actions.KEEP)  # kept as is, outside autograd
    for listener in list(_state.listeners):
        listener(event)


def role(name: str) -> AbstractContextManager[None]:
    """Name the op for tensors saved inside (custom autograd Functions use this).

    Under ``torch.compile`` this is a no-op: a compiled graph's saves are chosen by AOTAutograd,
    not by the op, so there is nothing to name (and a thread-local push would break the graph).
    """
    if torch.compiler.is_compiling():
        return nullcontext()
    return _role(name)


@contextmanager
def _role(name: str) -> Iterator[None]:
    _state.roles.append(name)
    try:
        yield
    finally:
        _state.roles.pop()


class _OpTracker(TorchFunctionMode):
    """Records which Python-level torch function is running, so saves can name their op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # names nothing there; a mutation would break the graph
            return func(*args, **(kwargs or {}))  # (inside a traced autograd.Function's backward)
        outer, outer_args = _state.op, _state.op_args
        if outer is None:
            _state.op = getattr(func, "__name__", None) or str(func)
            _state.op_args = (*args, *(kwargs or {}).values())  # parameter casts: is_param_cast
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _state.op, _state.op_args = outer, outer_args


def _is_block_container(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.Sequential))


def block_paths(model: nn.Module) -> list[str]:
    """Paths of repeated blocks: children of a ModuleList/Sequential (e.g. ``layers.3``)."""
    out = []
    for path, m in model.named_modules():
        if _is_block_container(m):
            out.extend(f"{path}.{name}" if path else name for name, _ in m.named_children())
    return out


def block_of(path: str, blocks: list[str]) -> str:
    best = ""
    for b in blocks:
        if (path == b or path.startswith(b + ".")) and len(b) > len(best):
            best = b
    return best


@contextmanager
def tracking(model: nn.Module | None = None) -> Iterator[None]:
    """Enter the router: name sites inside ``model`` and route saves through policies/listeners.

    Re-entrant: an inner ``tracking`` (e.g. an applied strategy inside a meter) is a no-op. An
    inner one for a model outside the tracked one warns: its sites would be named and routed as
    the outer model's, so its plan's actions would not find them.
    """
    if _state.depth > 0:
        if model is not None and _state.tracked and id(model) not in _state.tracked:
            warnings.warn(
                f"slimact's router is already tracking another model; this "
                f"{type(model).__name__} runs inside it untracked (its sites are not named and "
                "its plan's actions do not apply). Measure or run one model at a time.",
                RuntimeWarning,
                stacklevel=3,
            )
        _state.depth += 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    handles = []
    entry = _state.entry = object()
    if model is not None:
        _state.excluded = _param_storages(model)
        _state.blocks = frozenset(block_paths(model))
        _state.tracked = frozenset(id(m) for m in model.modules())
        sealed: list[str] = []  # inside a compiled block, hooks would only cost recompiles
        for path, m in model.named_modules():
            if any(path.startswith(f"{b}.") for b in sealed):
                continue
            if m in _COMPILED:
                sealed.append(path)
            handles.append(m.register_forward_pre_hook(_make_pre_hook(path, entry)))
            if path:  # the root needs no pop (an empty stack is the root), and a forward hook
                # on it would be removed while a failing root call iterates its forward hooks
                # (when the router was entered by one of them), hiding the call's own error
                handles.append(m.register_forward_hook(_make_post_hook(entry), always_call=True))
    _state.depth = 1
    _state.calls += 1
    _state.stack.clear()
    _state.counters.clear()
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack), _OpTracker():
            yield
    finally:
        _state.depth = 0
        _state.stack.clear()
        _state.counters.clear()
        _state.excluded = set()
        _state.blocks = frozenset()
        _state.tracked = frozenset()
        _state.entry = None
        for h in handles:
            h.remove()


# Modules whose forward runs compiled (``slimact.compiled.blocks``). The router hooks the module
# itself (its path names what its graphs save) but none inside it: dynamo traces submodules'
# hooks into the graph and guards on their ids, so hooks registered anew by every ``measure``
# would recompile the block each time, until dynamo gives up and runs it eagerly.
_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def rerouted() -> AbstractContextManager:
    """The router's hook pair entered again, innermost, if the router is active (else nothing):
    a compiled block that runs eagerly (dynamo gave up on it) is inside its own traced codec
    hooks, which would otherwise hide its saves from the router, and so from the meter."""
    if _state.depth == 0:
        return nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def seal(module: nn.Module, compiled: bool = True) -> None:
    """Mark ``module`` as running compiled (``compiled=False``: no longer)."""
    if compiled:
        _COMPILED.add(module)
    else:
        _COMPILED.discard(module)


def sealed(module: nn.Module) -> bool:
    """Does ``module`` run compiled (:func:`seal`)?"""
    return module in _COMPILED


def _param_storages(model: nn.Module) -> set[int]:
    """Storage keys of parameters and buffers (an FSDP2 DTensor: its local shard)."""
    keys = set()
    for t in (*model.parameters(), *model.buffers()):
        try:
            keys.add(storage_key(getattr(t, "_local_tensor", t)))
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            pass
    return keys


def _make_pre_hook(path: str, entry: object):
    """Module hooks are the process's, the router's state is the thread's: a hook acts for the
    ``tracking`` that registered it only, on its thread (another thread tracking the same model
    registers its own), so no thread's module stack takes another thread's pushes."""

    def pre_hook(module, args):
        if torch.compiler.is_compiling():  # inside a compiled block: its saves are the block's
            return
        if _state.entry is not entry:
            return
        _state.stack.append(path)
        _state.counters.pop(path, None)

    return pre_hook


def _make_post_hook(entry: object):
    def post_hook(module, args, output):
        if torch.compiler.is_compiling() or _state.entry is not entry:
            return
        if _state.stack:
            _state.stack.pop()

    return post_hook


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    _state.listeners.append(listener)
    try:
        yield
    finally:
        _state.listeners.remove(listener)


@contextmanager
def listening_casts(listener: CastListener) -> Iterator[None]:
    """Tell ``listener(module, op, tensor)`` about every parameter cast saved (see ``_pack``)."""
    _state.cast_listeners.append(listener)
    try:
        yield
    finally:
        _state.cast_listeners.remove(listener)


@contextmanager
def policy(p: Policy) -> Iterator[None]:
    """Route saves through ``p(site, tensor) -> Stored | None`` (None keeps the tensor)."""
    _state.policies.append(p)
    try:
        yield
    finally:
        _state.policies.remove(p)


# ------------------------------------------------------------------------------ root calls
_CALL_IMPL = nn.Module._call_impl.__code__


def _running_module_calls() -> list[Any]:
    """The ``nn.Module._call_impl`` frames on this thread's stack: the module calls running."""
    out, f = [], sys._getframe(1)
    while f is not None:
        if f.f_code is _CALL_IMPL:
            out.append(f)
        f = f.f_back
    return out


REFUSED = (None, None, "refused")  # the entry of a call ``RootCalls.claim`` refused


class RootCalls:
    """What a root module's forward pre-hook entered for one call, kept for its forward hook
    to close (the router, a policy, a listener).

    torch runs an ``always_call`` forward hook after an ``Exception``, not after a
    ``BaseException`` (Ctrl-C, ``SystemExit``), so a call interrupted that way would leave its
    entry open, and with it the router and policy, for every later save of any model in the
    thread. Each entry holds the frame of the module call it belongs to (its ``_call_impl``;
    held, not its id, which a later call's frame may reuse once it is freed, and dropped when
    the entry is closed); :meth:`close_stale` closes, with ``close``, the entries of this thread
    whose call is no longer running, so the model's next call starts as a finished one leaves
    it. ``close_all`` is for removal (``slimact.revert``). Entries are per thread: a forward
    hook closes its own thread's innermost entry (a context is exited on the thread that
    entered it); :meth:`claim` refuses a call while another thread is inside one."""

    def __init__(self, close: Callable[[Any], None]) -> None:
        self._close = close
        self._entries: dict[int, list[tuple[Any, Any]]] = {}  # thread id -> [(call frame, item)]
        self._lock = threading.RLock()

    def _mine(self) -> list[tuple[Any, Any]]:
        return self._entries.get(threading.get_ident(), [])

    def close_stale(self) -> None:
        """Close the entries of this thread's calls that are no longer running (interrupted by
        a BaseException); a pre-hook calls it first, before it does anything else."""
        mine, running = self._mine(), _running_module_calls() if self._mine() else []
        while mine and not any(f is mine[-1][0] for f in running):
            self._close(mine.pop()[1])

    def push(self, item: Any) -> None:
        self.close_stale()
        calls = _running_module_calls()
        with self._lock:
            mine = self._entries.setdefault(threading.get_ident(), [])
            mine.append((calls[0] if calls else None, item))

    def replace(self, item: Any) -> None:
        """``item`` for this thread's innermost open call (the one :meth:`claim` pushed)."""
        mine = self._mine()
        mine[-1] = (mine[-1][0], item)

    def pop(self) -> Any:
        """The item of this thread's innermost open call (None if there is none)."""
        with self._lock:
            mine = self._entries.get(threading.get_ident())
            return mine.pop()[1] if mine else None

    def claim(self, item: Any, what: str, worker: str) -> None:
        """:meth:`push` ``item``; but while another thread is inside a call (its call's frame
        on its stack), push ``REFUSED`` (for the forward hook, which torch runs after a
        pre-hook's error too) and raise. Threads named ``worker`` (a planner's, serving a call
        that waits on it) neither check nor count."""
        with self._lock:
            me = threading.current_thread()
            names = {t.ident: t.name for t in threading.enumerate()}
            others = [(t, {id(f) for f, _ in es}) for t, es in self._entries.items()
                      if es and t != me.ident and names.get(t) != worker]  # fmt: skip
            frames = sys._current_frames() if others and me.name != worker else {}
            for tid, calls in others:
                f = frames.get(tid)
                while f is not None and id(f) not in calls:
                    f = f.f_back
                if f is not None:
                    self.push(REFUSED)
                    raise RuntimeError(
                        f"this {what} is in a forward on another thread ({tid}); a model with a "
                        "slimact plan serves one thread's forward at a time: give each thread "
                        "its own copy (copy.deepcopy(model)), or take turns"
                    )
            self.push(item)

    def __getstate__(self) -> dict:  # a copy starts with no open call and a lock of its own
        return {"close": self._close}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["close"])

    def close_all(self) -> None:
        with self._lock:
            entries = [item for es in self._entries.values() for _, item in reversed(es)]
            self._entries.clear()
        for item in entries:
            self._close(item)

    def __len__(self) -> int:
        return sum(len(es) for es in self._entries.values())
