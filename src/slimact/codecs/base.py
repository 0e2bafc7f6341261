"""The codec interface: the *store through a codec* action of the site/plan model.

A codec turns a saved tensor into a smaller ``Packed`` payload in forward (``encode``) and back
into a tensor of the original shape, dtype and device in backward (``decode``). ``nbytes`` is the
exact storage cost of a payload (unique storages of its tensors). Codecs are built from typed,
frozen config dataclasses kept in a registry (``register_codec`` / ``get_codec``), so a plan can
name them (``"int4-outlier"``) and carry their parameters.

Stateful codecs (PRAC's subspaces) keep their state on the codec instance, one instance per site
or per shared group; ``state_dict``/``load_state_dict`` let checkpoints carry it.

Exact fallback: a codec whose encode meets a tensor it cannot represent within its error contract
(non-finite values it has no sparse path for, a dynamic range its scales cannot span, a failed or
overflowing factorization, a float64 tensor: the lossy codecs' scales and arithmetic are float32,
:meth:`Codec.float64_exact`) returns :func:`exact_packed` instead: the tensor itself, unchanged (no
copy, so it costs exactly what keeping it would), with the reason in ``meta["fallback"]``.
``decode`` returns it as is (:func:`exact_value`), ``Codec.fallbacks`` counts the reasons, and the
saving policy reports the site (``codecs.saving``). Never a wrong finite value instead.

Deciding that fallback reads the tensor's statistics on the host: on a GPU, a device-to-host
sync per encode. :meth:`Codec.encode_deferred` is the encode without it, which the saving policy
uses once a site's saves have been clean: the codec returns its fixed-size payload together with
a small device *verdict* (its checks' outcome) and how to read it; the policy reads the verdict
after the step without waiting for the device (``slimact.ops.deferred``), reports a problem, and
checks that site on the host again from its next save on. A codec whose payload is correct
whatever the verdict (within its contract, non-finite values exact or NaN out) implements it;
the default is the checked :meth:`Codec.encode`.

Random draws (stochastic rounding, ``rounding="stochastic"`` of the INT4/INT8 codecs): a codec
whose encode draws (:attr:`Codec.draws`) takes each encode's seed from :func:`draw_seed`, which
the saving policy enters around the encode with a seed of the site's name and the site's count
of such encodes (:func:`site_draw_seed`; the count lives in the site's state, which checkpoints
carry, so a resumed run draws what the uninterrupted one did). Outside a policy (a direct
``encode``, the planner's trial encodes) the codec counts its own encodes instead. No torch
generator is involved: global RNG streams are untouched, and the seed is a host integer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from slimact.actions import THEN


@dataclass
class Packed:
    """A codec's payload: named tensors plus what ``decode`` needs to rebuild the original."""

    tensors: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Deferred:
    """What :meth:`Codec.encode_deferred` returns: the payload, and (optionally) small device
    tensors (the verdict: read as one flat list of floats) with the host function that turns
    their values into a reason to report (None: the encode was fine). ``explain`` runs on the
    host without tensor ops, and may also update the site's state."""

    packed: Packed
    verdict: torch.Tensor | list[torch.Tensor] | None = None
    explain: Callable[[list[float]], str | None] | None = None


def exact_packed(x: torch.Tensor, reason: str) -> Packed:
    """A payload that is ``x`` itself (stored exactly), tagged with why the codec fell back.

    Like autograd's own saves it remembers ``x``'s version, so an in-place change before backward
    raises instead of decoding the changed values."""
    meta = {"fallback": reason, "version": x._version}
    return Packed({"exact": x.detach()}, tuple(x.shape), x.dtype, x.device, meta)


def exact_value(packed: Packed) -> torch.Tensor | None:
    """The stored tensor of an :func:`exact_packed` payload, else None."""
    if "fallback" not in packed.meta:
        return None
    x = packed.tensors["exact"]
    if x._version != packed.meta["version"]:
        raise RuntimeError(
            "a tensor a codec stored exactly "
            f"({packed.meta['fallback']}) was modified in place before backward"
        )
    return x


