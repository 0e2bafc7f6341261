"""Site and module classification: what a saved tensor is, what a module computes.

One place for the questions every strategy and the planner ask:

* a **site** ``"<module path>:<op>#k"`` (``slimact.sites``) names the k-th tensor ``op`` saved
  inside a module; ``parse_site`` splits it, ``role_of(site, t)`` says what the tensor is for a
  lossy codec: ``act`` (inputs of linears, norms, activations), ``qk`` (fused SDPA's q and k),
  ``qkv`` (other attention operands: SDPA's v, an unfused attention's matmul operands),
  ``scores`` (softmax outputs, [.., S, S] operands), ``mask`` (dropout masks, 0/1 tensors, SDPA's
  additive ``{0, -inf}`` attention mask: two-valued, packed losslessly), or
  None (keep exact: statistics, losses, ids, constants, tensors below ``min_numel``). Fused
  SDPA's q and k are a role of their own because its backward *recomputes* the probabilities
  from them, ``P = exp(q k^T / sqrt(d) - lse)`` against the exact saved logsumexp: an error δ
  in a logit multiplies its probability by ``e^δ``, and δ grows with the logits as training
  sharpens attention (an unfused attention saves P itself; its q/k errors stay linear);
  ``site_role(site, t, min_numel, sdpa_out)`` is ``role_of`` with SDPA's output optionally an
  ``act`` tensor (adacc.txt's rules: the role a plan's ``SiteRule`` maps to a codec);
  the channel count of its memory-order view (per-channel codecs) is
  ``slimact.codecs.saving.hidden_channels``;
* a **module** is an activation the inverted ops can replace (``is_activation_leaf`` by name and
  shape of the module, ``classify_activation`` by behaviour on a probe grid: gelu, gelu_tanh or
  silu), or a norm they can invert (``classify_norm``: LayerNorm, or an RMSNorm whose forward is
  ``w * x * rsqrt(mean(x^2) + eps)``).

* a **call**: ``label_arg`` finds the forward's label parameter (``targets`` or ``labels``),
  ``call_batch`` the token ids and labels of one call.

Everything here is pure inspection: nothing is patched, nothing registered.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch
import torch.nn as nn

from slimact import sites
from slimact.codecs.bits import is_binary, two_valued
from slimact.ops.inv_act import act_ref
from slimact.ops.inv_act_approx import KINDS
from slimact.ops.inv_norm import rms_norm_ref

ROLES = ("act", "qk", "qkv", "scores", "mask")
ACT_OPS = frozenset(
    {
        "linear",
        "addmm",
        "layer_norm",
        "rms_norm",
        "group_norm",
        "pow",
        "mul",
        "tanh",
        "gelu",
        "silu",
        "relu",
    }  # addmm: HF GPT-2's Conv1D; tanh: the tanh-GELU written out (HF NewGELU)
)
KEEP_OPS = frozenset({"cross_entropy", "nll_loss", "log_softmax", "embedding"})
MASK_OPS = frozenset({"dropout", "feature_dropout", "scaled_dot_product_attention"})
ATTN_OPS = frozenset({"scaled_dot_product_attention", "matmul", "bmm", "baddbmm"})
ACT_NAME = re.compile(r"gelu|silu|swish|act", re.IGNORECASE)
MATCH_TOL = 1e-5  # max |diff| on the probe grid to accept an activation as kind k


def parse_site(site: str) -> tuple[str, str, int]:
    """``"layers.0.mlp:silu#0"`` -> ``("layers.0.mlp", "silu", 0)``."""
    module, _, rest = site.rpartition(":")
    op, _, k = rest.rpartition("#")
    return module, op, int(k) if k.isdigit() else 0


SDPA_OPERANDS = ("q", "k", "v")


def _same_tensor(a: object, t: torch.Tensor) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.device == t.device
        and a.dtype == t.dtype
        and a.shape == t.shape
        and a.stride() == t.stride()
        and a.storage_offset() == t.storage_offset()
        and a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    )


def sdpa_operand(t: torch.Tensor) -> str | None:
    """Which operand of the running ``scaled_dot_product_attention`` call the saved ``t`` is:
    ``"q"``, ``"k"``, ``"v"`` (its first three arguments), ``"other"`` (a tensor that is none of
    them: the attention mask, or one the kernel made: its output, logsumexp, a converted mask), or
    None when no SDPA call is running under the site router (the ordinal rule applies then).

    The save ordinal cannot tell: CPU's fused kernel saves ``k, q, v, lse, out`` without a mask
    and ``mask, k, q, v, lse, out`` with one, so ``#2`` is v in one call and q in the other."""
    args = sites._state.op_args if sites._state.op == "scaled_dot_product_attention" else ()
    if not args:
        return None
    for name, a in zip(SDPA_OPERANDS, args[:3], strict=False):
        if _same_tensor(a, t):
            return name
    return "other"


