"""Traced codecs: saved-tensor hooks as ``fx.GraphModule`` pairs that torch.compile inlines.

Since torch 2.8, when the innermost ``saved_tensors_hooks`` pair are both ``torch.fx.GraphModule``
objects while dynamo compiles a frame, AOTAutograd copies the pack graph into the end of the
compiled *forward* graph (once per saved tensor) and the unpack graph into the start of the
*backward* graph (``_functorch/_aot_autograd/graph_compile.py``,
``maybe_inline_graph_saved_tensors_hooks``); at run time the compiled region runs with saved-tensor
hooks disabled (``runtime_wrappers._disable_saved_tensors_hooks``), so no Python hook runs per
tensor: the codec is fused by inductor like any other op. Dynamo guards on the hook ids
(``guards.AUTOGRAD_SAVED_TENSORS_HOOKS``), so the pair must be the *same objects* on every call
(built once per codec here) and must be active *around* the compiled call, not entered inside it.

What this module adds:

* :func:`hook_pair` ``(codec)``: the traced pack/unpack pair. Both are one call of a
  ``torch.fx.wrap``-ped helper, so the GraphModule is tiny and AOTAutograd re-traces the helper
  per saved tensor with its fake value: the helper makes *shape-dependent* choices in Python at
  trace time (:func:`choose`). Boolean masks (dropout's, and the attention-dropout mask SDPA
  saves on its math path: with dropout on, a compiled GPT-2 block saves them as bool, one byte
  per element; inductor does not regenerate them from its seed) are packed 8 to a byte
  (``masks``; lossless, :func:`pack_bits`). Kept exact (the pack returns ``(x,)``): other
  non-float tensors, fewer than ``min_numel`` values, last dimension 1 (norm statistics),
  SDPA's logsumexp. SDPA's v and output get ``attention_bits`` (INT8 per row by default:
  quantizing them to INT4 costs most of the gradient error, see adacc's Q/K/V finding in
  ``strategies/int4.py``), its q and k ``qk_bits`` (default 0: exact). SDPA's backward
  recomputes the probabilities from q and k against the exact saved logsumexp, so a logit
  error δ scales a probability by ``e^δ``, and δ grows as training sharpens attention: q and k
  at 6 or 8 bits look cheap at init and are what costs a trained model its gradients
  (``slimact.classify``'s ``qk`` role; BENCHMARKS.md, the quality section). The output's error
  enters every score gradient through backward's ``rowsum(dO * O)``, so it stays at 8 bits. The
  SDPA roles come from the per-tensor context ``_get_saved_tensor_hook_context()`` (torch
  >= 2.10: the forward-graph node being saved); without it only the shape rules apply. The rest
  is symmetric INT8 with one fp32 scale per row, INT6 with one per row, or INT4 with one per
  ``group_size`` values along the last dimension; a last dimension the group does not divide
  uses ``gcd(D, group_size)``, and below 8 values per group, or a row that does not split into
  the packing's slices, one INT8 scale per row. The math is ``slimact.ops.quant.quantize_ref``
  / ``dequantize_ref`` on the flat order in memory with ``group_size = g``: :func:`encode_ref` /
  :func:`decode_ref` are that reference and the tests check codes and scales equal it bit for
  bit (codes compared unpacked).
* Layout: a saved tensor that is dense but not contiguous (SDPA's q, k, v and output are
  [B, H, S, D] views of [B, S, H, D] storage) is coded in memory order and decoded back to the
  *same strides* (:func:`memory_order`): a compiled backward was laid out for the saved tensor's
  strides, and handing its kernels another layout is a silent wrong gradient, not an error.
* The packing (:func:`pack_codes`) combines *contiguous slices* of a row, so every byte plane
  is a vectorized pointwise op that inductor fuses with the quantization: INT4 puts code j and
  code j + D/2 in one byte; INT6 stores the first three quarters' 6-bit codes in three byte
  planes, each with two bits of the last quarter's code on top (4 codes in 3 bytes, D % 4 == 0).
  Packing neighbours (codes 2j, 2j + 1) instead needs strided lane shuffles, several times
  slower to encode on a CPU.
* ``outliers`` (``int4-outlier``: 1/128 of the channels): adacc's outlier separation (§3.2)
  in a compiled graph. The k channels (last dimension) of largest ``sum |x|`` are stored as
  they are (``[rows, k]`` plus their indices) and zeroed before coding. Adacc takes channels
  whose Z-score exceeds 3, a data-dependent count; a compiled graph needs a static shape, so
  k = ceil(outliers x D) is fixed and the top-k by the same score are kept (a channel the Z rule
  would not flag is merely stored exactly). On llama-20m at init there are no outlier channels:
  at compile's budget 0.7 its block error is 9.8e-3 against INT4's 1.0e-2, for +0.23 MiB.
* ``rounding="stochastic"`` (``int8-sr``, ``int4-sr``, ... in :func:`resolve_codec`; spec
  ``compiled-int4@sr``, or ``int4@sr`` under ``compile=True``): codes ``floor(x / S + u)`` with
  ``u ~ U[0, 1)`` instead of ``floor(x / S + 1/2)``, unbiased (``E[x^] = x``; every scaled value
  is within ``[-(2^(b-1) - 1), 2^(b-1) - 1]``, so none is clipped) at ``|x - x^| < S``, as the
  eager codecs' option (``slimact.codecs.quant``). ``u`` comes from inductor's seeded RNG
  (:func:`draw_uniform`: ``prims.inductor_random``, the graph's own seeds drawn from the global
  generator per call, so runs are reproducible from ``torch.manual_seed``; ``torch.rand`` in a
  pack hook reaches inductor after its random-op pass and fails to lower), not the eager
  codecs' hash: a traced hook keeps no count of its encodes to seed one with. Eagerly (the
  tests) it is ``torch.rand``; :func:`encode` takes another ``draw`` (the tests hand it the
  eager hash's draws and check the codes against ``quantize_ref``'s bit for bit).
* :func:`codec_hooks` ``(codec)``: the pair entered (with its filtering mode) around a compiled
  call; ``slimact.compiled.blocks`` compiles blocks inside it.

Trade-offs. The hooks see what AOTAutograd saves after its min-cut partition (it already
recomputes cheap pointwise ops), not slimact's named sites: there is no per-site plan, only
shape and op rules. ``filtering="donated"`` (torch's default) applies the pack to intermediates
only; graph inputs (the block's input, which the block's first norm saves) stay raw.
``"no_static"`` (the default here) packs inputs too, parameters excluded: the raw input is freed
when nothing else holds it (true for a block input in a decoder stack); an input something else
holds (a RoPE table of >= ``min_numel`` values) is packed as an extra copy, a cost of ~0.04% of
the bytes on llama-20m. Non-finite values are not kept exactly (unlike the eager codecs): a
NaN/inf makes its group NaN/inf (``outliers``: its channel scores NaN/inf, ranks first and is
stored exactly, up to k such channels). Unpacks run at the start of the region's backward, so each
block is its own region (per-block compile) and only one block's decoded tensors are live at a
time. Per block, the root (embedding, final norm, head, loss) stays eager and raw; the one graph
(``planner/graph.py``) enters the pair around the whole root, so its saves are coded too, and
all its unpacks open the one backward graph (inductor places them by its own scheduling). What
each codec keeps and costs, beside torch.compile's own budgets: BENCHMARKS.md §7.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch._functorch.config as functorch_config
import torch.fx
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from slimact.codecs.base import check_rounding
from slimact.compiled.packing import pack_bits, pack_codes, unpack_bits, unpack_codes
from slimact.compiled.prac import (
    _SEEDED,
    Draw,
    TracedPrac,
    decode_prac,
    encode_prac,
    feeds_linear,
    is_prac,
)
from slimact.ops.quant import Quantized, dequantize_ref, quantize_ref

try:  # the per-saved-tensor context (torch >= 2.10); private API, so optional
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
except ImportError:  # pragma: no cover - older torch
    _get_saved_tensor_hook_context = None

FILTERING_MODES = ("donated", "no_static", "all")
BITS = (0, 4, 6, 8)
_ROW_MULTIPLE = {4: 2, 6: 4}  # a row's codes pack into 2 (INT4) or 4 (INT6) contiguous slices
_SDPA = "scaled_dot_product"
LAYOUT = "layout"  # a payload coded in memory order: (LAYOUT, inverse permutation, *payload)
SR_SUFFIX = "-sr"  # resolve_codec("int4-sr"): CODECS["int4"] with stochastic rounding


@dataclass(frozen=True)
class CompiledCodec:
    """A traced codec: ``bits`` 0 (with no ``prac``: the identity pair), 4, 6 or 8; ``group_size``
    values per fp32 scale along the last dimension (0: one scale per row)."""

    bits: int = 8
    group_size: int = 0
    min_numel: int = 1024
    attention_bits: int = 8
    qk_bits: int | None = 0  # SDPA's q and k (0: exact; None: attention_bits)
    filtering: str = "no_static"
    outliers: float = 0.0  # share of channels (last dim) stored exactly below 8 bits (0: none)
    masks: bool = True  # bool tensors as bits (lossless; the identity codec keeps them too)
    prac: TracedPrac | None = None  # PRAC on what it selects (``compiled/prac.py``), first
    rounding: str = "nearest"  # or "stochastic": unbiased (module docstring)

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"CompiledCodec.bits must be one of {BITS}, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 0:
            raise ValueError(
                f"CompiledCodec.group_size must be an int >= 0, got {self.group_size!r}"
            )
        if self.attention_bits not in BITS:
            raise ValueError(
                f"CompiledCodec.attention_bits must be one of {BITS}, got {self.attention_bits!r}"
            )
        if self.qk_bits is not None and self.qk_bits not in BITS:
            raise ValueError(
                f"CompiledCodec.qk_bits must be None or one of {BITS}, got {self.qk_bits!r}"
            )
        if self.bits == 4 and self.group_size % 2:
            raise ValueError(
                f"INT4 needs an even group_size (two codes per byte), got {self.group_size}"
            )
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"CompiledCodec.min_numel must be an int >= 0, got {self.min_numel!r}")
        if self.filtering not in FILTERING_MODES:
            raise ValueError(
                f"CompiledCodec.filtering must be one of {FILTERING_MODES}, got {self.filtering!r}"
            )
        if not (isinstance(self.outliers, (int, float)) and 0.0 <= self.outliers < 1.0):
            raise ValueError(f"CompiledCodec.outliers must be in [0, 1), got {self.outliers!r}")
        if self.prac is not None and not isinstance(self.prac, TracedPrac):
            raise ValueError(f"CompiledCodec.prac must be a TracedPrac or None, got {self.prac!r}")
        check_rounding(self, self.rounding)

    @property
    def identity(self) -> bool:
        """Stores everything as it is (``none``: no bits, no PRAC)."""
        return self.bits == 0 and self.prac is None

    def outliers_for(self, last_dim: int, bits: int) -> int:
        """How many channels of a ``last_dim``-wide tensor coded at ``bits`` are kept exact."""
        if bits == 8 or self.outliers == 0.0:
            return 0
        return min(max(1, math.ceil(self.outliers * last_dim)), last_dim)

    def group_for(self, last_dim: int, bits: int | None = None) -> tuple[int, int]:
        """(bits, group) for a tensor whose last dimension is ``last_dim`` (module docstring);
        ``bits`` overrides the codec's (attention tensors). INT8 keeps one scale per row."""
        bits = self.bits if bits is None else bits
        if bits == 8:
            return 8, last_dim
        g = last_dim if self.group_size == 0 else math.gcd(last_dim, self.group_size)
        if g < 8 or last_dim % _ROW_MULTIPLE[bits]:
            return 8, last_dim  # odd shapes: one INT8 scale per row
        return bits, g