def storage_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the unique storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


ROUNDING = ("nearest", "stochastic")  # slimact.ops.quant.ROUNDING (this layer does not import ops)
_SEED_MASK = (1 << 62) - 1
_DRAW_SEED: ContextVar[int | None] = ContextVar("slimact_draw_seed", default=None)


def check_rounding(cfg: object, rounding: str) -> None:
    """The one check of a ``rounding`` field (codec configs, strategy configs, traced codecs)."""
    if rounding not in ROUNDING:
        raise ValueError(
            f"{type(cfg).__name__}.rounding must be one of {ROUNDING} (round to nearest, or "
            f"stochastic rounding: unbiased), got {rounding!r}"
        )


def site_draw_seed(key: str, count: int) -> int:
    """The 62-bit seed of the ``count``-th random encode of ``key`` (a site's name): a hash of
    both on the host (blake2b), so neighbouring counts give unrelated seeds. Under
    torch.distributed the rank is hashed in too (rank 0 keeps the single-process seeds): ranks
    encode different data, and draws shared across them would not average out in the gradient
    all-reduce."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    text = f"{key}#{count}" + (f"@rank{rank}" if rank else "")
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


@contextmanager
def draw_seed(seed: int) -> Iterator[None]:
    """Inside, a codec's random encode draws from ``seed`` (see the module docstring)."""
    token = _DRAW_SEED.set(seed & _SEED_MASK)
    try:
        yield
    finally:
        _DRAW_SEED.reset(token)


@dataclass(frozen=True)
class CodecConfig:
    """Base of codec configs; subclasses are frozen dataclasses validated in ``__post_init__``."""

    def build(self) -> Codec:
        return _codec_class_for(type(self))(self)

    def describe(self) -> dict[str, Any]:
        return {"codec": codec_name(self), **asdict(self)}


FLOAT64 = (
    "float64: the codecs' scales and arithmetic are float32, so a float64 tensor (a float64 "
    "model) is stored exactly"
)


class Codec(ABC):
    """encode(tensor) -> Packed; decode(Packed) -> tensor; nbytes(Packed) -> exact bytes."""

    codes_float64 = False  # lossless codecs (bits, offload) store a float64 tensor as any other

    def float64_exact(self, x: torch.Tensor) -> Packed | None:
        """A lossy codec's first step in ``encode`` and ``encode_deferred``: a float64 tensor
        stored exactly (:data:`FLOAT64`), else None."""
        if x.dtype != torch.float64 or self.codes_float64:
            return None
        return self.fallback(x, FLOAT64)

    def __init__(self, config: CodecConfig) -> None:
        self.config = config
        self.fallbacks: dict[str, int] = {}  # reason -> encodes stored exactly for it

    def fallback(self, x: torch.Tensor, reason: str) -> Packed:
        """Store ``x`` exactly (see the module docstring) and count ``reason``."""
        counts = self.__dict__.setdefault("fallbacks", {})  # codecs pickled before it existed
        counts[reason] = counts.get(reason, 0) + 1
        return exact_packed(x, reason)

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Packed: ...

    @abstractmethod
    def decode(self, packed: Packed) -> torch.Tensor: ...

    @property
    def draws(self) -> bool:
        """Does an encode draw random numbers (``rounding="stochastic"``)? Then each one takes
        :meth:`next_seed`, and the saving policy gives it its site's seed."""
        return getattr(self.config, "rounding", "nearest") == "stochastic"

    def next_seed(self) -> int:
        """The seed of this encode's draws: the caller's (:func:`draw_seed`), else one of this
        codec's label and its own count of such encodes."""
        seed = _DRAW_SEED.get()
        if seed is not None:
            return seed
        count = self.__dict__.get("own_draws", 0)
        self.own_draws = count + 1
        return site_draw_seed(codec_label(self.config), count)

    def encode_deferred(self, x: torch.Tensor, state: dict) -> Deferred:
        """Encode without reading the device on the host (see the module docstring). ``state``
        is the site's own dict, kept by the saving policy across steps (an outlier codec keeps
        its site's capacity there). Default: the checked :meth:`encode`."""
        return Deferred(self.encode(x))

    def calibrate(self, packed: Packed, state: dict) -> None:
        """Learn from a checked :meth:`encode` of the site whose ``state`` this is (what a later
        :meth:`encode_deferred` sizes its payload by). Default: nothing."""
        del packed, state

    def nbytes(self, packed: Packed) -> int:
        return storage_nbytes(list(packed.tensors.values()))

    def metadata(self) -> dict[str, Any]:
        return self.config.describe()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


