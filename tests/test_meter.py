import json

import pytest
import torch
import torch.nn as nn

import slimact
from slimact import sites
from slimact.models import build_model


def test_linear_gelu_linear_counts_exactly_three_tensors():
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    with slimact.measure(m) as meter:
        h1 = m[0](x)
        h2 = m[1](h1)
        m[2](h2).sum().backward()
    r = meter.report
    assert r.total_bytes == x.nbytes + h1.nbytes + h2.nbytes
    by_site = {s.site: s.bytes for s in r.sites}
    assert by_site == {"0:linear#0": x.nbytes, "1:gelu#0": h1.nbytes, "2:linear#0": h2.nbytes}


def test_shared_input_and_views_count_once():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

        def forward(self, x):
            return self.a(x).sum() + self.b(x.view(2, 3, 6)).sum()

    m = TwoHeads()
    x = torch.randn(6, 6, requires_grad=True)
    with slimact.measure(m) as meter:
        m(x)
    r = meter.report
    assert r.total_bytes == x.nbytes
    owner = next(s for s in r.sites if s.bytes)
    assert owner.site == "a:linear#0" and owner.shared_with == ["b:linear#0"]


def test_parameters_and_buffers_are_excluded():
    m = nn.Linear(5, 5)
    m.register_buffer("scale", torch.ones(5))
    x = torch.randn(2, 5)
    with slimact.measure(m) as meter:
        (m(x) * m.scale * m.weight.sum()).sum()
    # linear saves x (40 B); the mul with the buffer saves nothing of ours; mul with
    # weight.sum() saves the linear output and the scalar sum (which is an activation).
    assert meter.report.total_bytes == x.nbytes + 2 * 5 * 4 + 4


def test_site_names_are_stable_across_steps():
    m = build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 8))
    names = []
    for _ in range(2):
        with slimact.measure(m) as meter:
            m(x, targets=x)
        names.append([s.site for s in meter.report.sites])
    assert names[0] == names[1]
    assert "layers.1.mlp.act_fn:silu#0" in names[0]
    assert "layers.0.self_attn.q_proj:linear#0" in names[0]


def test_role_names_custom_functions():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    x = torch.randn(4, requires_grad=True)
    with slimact.measure() as meter, sites.role("double"):
        Double.apply(x * 1)
    assert [s.site for s in meter.report.sites] == [":double#0"]


def test_report_json_table_and_blocks():
    m = build_model("llama-tiny")
    x = torch.randint(0, 257, (2, 16))
    with slimact.measure(m, n_tokens=x.numel()) as meter:
        m(x, targets=x)
    r = meter.report
    d = json.loads(r.to_json())
    assert d["total_bytes"] == r.total_bytes == sum(s["bytes"] for s in d["sites"])
    assert set(d["per_block"]) == {"(outside blocks)", "layers.0", "layers.1"}
    assert d["per_block"]["layers.0"] == d["per_block"]["layers.1"]
    assert "TOTAL" in r.table()


def test_llama_block_bytes_per_token_vs_cola_appendix_c():
    """cola.txt App. C: 20nd + 2n²h per layer. With SDPA (flash on CPU) the n² term is absent.

    Our block, counted exactly (elements per token, d = d_model, f = d_ff):
      2 norms x (input + normalized x̂) = 4d, + 2 rstd scalars
      Q/K/V shared input d; SDPA q, k (after RoPE), v, out = 4d; logsumexp h; o_proj input = SDPA out
      MLP input d; gate out (SiLU in), SiLU out, up out, product = 4f
    """
    m = build_model("llama-tiny")
    cfg = m.config
    d, f, h = cfg.d_model, cfg.d_ff, cfg.n_heads
    x = torch.randint(0, 257, (2, 64))
    with slimact.measure(m, n_tokens=x.numel()) as meter:
        m(x, targets=x)
    per_token_elems = meter.report.bytes_per_token_per_block() / 4
    exact = 4 * d + 2 + d + 4 * d + h + d + 4 * f
    assert per_token_elems == pytest.approx(exact, abs=1e-9)
    paper = 20 * d  # with d_ff = 2.5d in the paper's simplification
    assert abs(per_token_elems - paper) / paper < 0.10


def test_checkpoint_region_stores_only_its_input():
    lin = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    with slimact.measure(lin) as meter, sites.tracking(lin):  # nested tracking is a no-op
        y = torch.utils.checkpoint.checkpoint(lin, x * 1, use_reentrant=False)
    y.sum().backward()
    assert meter.report.total_bytes == x.nbytes  # the checkpoint's saved input, nothing inside
    assert x.grad is not None