CODECS: dict[str, CompiledCodec] = {
    "none": CompiledCodec(bits=0),
    "int8": CompiledCodec(bits=8),
    "int6": CompiledCodec(bits=6),  # SDPA's v and output INT8, q and k exact (module docstring)
    "int4": CompiledCodec(bits=4, group_size=32, attention_bits=8),
    "int4-outlier": CompiledCodec(bits=4, group_size=32, attention_bits=8, outliers=1 / 128),
    # prac.txt's rule: linear inputs at 0.3n + 0.3n, other saves at 0.2n + 0.2n, SDPA's exact
    "prac": CompiledCodec(bits=0, attention_bits=0, prac=TracedPrac()),
}

# earlier names, still read (a saved compiled plan, a spec): old -> the name in CODECS
RENAMED = {"outlier-int4": "int4-outlier"}  # the eager codecs' word order (``int4-outlier``)


def canonical_codec(name: str) -> str:
    """``name`` with an earlier codec name replaced by its name in :data:`CODECS` (``-sr``
    kept): ``outlier-int4-sr`` -> ``int4-outlier-sr``; any other name as it is."""
    base = name.removesuffix(SR_SUFFIX)
    return RENAMED[base] + name[len(base) :] if base in RENAMED else name


# Python calls of the traced helpers: they run while AOTAutograd traces, never per step once the
# hooks are inlined (the tests check that these stop growing after the first compiled step).
TRACE_CALLS = {"pack": 0, "unpack": 0}