_CODECS: dict[str, CodecConfig] = {}
_CLASSES: dict[type, type] = {}
_BASELINES: set[str] = set()  # registered for labels, not planner candidates


def register_codec(
    name: str, default: CodecConfig, codec_cls: type[Codec], candidate: bool = True
) -> None:
    """Register a codec under ``name`` with its default config and implementation class.

    ``candidate=False``: a baseline codec (``int4-token``) that labels and plans may name
    (``codec_config``, ``get_codec``) but that ``codec_names()``, the planner's candidates and
    the profiler's default list, leaves out."""
    old = _CODECS.get(name)
    if old is not None and _qualname(_CLASSES.get(type(old), type)) != _qualname(codec_cls):
        raise ValueError(f"codec {name!r} is already registered for {type(old).__name__}")
    _CODECS[name] = default  # same class again: a re-import of its module; replace
    _CLASSES[type(default)] = codec_cls
    if candidate:
        _BASELINES.discard(name)
    else:
        _BASELINES.add(name)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _codec_class_for(cfg_type: type) -> type[Codec]:
    if cfg_type not in _CLASSES:
        raise ValueError(f"no codec is registered for config type {cfg_type.__name__}")
    return _CLASSES[cfg_type]


def codec_names(baselines: bool = False) -> list[str]:
    """The registered candidate codecs (baselines registered with ``candidate=False`` left out,
    unless ``baselines``: then every registered codec)."""
    return [n for n in _CODECS if baselines or n not in _BASELINES]


def codec_name(config: CodecConfig) -> str:
    """The registered name whose default equals ``config``, else the same-type name whose default
    differs in the fewest fields (an ``int8-channel`` config with other channels still reads
    ``int8-channel``), else the config's class name."""
    best, best_diff = type(config).__name__, None
    for name, default in _CODECS.items():
        if type(default) is not type(config):
            continue
        diff = sum(getattr(default, f.name) != getattr(config, f.name) for f in fields(config))
        if best_diff is None or diff < best_diff:
            best, best_diff = name, diff
    return best


# fields that size a codec to its tensor (or pick an implementation) rather than change what it
# stores: left out of labels, so one site reads the same label in every step
_UNLABELED = frozenset({"channels", "backend", "seed", "nonfinite", "max_range"})
_SHORT = {"group_size": "g", "bits": "b"}
_FLAGS = {"sr": ("rounding", "stochastic")}  # parameters written as one word


def codec_label(config: CodecConfig) -> str:
    """``<name>[/<params>]``: the nearest registered name (``codec_name``) and the parameters
    that differ from its defaults, e.g. ``prac/r1=0.5,r2=0.1``, ``int4-outlier/g32`` or
    ``int4-outlier-g16/sr`` (stochastic rounding; ``rounding=stochastic`` reads the same). A codec
    that is not registered (not a planner candidate) may name itself with a ``label`` property."""
    own = getattr(config, "label", None)
    if isinstance(own, str) and own:
        return own
    name = codec_name(config)
    default = _CODECS.get(name)
    if default is None or type(default) is not type(config):
        return name
    diffs = []
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in _UNLABELED or value == getattr(default, f.name):
            continue
        flag = next((w for w, fv in _FLAGS.items() if fv == (f.name, value)), None)
        if flag is not None:
            diffs.append(flag)
        else:
            diffs.append(f"{_SHORT[f.name]}{value}" if f.name in _SHORT else f"{f.name}={value}")
    return f"{name}/{','.join(diffs)}" if diffs else name


