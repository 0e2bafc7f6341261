"""slimact.gradcheck: the one gradient-error measure of reports and planners."""

from __future__ import annotations

import math

import pytest
import torch

from slimact.gradcheck import NEGLIGIBLE, grad_error, grad_errors, one_minus_cos


def test_one_minus_cos_edges():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert one_minus_cos(a, a) == pytest.approx(0.0, abs=1e-15)
    assert one_minus_cos(-a, a) == pytest.approx(2.0)
    assert one_minus_cos(torch.zeros(3), torch.zeros(3)) == 0.0
    assert one_minus_cos(torch.zeros(3), a) == 1.0  # a vanished gradient
    assert one_minus_cos(torch.tensor([math.nan, 1.0, 1.0]), a) == 2.0  # worst there is
    assert one_minus_cos(torch.tensor([math.inf, 1.0, 1.0]), a) == 2.0
    b = torch.tensor([1.0, 0.0, 0.0], dtype=torch.bfloat16)
    assert one_minus_cos(b, torch.tensor([0.0, 1.0, 0.0])) == pytest.approx(1.0)


def test_negligible_and_missing_gradients():
    big, tiny = torch.ones(4), torch.full((4,), NEGLIGIBLE / 10)
    ref = [big, tiny, None, torch.zeros(4), big]
    got = [big, -tiny, big, big, None]
    errs = grad_errors(got, ref)
    assert errs[0] == pytest.approx(0.0, abs=1e-15)
    assert errs[1:4] == [None, None, None]  # negligible, no reference, a zero reference
    assert errs[4] == 1.0  # missing where the exact one is not negligible: read as zeros
    assert grad_error(got, ref) == 1.0
    assert grad_error([], []) == 0.0


def test_grad_cosine_of_models_is_one_minus_the_worst_error():
    from slimact.compare import grad_cosine

    torch.manual_seed(0)
    base, other = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    other.load_state_dict(base.state_dict())
    x = torch.randn(5, 4)
    base(x).square().sum().backward()
    (other(x).square().sum() + 0.1 * other.bias.sum()).backward()
    g_base = [p.grad for p in base.parameters()]
    g_other = [p.grad for p in other.parameters()]
    assert grad_cosine(base, other) == pytest.approx(1 - grad_error(g_other, g_base))
    assert grad_cosine(base, other) < 1.0
