"""Effective rank of activations (cola.txt §3.1, Eq. 1, Fig. 2, App. A).

    r(α) = min { k : Σ_{i<=k} σ_i² / Σ_i σ_i² >= α },    0 < α <= 1

where σ_i are the singular values of an activation matrix X (rows = tokens, columns = features).
We never form the SVD of X: the squared singular values are the eigenvalues of the Gram matrix
G = XᵀX (d × d), which we accumulate in float64 over a few validation batches
(``activation_spectra``), so memory is d² per layer no matter how many tokens are seen.

The paper runs a pre-trained GPT-2 on WikiText2; offline we have no pre-trained weights, so the
analysis runs on a checkpoint written by ``slimact train`` over our validation split. Which
activations: the output of every projection (``nn.Linear`` in the blocks, or ``CoLALinear``) and
of the MLP nonlinearity (``mlp.act_fn`` / ``mlp.act``), i.e. Fig. 2's "MLP activation" and App. A's
Q/K/V. ``plot_spectra`` draws Fig. 2: (a) singular-value decay per block, (b) full dimension vs
r(α) per block. ``slimact rank`` (``add_rank_arguments`` / ``run_rank``) runs it:

    slimact rank --model llama-20m --checkpoint runs/llama-20m-none-0 [--plot out.png --json]

It lives with training, not in ``slimact.cola``, because it reads ``slimact train``'s checkpoints
(``slimact.cola`` holds the layers and models, below training; ARCHITECTURE.md's layers).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_model

from slimact import sites
from slimact.cola.layers import CoLALinear
from slimact.data import ByteTokenizer, fixed_batches, load_data
from slimact.models import build_model
from slimact.train.checkpoint import MODEL_FILE, latest_checkpoint
from slimact.utils import require


def effective_rank(singular_values: torch.Tensor, alpha: float = 0.95) -> int:
    """Eq. 1: the fewest singular values keeping an ``alpha`` share of the spectral energy."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    s = singular_values.detach().double().flatten()
    if s.numel() == 0:
        raise ValueError("effective_rank needs at least one singular value")
    if torch.isnan(s).any():
        raise ValueError("effective_rank: singular values contain NaN")
    energy = torch.sort(s.square(), descending=True).values
    total = energy.sum()
    if total <= 0:
        return 0
    frac = torch.cumsum(energy, 0) / total
    # tolerance: cumulative sums of doubles may land a hair below an exact alpha
    return int(torch.searchsorted(frac, torch.tensor(alpha - 1e-12, dtype=frac.dtype))) + 1


def singular_values_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Singular values of X from G = XᵀX (eigenvalues clamped at 0), descending."""
    ev = torch.linalg.eigvalsh(gram.double())
    return ev.clamp_min(0).sqrt().flip(0)


def _kind(path: str) -> str:
    """'q_proj', 'mlp.act_fn' ... : the path without the block prefix."""
    return re.sub(r"^.*?\.\d+\.", "", path)


def default_targets(model: nn.Module) -> dict[str, nn.Module]:
    """Projections (Linear / CoLALinear) and MLP nonlinearities inside the blocks."""
    blocks = sites.block_paths(model)
    out = {}
    for path, m in model.named_modules():
        if not sites.block_of(path, blocks) or ".cola_" in path:
            continue
        is_act = path.endswith(("mlp.act_fn", "mlp.act")) and not isinstance(m, nn.Identity)
        if isinstance(m, (nn.Linear, CoLALinear)) or is_act:
            out[path] = m
    return out


@torch.no_grad()
def activation_spectra(
    model: nn.Module, batches: list[torch.Tensor], targets: dict[str, nn.Module] | None = None
) -> dict[str, torch.Tensor]:
    """Singular values of each target module's output over all tokens of ``batches``."""
    targets = default_targets(model) if targets is None else targets
    if not targets:
        raise ValueError("activation_spectra: no Linear/CoLALinear/MLP activation in any block")
    grams: dict[str, torch.Tensor] = {}

    def hook(path):
        def fn(module, args, out):
            x = out.detach().reshape(-1, out.shape[-1]).double()  # (tokens, features)
            g = x.t() @ x
            grams[path] = grams[path] + g if path in grams else g

        return fn

    handles = [m.register_forward_hook(hook(p)) for p, m in targets.items()]
    was_training = model.training
    model.eval()
    try:
        for x in batches:
            model(x)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return {p: singular_values_from_gram(g) for p, g in grams.items()}


@dataclass
class LayerRank:
    path: str
    block: str
    kind: str
    dim: int
    rank: int
    alpha: float

    @property
    def ratio(self) -> float:
        return self.rank / self.dim


def activation_ranks(
    model: nn.Module,
    batches: list[torch.Tensor],
    alpha: float = 0.95,
    targets: dict[str, nn.Module] | None = None,
) -> tuple[list[LayerRank], dict[str, torch.Tensor]]:
    """r(α) of every target's output activations; also returns the spectra."""
    spectra = activation_spectra(model, batches, targets)
    blocks = sites.block_paths(model)
    rows = [
        LayerRank(
            p, sites.block_of(p, blocks), _kind(p), s.numel(), effective_rank(s, alpha), alpha
        )
        for p, s in spectra.items()
    ]
    return rows, spectra


