"""``invact`` / ``invact-act``: the inverted-activation strategies (invact.txt).

``invact-act`` is the paper as published: every GELU / tanh-GELU / SiLU saves ``y`` + 1 bit
instead of ``x``. ``invact`` also inverts RMSNorm / LayerNorm (``y`` + rstd instead of ``x``).
Both are the ``reformulate`` action applied to every candidate the probe accepts; how candidates
are found, verified and swapped is ``slimact.reformulate``'s.
"""

from __future__ import annotations

from slimact.reformulate import InvActConfig, apply_invact
from slimact.registry import register_strategy

register_strategy(
    "invact",
    InvActConfig(),
    apply_invact,
    "inverted GELU/SiLU (y + 1 bit) and RMSNorm/LayerNorm (y + rstd) saving outputs (invact.txt)",
    compile_safe=True,
)
register_strategy(
    "invact-act",
    InvActConfig(norms=False),
    apply_invact,
    "invact.txt as published: inverted GELU/SiLU only (y + 1 bit instead of x)",
    compile_safe=True,
)