# ----------------------------------------------------------------------------- the codec math
def _attention_role(node: torch.fx.Node | None) -> str | None:
    """``"lse"`` (SDPA's logsumexp and other statistics it returns), ``"attention"`` (SDPA's
    output, or a tensor SDPA reads as v), ``"qk"`` (a tensor SDPA reads only as q or k),
    ``"mask"`` (a tensor SDPA reads only as its attention mask: an additive ``{0, -inf}`` mask
    quantized would decode to NaN, so it stays exact) or None, from the saved node of the
    forward graph."""
    if node is None:
        return None
    if node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        if _SDPA in str(node.args[0].target):
            return "attention" if (node.args[1] if len(node.args) > 1 else 0) == 0 else "lse"
    reads = [u for u in node.users if _SDPA in str(u.target)]
    if not reads:
        return None
    if all(node not in u.args[:3] for u in reads):
        return "mask"  # its attention mask / bias (args[3] or a keyword): never quantized
    as_qk = all(node in u.args[:2] and node not in u.args[2:] for u in reads)
    return "qk" if as_qk else "attention"


def _role_bits(codec: CompiledCodec, role: str | None) -> int | None:
    """Bits for an SDPA role (None: the codec's own)."""
    if role in ("lse", "mask"):
        return 0
    if role == "qk":
        return codec.attention_bits if codec.qk_bits is None else codec.qk_bits
    return codec.attention_bits if role == "attention" else None


