"""Effective rank r(α) (cola.txt Eq. 1, Fig. 2) and ``slimact rank`` on a trained checkpoint."""

import argparse
import json

import pytest
import torch

from slimact.models import build_model
from slimact.train.rank import (
    activation_ranks,
    activation_spectra,
    add_rank_arguments,
    effective_rank,
    load_trained,
    plot_spectra,
    run_rank,
    singular_values_from_gram,
)


def test_effective_rank_on_known_spectra():
    assert effective_rank(torch.tensor([3.0, 0.0, 0.0])) == 1
    flat = torch.ones(4)  # each value holds 25% of the energy
    assert effective_rank(flat, 0.5) == 2
    assert effective_rank(flat, 0.95) == 4
    assert effective_rank(flat, 1.0) == 4
    assert effective_rank(torch.tensor([0.1, 2.0]), 0.9) == 1  # order does not matter
    assert effective_rank(torch.zeros(3)) == 0


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_effective_rank_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        effective_rank(torch.ones(3), alpha)


def test_effective_rank_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        effective_rank(torch.tensor([1.0, float("nan")]))


def test_gram_spectrum_equals_svd_and_finds_planted_rank():
    torch.manual_seed(0)
    x = torch.randn(300, 3, dtype=torch.float64) @ torch.randn(3, 20, dtype=torch.float64)
    x += 1e-6 * torch.randn_like(x)
    s_svd = torch.linalg.svdvals(x)
    s_gram = singular_values_from_gram(x.t() @ x)
    torch.testing.assert_close(s_gram[:3], s_svd[:3], rtol=1e-8, atol=1e-8)
    assert effective_rank(s_gram, 0.9999) == 3


def test_spectra_accumulate_over_batches_like_one_big_batch():
    torch.manual_seed(0)
    m = build_model("llama-tiny")
    xs = [torch.randint(0, 257, (2, 16)) for _ in range(3)]
    a = activation_spectra(m, xs)
    b = activation_spectra(m, [torch.cat(xs)])
    for k in a:
        # the fp32 forward leaves a noise floor far below the top singular value
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6 * float(b[k][0]))
    assert "layers.0.mlp.act_fn" in a and "layers.1.self_attn.q_proj" in a and "lm_head" not in a


def test_cola_outputs_have_rank_at_most_r():
    """CoLA enforces low-rank activations by construction: B σ(A x) has rank <= r."""
    torch.manual_seed(0)
    xs = [torch.randint(0, 257, (4, 32))]
    cola_rows, _ = activation_ranks(build_model("cola-tiny"), xs, alpha=0.9999)
    full_rows, _ = activation_ranks(build_model("llama-tiny"), xs, alpha=0.9999)
    q_cola = [r for r in cola_rows if r.kind == "self_attn.q_proj"]
    q_full = [r for r in full_rows if r.kind == "self_attn.q_proj"]
    assert q_cola and all(r.rank <= 16 and r.dim == 64 for r in q_cola)
    assert all(r.rank > 16 for r in q_full)


def test_rank_cli_on_trained_checkpoint(tmp_path, capsys):
    from slimact.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(model="llama-tiny", strategy="none", steps=2, batch=2, seq=32, eval_every=0,
                      eval_batches=1, out=str(run), progress=False))  # fmt: skip
    p = argparse.ArgumentParser()
    add_rank_arguments(p)
    png = tmp_path / "rank.png"
    args = p.parse_args(["--model", "llama-tiny", "--checkpoint", str(run), "--batches", "2",
                         "--batch", "2", "--seq", "32", "--plot", str(png), "--json"])  # fmt: skip
    assert run_rank(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 2 * 2 * 32 and png.stat().st_size > 1000
    kinds = {row["kind"] for row in out["layers"]}
    assert {"self_attn.q_proj", "mlp.act_fn", "mlp.down_proj"} <= kinds
    assert all(1 <= row["rank"] <= row["dim"] for row in out["layers"])
    with pytest.raises(ValueError, match="does not fit model 'cola-tiny'"):
        load_trained("cola-tiny", run)
    with pytest.raises(FileNotFoundError, match="no ckpt-"):
        load_trained("llama-tiny", tmp_path)


def test_plot_rejects_unknown_kind(tmp_path):
    m = build_model("llama-tiny")
    rows, spectra = activation_ranks(m, [torch.randint(0, 257, (1, 16))])
    with pytest.raises(ValueError, match="kind 'mlp.nope' not among"):
        plot_spectra(rows, spectra, tmp_path / "x.png", kind="mlp.nope")
