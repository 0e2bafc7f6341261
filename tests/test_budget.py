"""Budgets: parsed once into a typed ``Budget``; one ``--budget`` flag for every CLI."""

from __future__ import annotations

import argparse

import pytest

from slimact.budget import Budget, add_budget_argument
from slimact.strategies.auto import AutoConfig


@pytest.mark.parametrize(
    "text, relative, allowed",
    [
        ("25%", True, 250),
        ("1KiB", False, 1024 - 24),
        ("1.5kB", False, 1500 - 24),
        (2048, False, 2024),
    ],
)
def test_parse_and_allowed(text, relative, allowed):
    b = Budget.parse(text)
    assert b.relative is relative and b.allowed(1000, 24) == allowed
    assert Budget.parse(str(b)) == b  # the text reads back to the same budget
    assert Budget.parse(b) is b


@pytest.mark.parametrize(
    "bad", ["25", "-5%", "0%", "101%", "abc", "0B", "", "1e400GiB", "1e400%", True, 2.5, None]
)
def test_bad_budgets_name_the_value(bad):
    with pytest.raises(ValueError, match="budget") as e:
        Budget.parse(bad)
    assert repr(bad) in str(e.value) or str(bad) in str(e.value)


def test_auto_config_holds_a_parsed_budget():
    cfg = AutoConfig.from_spec("auto@25%")
    assert isinstance(cfg.budget, Budget) and cfg.budget.share == 0.25
    assert cfg == AutoConfig(budget="25%") and cfg.name == "auto@25%"
    with pytest.raises(ValueError, match="no unit"):
        AutoConfig(budget="25")


def test_budget_flag(capsys):
    p = argparse.ArgumentParser()
    add_budget_argument(p)
    assert p.parse_args(["--budget", "6GiB"]).budget == Budget.parse("6GiB")
    assert p.parse_args([]).budget is None
    with pytest.raises(SystemExit):
        p.parse_args(["--budget", "25"])
    assert "'25'" in capsys.readouterr().err