def saved_node() -> torch.fx.Node | None:
    """The forward-graph node whose value the pack is tracing (None outside AOTAutograd)."""
    ctx = _get_saved_tensor_hook_context() if _get_saved_tensor_hook_context else None
    return ctx.get("_node") if ctx else None


def _small(x: torch.Tensor, codec: CompiledCodec) -> bool:
    """Fewer than ``min_numel`` values, for certain: under dynamic shapes a size-dependent count
    is not guarded on (that would compile again for every length crossing the threshold), so a
    graph for symbolic sizes encodes such a tensor, which is correct at any size."""
    return statically_known_true(x.numel() < codec.min_numel)


def keeps_exact(codec: CompiledCodec, x: torch.Tensor) -> bool:
    """The shape rules: what the pack leaves as it is (module docstring)."""
    return (
        codec.identity
        or not x.is_floating_point()
        or x.dim() < 2
        or x.shape[-1] == 1
        or _small(x, codec)
    )


def packs_mask(codec: CompiledCodec, x: torch.Tensor) -> bool:
    """Is ``x`` a boolean mask the codec stores as bits (8 values a byte)?"""
    return (
        codec.masks
        and not codec.identity
        and x.dtype == torch.bool
        and not _small(x, codec)
        and statically_known_true(x.numel() % 8 == 0)
    )


def choose(codec: CompiledCodec, x: torch.Tensor, node: torch.fx.Node | None = None):
    """(bits, group) for ``x``, or None to keep it exact: the shape rules, then SDPA's roles."""
    if keeps_exact(codec, x):
        return None
    bits = _role_bits(codec, _attention_role(node))
    bits = codec.bits if bits is None else bits
    return None if bits == 0 else codec.group_for(x.shape[-1], bits)


def prac_ranks(codec: CompiledCodec, x: torch.Tensor, node: torch.fx.Node | None = None):
    """(r1, r2) where the codec's PRAC takes ``x`` (never SDPA's tensors), else None."""
    if codec.prac is None or keeps_exact(codec, x) or _attention_role(node) is not None:
        return None
    return codec.prac.ranks(tuple(x.shape), x.element_size(), feeds_linear(node))


def memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that lays a dense but non-contiguous ``x`` out contiguously (its dims from
    the largest stride to the smallest), or None where ``x`` is contiguous or not dense.

    The codecs code ``x.permute(order)`` (a view: no copy) and the unpack permutes the decoded
    tensor back, so the backward receives a tensor with the *same strides* as the one the forward
    saved. That is the contract of a saved tensor: a compiled backward's kernels were chosen and
    laid out for the saved tensor's strides (SDPA's q, k, v and output are [B, H, S, D] views of
    [B, S, H, D] storage), and a decode that returns other strides hands them something else."""
    if x.dim() < 2 or x.is_contiguous():
        return None
    order = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    return order if x.permute(order).is_contiguous() else None


def inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(d) for d in range(len(order)))


def draw_uniform(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """U[0, 1) fp32 draws that inductor lowers to its own seeded RNG (as ``compiled/prac.py``'s
    ``draw_normal``; eagerly, ``torch.rand``)."""
    if not _SEEDED:  # pragma: no cover
        return torch.rand(shape, device=device)
    prims = torch.ops.prims
    seed = prims.inductor_lookup_seed.default(prims.inductor_seeds.default(1, device), 0)
    return prims.inductor_random.default(list(shape), seed, "rand")


def encode(codec: CompiledCodec, x: torch.Tensor, draw: Draw = draw_uniform) -> tuple:
    """Traceable pack: ``(x,)`` (kept) or :func:`encode_dense`'s payload of ``x`` in memory
    order, tagged ``(LAYOUT, inverse order, *payload)`` where that order is not ``x``'s own
    (:func:`memory_order`); :func:`decode` returns a tensor with ``x``'s shape and strides.
    ``draw``: stochastic rounding's uniform draws (shape, device) -> fp32 tensor."""
    order = memory_order(x)
    if order is None:
        return encode_dense(codec, x, draw)
    payload = encode_dense(codec, x.permute(order), draw)
    return (x,) if len(payload) == 1 else (LAYOUT, inverse(order), *payload)


def encode_dense(codec: CompiledCodec, x: torch.Tensor, draw: Draw = draw_uniform) -> tuple:
    """The pack of a tensor in its logical order: ``(x,)`` (kept),
    ``(bits uint8, torch.bool, *shape)`` (a mask), ``(z, p, dtype, "prac")`` (PRAC,
    ``compiled/prac.py``), or ``(codes uint8, scale fp32, dtype, bits)``, plus ``(outlier
    columns [rows, k] in x's dtype, their indices [k])`` when the codec keeps some."""
    if packs_mask(codec, x):
        return (pack_bits(x), torch.bool, *x.shape)
    node = saved_node()
    ranks = prac_ranks(codec, x, node)
    if ranks is not None:
        return encode_prac(x, *ranks, codec.prac)
    chosen = choose(codec, x, node)
    if chosen is None:
        return (x,)
    bits, g = chosen
    half, (lead, d) = 1 << (bits - 1), (x.shape[:-1], x.shape[-1])
    xf, exact = x.float(), ()
    k = codec.outliers_for(d, bits)
    if k:  # the k channels of largest absolute sum: stored as they are, zeroed before coding
        idx = outlier_channels(x, k)
        exact = (x.reshape(-1, d).index_select(1, idx), idx)  # [rows, k], [k]
        xf = xf.index_fill(-1, idx, 0.0)
    xg = xf.reshape(*lead, d // g, g)
    scale = xg.abs().amax(-1, keepdim=True) / float(half - 1)
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-30), 0.0)
    r = 0.5 if codec.rounding == "nearest" else draw(tuple(xg.shape), xg.device)
    u = (torch.floor(xg * inv + r).clamp(-half, half - 1) + half).to(torch.uint8)
    return (pack_codes(u.reshape(*lead, -1), bits), scale.reshape(*lead, -1), x.dtype, bits, *exact)