def role_of(site: str, t: torch.Tensor, min_numel: int = 1024) -> str | None:
    """The role of a saved tensor (``act``/``qk``/``qkv``/``scores``/``mask``, module docstring)
    or None to keep it."""
    _, op, k = parse_site(site)
    if not t.is_floating_point():
        # an inverted op's uint8 save is its packed sign bits (8 per byte), never a 0/1 mask:
        # left as it is without reading it (the read would be a device-to-host sync)
        if t.dtype == torch.bool or (
            t.dtype == torch.uint8 and not op.startswith("inv_") and is_binary(t)
        ):
            return "mask"
        return None
    if op == "scaled_dot_product_attention":
        return _sdpa_role(t, k, min_numel)
    if not t.requires_grad and op in MASK_OPS and t.numel() >= min_numel:
        return "mask" if two_valued(t) is not None else None  # CPU dropout noise {0, 1/(1-p)}
    if not t.requires_grad or t.numel() < min_numel or t.dim() == 0 or t.shape[-1] == 1:
        return None
    if op in KEEP_OPS:
        return None
    if op in ("softmax", "_softmax"):
        return "scores"
    if op in ATTN_OPS:
        if t.dim() != 4:
            return "act"
        return "scores" if t.shape[-1] == t.shape[-2] else "qkv"
    if op in ACT_OPS or "silu" in op or "gelu" in op:
        return "act"
    return None


def _sdpa_role(t: torch.Tensor, k: int, min_numel: int) -> str | None:
    """:func:`role_of` of a tensor SDPA saves: q and k ``qk``, v ``qkv``; a mask (no grad: an
    additive ``{0, -inf}`` mask, a bool mask converted to one, a CPU dropout noise) ``mask``
    where it is two-valued (packed losslessly), else kept; output and logsumexp kept; in SDPA's
    math path (CPU, dropout on) what it saves is made inside it (scaled q, probabilities) and
    kept. The operand is read off the running call (:func:`sdpa_operand`), else from the
    ordinal (q, k, v first)."""
    if t.numel() < min_numel or t.dim() != 4 or t.shape[-1] == 1:
        return None  # small, or its logsumexp: never read (on a GPU, a sync at every save)
    which = sdpa_operand(t)
    if not t.requires_grad:
        if which in SDPA_OPERANDS:
            return None  # a frozen operand: kept as it is
        return "mask" if two_valued(t) is not None else None
    if which is None:
        which = SDPA_OPERANDS[k] if k < 3 else "other"
    return "qk" if which in ("q", "k") else "qkv" if which == "v" else None


def is_sdpa_output(site: str, t: torch.Tensor) -> bool:
    """SDPA's saved output: a 4-D save that is none of its operands (under the router), else
    one after q, k, v (the logsumexp is 3-D or ends in 1)."""
    _, op, k = parse_site(site)
    if op != "scaled_dot_product_attention" or t.dim() != 4 or t.shape[-1] == 1:
        return False
    which = sdpa_operand(t)
    return which == "other" if which is not None else k >= 3


def site_role(
    site: str, t: torch.Tensor, min_numel: int = 1024, sdpa_out: bool = False
) -> str | None:
    """``role_of``, with SDPA's output an ``act`` tensor when ``sdpa_out`` (adacc.txt)."""
    role = role_of(site, t, min_numel)
    if role is None and sdpa_out and t.is_floating_point() and t.requires_grad:
        if t.numel() >= min_numel and is_sdpa_output(site, t):
            return "act"
    return role