def ranks_to_json(rows: list[LayerRank]) -> list[dict]:
    return [{**asdict(r), "ratio": r.ratio} for r in rows]


def plot_spectra(
    rows: list[LayerRank],
    spectra: dict[str, torch.Tensor],
    path: str | Path,
    kind: str | None = None,
    title: str = "",
) -> Path:
    """Fig. 2: (a) normalised singular values per block, (b) full dim vs r(α) per block."""
    require("matplotlib", "plot", "slimact rank's plots").use("Agg")
    plt = require("matplotlib.pyplot", "plot", "slimact rank's plots")

    kinds = sorted({r.kind for r in rows})
    if kind is None:
        kind = next((k for k in ("mlp.act_fn", "mlp.act", "mlp.up_proj") if k in kinds), kinds[0])
    if kind not in kinds:
        raise ValueError(f"kind {kind!r} not among the analysed activations: {', '.join(kinds)}")
    sel = [r for r in rows if r.kind == kind]
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    cmap = plt.get_cmap("viridis")
    for i, r in enumerate(sel):
        s = spectra[r.path]
        ax_a.semilogy((s / s[0]).numpy(), color=cmap(i / max(1, len(sel) - 1)), label=r.block)
    ax_a.set_xlabel("singular value index")
    ax_a.set_ylabel("σ_i / σ_1")
    ax_a.set_title(f"(a) singular value decay: {kind}")
    ax_a.legend(fontsize=7)
    xs = range(len(sel))
    ax_b.bar([x - 0.2 for x in xs], [r.dim for r in sel], width=0.4, label="full dimension")
    ax_b.bar([x + 0.2 for x in xs], [r.rank for r in sel], width=0.4, label=f"r({sel[0].alpha})")
    ax_b.set_xticks(list(xs), [r.block.rsplit(".", 1)[-1] for r in sel])
    ax_b.set_xlabel("block")
    ax_b.set_title(f"(b) full dimension vs effective rank: {kind}")
    ax_b.legend(fontsize=8, loc="center right", framealpha=0.9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def load_trained(model: str, checkpoint: str | Path) -> nn.Module:
    """Build ``model`` (byte vocabulary, as ``slimact train`` does) and load its weights.

    ``checkpoint`` is a run directory (its latest ``ckpt-*`` is used), a ``ckpt-N`` directory
    or a ``.safetensors`` file.
    """
    p = Path(checkpoint)
    if p.is_dir() and not (p / MODEL_FILE).exists():
        latest = latest_checkpoint(p)
        if latest is None:
            raise FileNotFoundError(f"no ckpt-* with {MODEL_FILE} under {p}")
        p = latest
    file = p / MODEL_FILE if p.is_dir() else p
    if not file.exists():
        raise FileNotFoundError(f"checkpoint file {file} does not exist")
    m = build_model(model, vocab_size=ByteTokenizer().vocab_size)
    missing, unexpected = load_model(m, str(file), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {file} does not fit model {model!r}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return m


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="registered model name the checkpoint is of")
    p.add_argument("--checkpoint", required=True, help="run dir, ckpt-N dir or .safetensors file")
    p.add_argument("--alpha", type=float, default=0.95, help="energy fraction α of Eq. 1")
    p.add_argument("--batches", type=int, default=4, help="validation batches")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--data", default=None, help="corpus (default: the embedded stdlib sources)")
    p.add_argument("--plot", default=None, help="write the Fig. 2-style PNG here")
    p.add_argument("--kind", default=None, help="activation to plot, e.g. mlp.act_fn")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_rank(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    model = load_trained(args.model, args.checkpoint)
    if args.seq > model.config.max_seq_len:
        raise ValueError(
            f"--seq {args.seq} exceeds the model's max_seq_len {model.config.max_seq_len}"
        )
    val = load_data(args.data).val
    batches = [x for x, _ in fixed_batches(val, args.batch, args.seq, args.batches)]
    rows, spectra = activation_ranks(model, batches, args.alpha)
    plot = None
    if args.plot:
        title = f"{args.model} ({args.checkpoint}), α={args.alpha}"
        plot = str(plot_spectra(rows, spectra, args.plot, args.kind, title))
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "checkpoint": str(args.checkpoint),
                    "alpha": args.alpha,
                    "tokens": sum(x.numel() for x in batches),
                    "plot": plot,
                    "layers": ranks_to_json(rows),
                }
            )
        )
        return 0
    print(f"{'activation':<40} {'dim':>6} {'r(α)':>6} {'ratio':>7}")
    for r in rows:
        print(f"{r.path:<40} {r.dim:>6} {r.rank:>6} {r.ratio:>7.3f}")
    if plot:
        print(f"plot: {plot}")
    return 0