def outlier_channels(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [k] of the last dimension's channels with the largest ``sum |x|`` over all rows
    (adacc.txt §3.2's channel score; a static count k, as a compiled graph needs)."""
    return x.reshape(-1, x.shape[-1]).float().abs().sum(0).topk(k).indices


def decode(payload: tuple) -> torch.Tensor:
    """Traceable unpack of :func:`encode`'s payload: the saved tensor's shape and strides."""
    if isinstance(payload[0], str) and payload[0] == LAYOUT:
        return decode(payload[2:]).permute(payload[1])
    if len(payload) == 1:
        return payload[0]
    if payload[1] is torch.bool:  # a mask: (bits, torch.bool, *shape)
        return unpack_bits(payload[0], tuple(payload[2:]))
    if is_prac(payload):  # (z, p, dtype, "prac")
        return decode_prac(payload)
    codes, scale, dtype, bits, *exact = payload
    lead, groups = scale.shape[:-1], scale.shape[-1]
    codes = unpack_codes(codes, bits)
    y = (codes.float() - (1 << (bits - 1))).reshape(*lead, groups, -1) * scale.unsqueeze(-1)
    y = y.reshape(*lead, -1).to(dtype)
    if exact:  # the outlier channels, as they were
        cols, idx = exact
        y = y.reshape(-1, y.shape[-1]).index_copy(1, idx, cols).reshape(y.shape)
    return y


def encode_ref(codec: CompiledCodec, x: torch.Tensor, seed: int = 0) -> Quantized | None:
    """The reference: ``quantize_ref`` on the flat order of ``x`` in memory
    (:func:`memory_order`) with the group :func:`encode` uses (None where the tensor is kept
    exact by the shape rules); outlier channels zeroed (``keep_cols``), as :func:`encode` codes
    them; stochastic rounding with the eager hash's draws of ``seed``."""
    order = memory_order(x)
    x = x if order is None else x.permute(order)
    chosen = choose(codec, x)
    if chosen is None:
        return None
    keep, k = None, codec.outliers_for(x.shape[-1], chosen[0])
    if k:
        keep = torch.ones(x.shape[-1], dtype=torch.bool).index_fill(0, outlier_channels(x, k), 0)
    return quantize_ref(
        x, bits=chosen[0], group_size=chosen[1], keep_cols=keep, rounding=codec.rounding, seed=seed
    )


def decode_ref(q: Quantized, like: torch.Tensor) -> torch.Tensor:
    order = memory_order(like)
    if order is None:
        return dequantize_ref(q, dtype=like.dtype).view(like.shape)
    y = dequantize_ref(q, dtype=like.dtype).view(like.permute(order).shape)
    return y.permute(inverse(order))


# ----------------------------------------------------------------------------- the hook pair
@torch.fx.wrap
def _pack(codec: CompiledCodec, x: torch.Tensor) -> tuple:
    TRACE_CALLS["pack"] += 1
    return encode(codec, x)


@torch.fx.wrap
def _unpack(payload: tuple) -> torch.Tensor:
    TRACE_CALLS["unpack"] += 1
    return decode(payload)


class _Pack(nn.Module):
    def __init__(self, codec: CompiledCodec) -> None:
        super().__init__()
        self.codec = codec

    def forward(self, x):
        return _pack(self.codec, x)


class _Unpack(nn.Module):
    def forward(self, payload):
        return _unpack(payload)


@functools.cache
def hook_pair(codec: CompiledCodec | str) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The (pack, unpack) ``GraphModule`` pair of ``codec``, built once (dynamo guards on ids)."""
    codec = resolve_codec(codec)
    return torch.fx.symbolic_trace(_Pack(codec)), torch.fx.symbolic_trace(_Unpack())


def codec_names() -> list[str]:
    """The names :func:`resolve_codec` takes: :data:`CODECS`, and the quantizing ones with
    ``-sr`` appended."""
    sr = [f"{n}{SR_SUFFIX}" for n, c in CODECS.items() if c.bits and c.prac is None]
    return [*CODECS, *sr]


def resolve_codec(codec: CompiledCodec | str) -> CompiledCodec:
    """A traced codec, or its name: one of :data:`CODECS`, or one of them with ``-sr``
    appended (stochastic rounding: ``int4-sr``)."""
    if isinstance(codec, CompiledCodec):
        return codec
    if isinstance(codec, str):
        codec = canonical_codec(codec)
    base = codec.removesuffix(SR_SUFFIX) if isinstance(codec, str) else codec
    found = CODECS.get(base) if isinstance(base, str) else None
    if found is None or (base != codec and (found.bits == 0 or found.prac is not None)):
        raise ValueError(
            f"unknown compiled codec {codec!r}; valid: {', '.join(codec_names())} (the -sr "
            f"forms round stochastically)"
        )
    if base != codec:
        return dataclasses.replace(found, rounding="stochastic")
    return found


@contextmanager
def codec_hooks(codec: CompiledCodec | str):
    """Enter the traced pair (and its filtering mode): compiled calls inside inline the codec."""
    codec = resolve_codec(codec)
    pack, unpack = hook_pair(codec)
    with (
        functorch_config.patch(saved_tensors_hooks_filtering_mode=codec.filtering),
        torch.autograd.graph.saved_tensors_hooks(pack, unpack),
    ):
        yield