_NORMS = (nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
_NONLINEAR = (nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.Softplus)
_NONLINEAR_NAMES = ("silu", "gelu", "swish", "relu")


def is_norm(module: nn.Module) -> bool:
    """A normalization module: torch's LayerNorm/RMSNorm or any class named ``*Norm``."""
    return isinstance(module, _NORMS) or type(module).__name__.endswith("Norm")


def is_nonlinearity(module: nn.Module) -> bool:
    """An elementwise nonlinearity module (any of torch's common ones, or named like one); wider
    than :func:`is_activation_leaf`, which finds the GELU/SiLU modules the inverted ops replace."""
    name = type(module).__name__.lower()
    return isinstance(module, _NONLINEAR) or any(a in name for a in _NONLINEAR_NAMES)


def is_activation_leaf(module: nn.Module) -> bool:
    """A parameterless, bufferless leaf whose class name mentions gelu/silu/swish/act."""
    return (
        not list(module.children())
        and not list(module.parameters(recurse=False))
        and not list(module.buffers(recurse=False))
        and bool(ACT_NAME.search(type(module).__name__))
    )


def classify_activation(module: nn.Module, device: torch.device) -> tuple[str | None, float]:
    """(kind, max |diff|) of the best-matching kind on a probe grid, kind None if none match."""
    z = torch.linspace(-8.0, 8.0, 641, device=device)
    try:
        with torch.no_grad():
            out = module(z.clone())
    except Exception:  # not an elementwise activation we can call on a vector
        return None, float("inf")
    if not isinstance(out, torch.Tensor) or out.shape != z.shape:
        return None, float("inf")
    best, err = None, float("inf")
    for kind in KINDS:
        e = float((out.float() - act_ref(z, kind)).abs().max())
        if e < err:
            best, err = kind, e
    return (best if err <= MATCH_TOL else None), err


def rms_eps(module: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon"):
        v = getattr(module, name, None)
        if isinstance(v, float):
            return v
    return None


def classify_norm(module: nn.Module, device: torch.device) -> tuple[str | None, str]:
    """('layer' | 'rms' | None, why-not)."""
    if isinstance(module, nn.LayerNorm):
        return "layer", ""
    if "rmsnorm" not in type(module).__name__.lower():
        return None, ""
    params = dict(module.named_parameters(recurse=False))
    w = params.get("weight")
    eps = rms_eps(module)
    if set(params) != {"weight"} or w is None or w.dim() != 1 or eps is None:
        return None, "RMSNorm without a single 1-D weight and a float eps"
    x = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(device, w.dtype)
    with torch.no_grad():
        got, want = module(x), rms_norm_ref(x, w, eps)
    if not torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-6):
        return None, "forward differs from w * x * rsqrt(mean(x^2) + eps) (e.g. a 1+w scale)"
    return "rms", ""


def label_arg(model: nn.Module) -> tuple[str, int] | None:
    """The forward's label parameter and its positional index (self excluded)."""
    return _label_arg_of(type(model))


@functools.cache
def _label_arg_of(cls: type) -> tuple[str, int] | None:  # read per root call: once per class
    params = list(inspect.signature(cls.forward).parameters)[1:]
    for name in ("labels", "targets"):
        if name in params:
            return name, params.index(name)
    return None


def call_batch(model: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, torch.Tensor | None]:
    """(token ids, labels) of a call ``model(*args, **kwargs)``: the ids first positional or
    ``input_ids``; the labels by the forward's label parameter (``targets``: slimact's models,
    ``labels``: Hugging Face's), positional or keyword; None where absent."""
    ids = args[0] if args else kwargs.get("input_ids")
    arg = label_arg(model)
    name, pos = arg if arg is not None else ("targets", 1)
    tgt = kwargs.get(name, args[pos] if len(args) > pos else None)
    return ids, tgt if isinstance(tgt, torch.Tensor) else None