def codec_config(label: str) -> CodecConfig:
    """The config a label names: the inverse of :func:`codec_label`.

    ``<name>[/<params>]``: the registered default of ``name`` with the comma-separated
    parameters replaced, each ``field=value`` (parsed by the field's annotated type: ``None``,
    ``True``/``False``, an int, a float, else the text) or a short form (``g32``: group_size,
    ``b8``: bits, ``sr``: rounding=stochastic). ``codec_config(codec_label(c)) == c`` for every config ``c`` whose unlabeled
    fields (``channels``, ``backend``, ...) are at their defaults. ``<name>+<label>``: codec
    ``name``, whose config has an ``inner`` field, around the codec ``label`` names
    (``offload+int8``: INT8's payload offloaded)."""
    if not isinstance(label, str):
        raise ValueError(f"a codec label is a string like 'int4-outlier/g32', got {label!r}")
    outer, plus, inner = label.partition(THEN)
    if plus and "/" not in outer:  # <wrapper>+<inner label>: a codec around another (offload)
        cfg = codec_config(outer)
        if "inner" not in {f.name for f in fields(cfg)}:
            raise ValueError(f"codec label {label!r}: {outer!r} does not wrap another codec")
        codec_config(inner)  # the inner label is checked here
        return dataclasses.replace(cfg, inner=inner)
    name, _, params = label.partition("/")
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r} in {label!r}; valid codecs: {', '.join(_CODECS)}")
    default = _CODECS[name]
    if not params:
        return default
    hints = typing.get_type_hints(type(default))
    names = {f.name for f in fields(default)}
    short = {v: k for k, v in _SHORT.items()}
    over: dict[str, Any] = {}
    for part in params.split(","):
        key, eq, text = part.partition("=")
        flag = _FLAGS.get(part) if not eq else None
        if not eq and part[:1] in short and _INT.fullmatch(part[1:]):
            key, text = short[part[:1]], part[1:]
        if key not in names and flag is not None and flag[0] in names:
            key, text = flag
        if key not in names or key in over:
            why = "twice" if key in over else f"not a field of {type(default).__name__}"
            raise ValueError(f"codec label {label!r}: parameter {part!r} is {why}")
        over[key] = _parse_param(text, hints[key], label, key)
    return dataclasses.replace(default, **over)


_INT = re.compile(r"[+-]?\d+")


def _parse_param(text: str, annotation: Any, label: str, key: str) -> Any:
    """``text`` as a value of the annotated type (a union: the first of its types that reads
    it, in the order None, bool, int, float, str)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = set(typing.get_args(annotation) if union else (annotation,))
    if type(None) in kinds and text == "None":
        return None
    if bool in kinds and text in ("True", "False"):
        return text == "True"
    if int in kinds and _INT.fullmatch(text):
        return int(text)
    if float in kinds:
        try:
            return float(text)
        except ValueError:
            pass
    if str in kinds:
        return text
    raise ValueError(f"codec label {label!r}: {key}={text!r} is not a {annotation}")


def get_codec(spec: str | CodecConfig) -> Codec:
    """Build a codec from a registered name, a label (``int4-outlier/g32``) or a config."""
    if isinstance(spec, CodecConfig):
        return spec.build()
    if spec.partition("/")[0].partition(THEN)[0] not in _CODECS:
        raise ValueError(f"unknown codec {spec!r}; valid codecs: {', '.join(_CODECS)}")
    return codec_config(spec).build()
