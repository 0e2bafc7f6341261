"""The action vocabulary: what slimact does with one saved tensor, spelled one way everywhere.

Every tensor autograd saves for backward is a *site*; a plan gives each site one of five actions:

    keep                      store it as it is (a checkpoint's input is kept too)
    recompute                 do not store it: the module that made it runs again in backward
    codec:<name>[/<params>]   store it through a codec, e.g. ``codec:int4-outlier-g16`` or
                              ``codec:prac/r1=0.5`` (parameters that differ from the registered
                              codec's defaults), with ``:exact`` appended when the codec met a
                              value it cannot represent and stored the tensor exactly
    reformulate:<op>          the op was replaced by one that saves less (``reformulate:inv_silu``,
                              ``reformulate:inv_rms_norm``, ``reformulate:chunked_ce`` ...); the
                              tensors the new op saves carry this action, and so does the module
                              in a plan
    offload                   store it in pinned host memory: copied out on a side stream after
                              it is made, copied back one block ahead of its use in backward
                              (CUDA only; lossless; ``codecs/offload.py``). The codec spelling
                              ``codec:offload`` of older plans reads as ``offload``
    offload+codec:<name>      store it through a codec, then offload the payload (fewer bytes
                              cross the link; the codec's error), e.g. ``offload+codec:int8``

Plans (``Plan.site_actions``, ``Plan.table``), the meter's per-site report, ``slimact plan`` and
the benchmark tables use these words. Layer 0: this module imports nothing from slimact.
"""

from __future__ import annotations

from dataclasses import dataclass

KEEP = "keep"
RECOMPUTE = "recompute"
CODEC = "codec"
REFORMULATE = "reformulate"
OFFLOAD = "offload"
KINDS = (KEEP, RECOMPUTE, CODEC, REFORMULATE, OFFLOAD)
OFFLOAD_CODEC = "offload"  # the codec that implements the offload action (``codecs/offload.py``)
THEN = "+"  # offload+codec:<label>: the codec's payload offloaded (codec label offload+<label>)
EXACT = ":exact"  # suffix of a codec action whose codec stored the tensor exactly

# ops (site roles) that exist only because a module was reformulated: their saves are the
# reformulation's, so the meter reports them as reformulate:<op>
REFORMULATED_OPS = frozenset(
    {
        "inv_silu",
        "inv_gelu",
        "inv_gelu_tanh",
        "inv_rms_norm",
        "inv_layer_norm",
        "chunked_ce",
        "rms_norm",  # prac's input-saving RMSNorm
    }
)

# legacy spellings (plans saved before the vocabulary) -> action
_LEGACY = {"dropped": RECOMPUTE, "not stored": RECOMPUTE, "checkpoint input": KEEP, "hold": KEEP}


@dataclass(frozen=True)
class Action:
    kind: str  # one of KINDS
    detail: str = ""  # codec label (with parameters) or reformulated op; "" for keep/recompute
    exact: bool = False  # a codec action that stored its tensor exactly

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.kind != OFFLOAD and (self.kind in (CODEC, REFORMULATE)) != bool(self.detail):
            raise ValueError(f"action {self.kind!r} needs a detail iff it is codec/reformulate")

    def __str__(self) -> str:
        if not self.detail:
            return self.kind
        if self.kind == OFFLOAD:  # the detail is the codec whose payload was offloaded
            return f"{OFFLOAD}{THEN}{Action(CODEC, self.detail, self.exact)}"
        return f"{self.kind}:{self.detail}" + (EXACT if self.exact else "")


def codec(label: str, exact: bool = False) -> str:
    """``codec:<label>`` (``label``: a codec label, see ``slimact.codecs.base.codec_label``);
    the offload codec's label is the action ``offload``, ``offload+<label>`` is
    ``offload+codec:<label>``."""
    if label == OFFLOAD_CODEC:
        return OFFLOAD
    if label.startswith(OFFLOAD_CODEC + THEN):
        return str(Action(OFFLOAD, label[len(OFFLOAD_CODEC + THEN) :], exact))
    return str(Action(CODEC, label, exact))


def reformulate(op: str) -> str:
    return str(Action(REFORMULATE, op))


def parse(text: str) -> Action:
    """An action string (or a legacy spelling) -> ``Action``; raises on anything else."""
    text = _LEGACY.get(text, text)
    if text in (KEEP, RECOMPUTE, OFFLOAD, f"{CODEC}:{OFFLOAD_CODEC}"):
        return Action(OFFLOAD if text.startswith(CODEC) else text)
    if text.startswith(OFFLOAD + THEN):
        try:
            inner = parse(text[len(OFFLOAD + THEN) :])
        except ValueError:
            inner = None  # refused below, naming the whole text
        if inner is not None and inner.kind == CODEC:
            return Action(OFFLOAD, inner.detail, inner.exact)
    kind, sep, detail = text.partition(":")
    if sep and kind in (CODEC, REFORMULATE) and detail:
        exact = kind == CODEC and detail.endswith(EXACT)
        return Action(kind, detail[: -len(EXACT)] if exact else detail, exact)
    raise ValueError(
        f"unknown action {text!r}; valid: keep, recompute, codec:<name>, reformulate:<op>, "
        "offload, offload+codec:<name>"
    )


def normalize(text: str) -> str:
    """A plan row's action in the vocabulary: legacy words mapped, a bare codec name (what plans
    saved before the vocabulary wrote) prefixed with ``codec:``."""
    try:
        return str(parse(text))
    except ValueError:
        return codec(text)


FUSED_RMS = "rms-norm"  # the kind of PRAC's fused RMSNorm in plans (``reformulate/norms.py``)


def reform_op(kind: str) -> str:
    """The op a reformulation kind swaps in: ``invact:silu`` -> ``inv_silu``, ``invnorm:rms`` ->
    ``inv_rms_norm``, ``chunked-ce`` -> ``chunked_ce`` (the names its saves are reported under)."""
    family, _, k = kind.partition(":")
    if family == "invact" and k:
        return f"inv_{k}"
    if family == "invnorm" and k:
        return f"inv_{k}_norm"
    return kind.replace("-", "_")


def for_role(role: str | None) -> str:
    """The action of a tensor saved as is under op/role ``role`` (no codec involved)."""
    if role in REFORMULATED_OPS:
        return reformulate(role)
    return KEEP


__all__ = [
    "CODEC",
    "EXACT",
    "KEEP",
    "FUSED_RMS",
    "KINDS",
    "OFFLOAD",
    "OFFLOAD_CODEC",
    "RECOMPUTE",
    "THEN",
    "REFORMULATE",
    "Action",
    "codec",
    "for_role",
    "normalize",
    "parse",
    "reform_op",
    "reformulate",
]
