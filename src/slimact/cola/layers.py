"""``CoLALinear``: the low-rank auto-encoder layer of CoLA (cola.txt §3.2, Eq. 3).

A full-rank projection ``h = W x`` (W: d_out × d_in) becomes

    h' = B σ(A x),      A: r × d_in,  B: d_out × r,  1 <= r < min(d_in, d_out)

with a nonlinearity σ *inside* the bottleneck. Parameters and GEMM FLOPs drop from d_in·d_out to
r·(d_in + d_out) (a d×d layer at r = d/4 keeps half), and the activation is rank r by construction:
B cannot be folded into the next layer's A because of the residual stream and the nonlinearities
in between, so this is a different architecture, not a compressed W. σ is SiLU for LLaMA-style
models and tanh-GELU for GPT-2/BERT-style ones; ``"identity"`` gives the plain factorisation
(``B A x``) of cola.txt Table 10's "only full-rank σ" ablation.

Autograd saves x (for ∇A), A x (for σ') and σ(A x) (for ∇B): d_in + 2r values per token per layer
(x is shared by the q/k/v and gate/up layers). CoLA-M (``slimact.cola.colam``) keeps only A x.

Initialisation (the paper specifies none; this is our choice and its justification):

- ``A ~ N(0, 1/d_in)``: for a unit-RMS input (every CoLA layer reads an RMSNorm/LayerNorm output or
  a sum of such) the pre-activation z = A x has unit variance, so σ starts in its nonlinear
  regime rather than in SiLU's near-linear or near-zero region.
- ``B ~ N(0, s²)`` with ``s = target_std · sqrt(d_in / (r · E[σ(z)²]))``, z ~ N(0, 1), so that
  ``Var(h') = d_in · target_std² · Var(x)``: the output has the same scale as the full-rank layer
  it replaces would have with weights N(0, target_std²). The models pass the LLaMA/GPT-2 init
  (0.02, and 0.02/sqrt(2L) for the residual-branch outputs o_proj/down_proj), so a CoLA model
  starts with the same activation scales as its full-rank twin and the same optimiser settings
  (cola.txt App. D uses the full-rank lr schedule) apply. ``E[σ(z)²]`` is computed exactly by
  Gauss-Hermite quadrature. Without ``target_std`` the layer matches ``nn.Linear``'s default scale
  (Kaiming-uniform, std 1/sqrt(3·d_in)).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "identity")


def make_activation(name: str) -> nn.Module:
    """The module for a CoLA bottleneck nonlinearity; ``name`` in :data:`ACTIVATIONS`."""
    if name == "silu":
        return nn.SiLU()
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    if name == "identity":
        return nn.Identity()
    raise ValueError(f"unknown CoLA activation {name!r}; valid: {', '.join(ACTIVATIONS)}")


def activation_fn(name: str):
    """The functional form of :func:`make_activation` (used by fused CoLA-M ops)."""
    fns = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
        "relu": F.relu,
        "identity": lambda z: z,
    }
    if name not in fns:
        raise ValueError(f"unknown CoLA activation {name!r}; valid: {', '.join(ACTIVATIONS)}")
    return fns[name]


@functools.cache
def second_moment(name: str) -> float:
    """E[σ(z)²] for z ~ N(0, 1), by 80-point Gauss-Hermite quadrature (exact to ~1e-12)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    z = torch.from_numpy(nodes)
    vals = activation_fn(name)(z).numpy()
    return float((weights * vals**2).sum() / math.sqrt(2 * math.pi))


def check_rank(rank: int, d_in: int, d_out: int, what: str = "CoLALinear") -> None:
    """rank must be an int in [1, min(d_in, d_out) - 1] (cola.txt: r < min(d_in, d_out))."""
    hi = min(d_in, d_out) - 1
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= hi:
        raise ValueError(
            f"{what}: rank must be an integer in [1, {hi}] (below min(d_in, d_out) = "
            f"{min(d_in, d_out)} for a {d_in}->{d_out} layer), got {rank!r}"
        )


class CoLALinear(nn.Module):
    """``y = B σ(A x) (+ bias)``; drop-in for ``nn.Linear(d_in, d_out)``.

    Children ``cola_a`` (``nn.Linear(d_in, rank)``, no bias), ``act`` and ``cola_b``
    (``nn.Linear(rank, d_out, bias=bias)``), so saved tensors get site names such as
    ``layers.0.self_attn.q_proj.act:silu#0``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        activation: str = "silu",
        bias: bool = False,
        *,
        target_std: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("d_in", d_in), ("d_out", d_out)):
            if not isinstance(v, int) or v < 2:
                raise ValueError(f"CoLALinear: {name} must be an integer >= 2, got {v!r}")
        check_rank(rank, d_in, d_out)
        self.in_features, self.out_features, self.rank = d_in, d_out, rank
        self.activation = activation
        self.cola_a = nn.Linear(d_in, rank, bias=False, device=device, dtype=dtype)
        self.act = make_activation(activation)
        self.cola_b = nn.Linear(rank, d_out, bias=bias, device=device, dtype=dtype)
        self.reset_parameters(target_std)

    def reset_parameters(self, target_std: float | None = None) -> None:
        """Variance-matched init (module docstring); ``target_std`` = full-rank weight std."""
        if target_std is None:
            target_std = 1.0 / math.sqrt(3 * self.in_features)
        if not target_std > 0:
            raise ValueError(f"target_std must be > 0, got {target_std}")
        b_std = target_std * math.sqrt(
            self.in_features / (self.rank * second_moment(self.activation))
        )
        nn.init.normal_(self.cola_a.weight, std=1.0 / math.sqrt(self.in_features))
        nn.init.normal_(self.cola_b.weight, std=b_std)
        if self.cola_b.bias is not None:
            nn.init.zeros_(self.cola_b.bias)

    @property
    def A(self) -> torch.Tensor:  # noqa: N802 (paper notation)
        return self.cola_a.weight

    @property
    def B(self) -> torch.Tensor:  # noqa: N802
        return self.cola_b.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.cola_b.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., d_in) -> z: (..., r) -> y: (..., d_out)
        z = self.cola_a(x)
        if self.__dict__.get("_emit_z", False):  # CoLA-M: the caller applies σ and B itself
            return z
        return self.cola_b(self.act(z))

    def extra_repr(self) -> str:
        return (
            f"{self.in_features} -> {self.rank} -> {self.out_features}, "
            f"activation={self.activation}, bias={self.cola_b.bias is not None}"
        )


def cola_linear(
    x: torch.Tensor,
    a_weight: torch.Tensor,
    b_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Functional ``B σ(A x) + bias`` (the reference every fused path is tested against)."""
    return F.linear(activation_fn(activation)(F.linear(x, a_weight)), b_weight, bias)


def cola_linears(model: nn.Module) -> dict[str, CoLALinear]:
    """Every ``CoLALinear`` in ``model`` by path."""
    return {p: m for p, m in model.named_modules() if isinstance(m, CoLALinear)}
